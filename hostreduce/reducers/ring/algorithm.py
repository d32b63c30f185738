"""Ring collectives over an abstract link to the ring neighbours.

Pure algorithm: it only needs ``link.send(tag, array)`` (to the next rank, may return
before the data is delivered but must not read ``array`` after returning) and
``link.recv(tag)`` (bytes-like payload from the previous rank, in order). That keeps
it testable over an in-memory link, and the gRPC link a separate module.

All-reduce is reduce-scatter then all-gather (2(N-1)/N of the data leaves each rank,
the bandwidth-optimal amount). Each segment moves in chunks and a chunk is forwarded
as soon as it is reduced, so sending, receiving and adding overlap. The rank that
finishes a segment's reduction is the only one that computes it; every other rank
copies its bytes, so all ranks end with bitwise identical results.

With two ranks the ring degenerates to an exchange (``pair_allreduce``): each rank
streams its whole buffer to the other and reduces what comes back. That moves the same
bytes as reduce-scatter plus all-gather (S per rank each way) in one round instead of
two dependent ones.

Wire compression (``Casts``): the all-reduces can run on a 16-bit work buffer filled from
the float inputs chunk by chunk, just before each chunk is first sent or reduced into,
and cast back to the float outputs as each chunk becomes final, so that the casts of
one chunk run while others are on the wire. The values are those of casting the whole
array before and after: every cast and sum is elementwise.
"""
from __future__ import annotations

import bisect
import itertools
from typing import Iterator, Protocol, Sequence

import numpy as np

from ..base import ReduceOp, apply_mean
from ..compression import combine16, from_wire, to_wire

__all__ = ["Link", "Casts", "segment_bounds", "reduce_into", "reduce_pair", "finalize", "ring_allreduce",
           "pair_allreduce", "ring_allgather", "ring_broadcast"]


class Link(Protocol):
    def send(self, tag: int, data: np.ndarray) -> None: ...

    def recv(self, tag: int) -> bytes | memoryview: ...


class Casts:
    """An all-reduce of the flat arrays ``srcs`` into ``dsts`` (an output may be its
    input) that runs on ``buf``, a work buffer of the 16-bit wire dtype holding them end
    to end or as ``layout`` says (a fused bucket): ``fill`` casts the input elements that go to ``buf[lo:hi]``
    into it, ``drain`` casts ``buf[lo:hi]``, once final, into the outputs."""

    def __init__(self, srcs: Sequence[np.ndarray], dsts: Sequence[np.ndarray], buf: np.ndarray,
                 layout: Sequence[tuple[int, int, int, int]] | None = None) -> None:
        self.srcs, self.dsts, self.buf = srcs, dsts, buf
        if layout is None:  # end to end
            starts = itertools.accumulate((s.size for s in srcs), initial=0)
            layout = [(i, 0, s.size, at) for i, (s, at) in enumerate(zip(srcs, starts))]
        # (array, lo, hi, at): the array's [lo, hi) is the buffer's [at, at + hi - lo).
        self.layout = [p for p in layout if p[2] > p[1]]
        self.starts = [p[3] for p in self.layout]

    def _pieces(self, lo: int, hi: int) -> Iterator[tuple[int, int, int, int]]:
        """(i, a, b, k) for each piece of an array that ``[lo, hi)`` overlaps: the array's
        elements ``[a, a + k)`` are the buffer's ``[b, b + k)``."""
        j = bisect.bisect_right(self.starts, lo) - 1
        while lo < hi and j < len(self.layout):
            i, a0, a1, at = self.layout[j]
            end = min(hi, at + a1 - a0)
            if end > lo:
                yield i, a0 + lo - at, lo, end - lo
            lo, j = max(lo, end), j + 1

    def fill(self, lo: int, hi: int) -> None:
        for i, a, b, k in self._pieces(lo, hi):
            to_wire(self.srcs[i][a:a + k], self.buf.dtype, self.buf[b:b + k])

    def drain(self, lo: int, hi: int) -> None:
        for i, a, b, k in self._pieces(lo, hi):
            from_wire(self.buf[b:b + k], self.dsts[i].dtype, self.dsts[i][a:a + k])


class _InPlace(Casts):
    """No casts: the all-reduce runs on its input and output buffer itself."""

    def __init__(self) -> None:
        pass

    def fill(self, lo: int, hi: int) -> None:
        pass

    def drain(self, lo: int, hi: int) -> None:
        pass


_IN_PLACE = _InPlace()


def segment_bounds(n: int, parts: int) -> list[int]:
    """Split ``n`` elements into ``parts`` near-equal contiguous segments."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


UFUNCS = {ReduceOp.SUM: np.add, ReduceOp.MEAN: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
           ReduceOp.PROD: np.multiply}


def reduce_into(dst: np.ndarray, src: np.ndarray, op: ReduceOp, src_first: bool = False) -> None:
    """dst = dst (op) src, elementwise, in place; with ``src_first``, dst = src (op) dst:
    the operand order of the rank whose own data is ``src`` (bitwise identical results,
    NaN payloads and signed zeros included). float16 and bfloat16 sums and products are
    computed in float32 and rounded once, with the bits numpy and ml_dtypes give, in
    vectorised blocks (their own loops go one element at a time)."""
    if combine16(dst, src, UFUNCS[op], src_first):
        return
    if src_first:
        UFUNCS[op](src, dst, out=dst)
    else:
        UFUNCS[op](dst, src, out=dst)


def reduce_pair(out: np.ndarray, a: np.ndarray, b: np.ndarray, op: ReduceOp) -> None:
    """out = a (op) b, elementwise (``reduce_into`` with the first operand elsewhere)."""
    UFUNCS[op](a, b, out=out)


# Turn a sum into a mean (floor division for integers), as every engine does.
finalize = apply_mean


def _chunks(lo: int, hi: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, hi)) for s in range(lo, hi, chunk)]


def incoming(payload: bytes | memoryview, dtype: np.dtype, n: int) -> np.ndarray:
    arr = np.frombuffer(payload, dtype=dtype)
    if arr.size != n:
        raise RuntimeError(f"ring protocol error: expected {n} elements from the previous rank, got {arr.size}")
    return arr


def ring_allreduce(buf: np.ndarray, rank: int, size: int, link: Link, op: ReduceOp,
                   chunk_elems: int, tag: int = 0, casts: Casts = _IN_PLACE,
                   bounds: Sequence[int] | None = None) -> None:
    """All-reduce the flat array ``buf`` in place (with ``casts``: from and to its arrays).
    Segment ``s`` (``bounds[s]`` to ``bounds[s + 1]``; default near-equal) is summed
    starting from rank ``s``'s data."""
    if size > 1 and buf.size:
        bounds = segment_bounds(buf.size, size) if bounds is None else bounds
        seg = lambda s: _chunks(bounds[s], bounds[s + 1], chunk_elems)  # noqa: E731
        for lo, hi in seg(rank):
            casts.fill(lo, hi)
            link.send(tag, buf[lo:hi])
        # Reduce-scatter: at step k receive segment (rank-k-1), add, forward. The last
        # step completes segment (rank+1), which is forwarded as the all-gather's start.
        for step in range(size - 1):
            last = step == size - 2
            for lo, hi in seg((rank - step - 1) % size):
                part = buf[lo:hi]
                casts.fill(lo, hi)
                reduce_into(part, incoming(link.recv(tag), buf.dtype, hi - lo), op)
                if last:
                    finalize(part, op, size)
                link.send(tag, part)
                if last:
                    casts.drain(lo, hi)
        _gather_phase(buf, bounds, rank, size, link, (rank + 1) % size, chunk_elems, tag, casts)
    else:
        casts.fill(0, buf.size)
        finalize(buf, op, size)
        casts.drain(0, buf.size)


# Chunks a rank of a pair sends ahead of the one it reduces: enough to keep the link
# busy through a message's latency, few enough to bound the copies queued for sending.
PAIR_WINDOW = 16


def pair_allreduce(buf: np.ndarray, rank: int, link: Link, op: ReduceOp, chunk_elems: int, tag: int = 0,
                   casts: Casts = _IN_PLACE) -> None:
    """All-reduce the flat array ``buf`` in place between two ranks (``link`` reaches the
    other one both ways; with ``casts``: from and to its arrays). Each chunk is sent
    before it is reduced into, and both ranks apply ``op`` with rank 0's data as the
    first operand."""
    if not buf.size:
        return
    chunks = _chunks(0, buf.size, chunk_elems)
    for lo, hi in chunks[:PAIR_WINDOW]:
        casts.fill(lo, hi)
        link.send(tag, buf[lo:hi])
    for i, (lo, hi) in enumerate(chunks):
        part = buf[lo:hi]
        theirs = incoming(link.recv(tag), buf.dtype, hi - lo)
        reduce_into(part, theirs, op, src_first=rank == 1)
        finalize(part, op, 2)
        if i + PAIR_WINDOW < len(chunks):
            lo2, hi2 = chunks[i + PAIR_WINDOW]
            casts.fill(lo2, hi2)
            link.send(tag, buf[lo2:hi2])
        casts.drain(lo, hi)


def _gather_phase(buf: np.ndarray, bounds: Sequence[int], rank: int, size: int, link: Link,
                  owned: int, chunk_elems: int, tag: int, casts: Casts = _IN_PLACE) -> None:
    # The owned segment has already been sent; receive the others in ring order and
    # forward each chunk unless the next rank is the one it came from.
    for step in range(size - 1):
        s = (owned - step - 1) % size
        for lo, hi in _chunks(bounds[s], bounds[s + 1], chunk_elems):
            buf[lo:hi] = incoming(link.recv(tag), buf.dtype, hi - lo)
            if step < size - 2:
                link.send(tag, buf[lo:hi])
            casts.drain(lo, hi)


def ring_allgather(buf: np.ndarray, counts: Sequence[int], rank: int, size: int, link: Link,
                   chunk_elems: int, tag: int = 0) -> None:
    """All-gather in place: ``buf`` holds every rank's part (``counts`` elements each,
    in rank order); on entry only this rank's part is filled."""
    if size == 1:
        return
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    for lo, hi in _chunks(bounds[rank], bounds[rank + 1], chunk_elems):
        link.send(tag, buf[lo:hi])
    _gather_phase(buf, bounds, rank, size, link, rank, chunk_elems, tag)


def ring_broadcast(buf: np.ndarray, root: int, rank: int, size: int, link: Link,
                   chunk_elems: int, tag: int = 0) -> None:
    """Pipelined chain broadcast of ``root``'s ``buf`` around the ring."""
    if size == 1:
        return
    last = (root - 1) % size
    for lo, hi in _chunks(0, buf.size, chunk_elems):
        if rank != root:
            buf[lo:hi] = incoming(link.recv(tag), buf.dtype, hi - lo)
        if rank != last:
            link.send(tag, buf[lo:hi])
