"""Reduce-scatter, reduce, all-to-all and point-to-point over an abstract link, and the
link of a process group.

Pure algorithms, like ``algorithm.py``: a link has ``send``/``recv`` (ring neighbours)
and ``send_to``/``recv_from`` (any rank), ranks counted in the group. ``GroupLink``
maps a group's ranks onto the job's link, so every algorithm runs on any group.

Reduce-scatter is the first half of the ring all-reduce: N - 1 steps, each rank sends
(N - 1)/N of the data, the bandwidth-optimal amount. The segments are offset by one from
the all-reduce's so that rank r ends owning segment r (the rows ``counts[r]``): segment
s starts at rank s + 1 and travels the ring, each rank reducing its own part into it,
until rank s adds the last. Each segment is reduced by one rank only, in a fixed
order, so the result does not depend on timing. Reduce to a root is a reduce-scatter of
near-equal segments, then every rank sends its segment to the root (Rabenseifner's
reduce). All-to-all and point-to-point send each piece straight to its rank, in chunks,
and the receiver knows every size from the plan, so both sides agree on every frame.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..base import ReduceOp
from .algorithm import Link, finalize, incoming, reduce_pair, segment_bounds

__all__ = ["GroupLink", "ring_reduce_scatter", "ring_reduce", "alltoallv", "send_array", "recv_array",
           "offsets"]


class GroupLink:
    """A group's view of the job's ``link``: rank i of the group is world rank
    ``ranks[i]``; ``me`` is this process's group rank."""

    def __init__(self, link: Any, ranks: Sequence[int], me: int) -> None:
        self._link, self._ranks, self._me = link, tuple(ranks), me
        n = len(self._ranks)
        self._next, self._prev = self._ranks[(me + 1) % n], self._ranks[(me - 1) % n]

    def send(self, tag: int, data: np.ndarray) -> None:
        self._link.send_to(self._next, tag, data)

    def recv(self, tag: int) -> bytes | memoryview:
        return self._link.recv_from(self._prev, tag)

    def send_to(self, dst: int, tag: int, data: np.ndarray) -> None:
        self._link.send_to(self._ranks[dst], tag, data)

    def recv_from(self, src: int, tag: int) -> bytes | memoryview:
        return self._link.recv_from(self._ranks[src], tag)


def offsets(counts: Sequence[int]) -> list[int]:
    """``counts`` as bounds: [0, c0, c0 + c1, ...]."""
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + int(c))
    return bounds


def _chunks(lo: int, hi: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, hi)) for s in range(lo, hi, chunk)]


def ring_reduce_scatter(src: np.ndarray, out: np.ndarray, bounds: Sequence[int], rank: int, size: int,
                        link: Link, op: ReduceOp, chunk_elems: int, tag: int = 0) -> None:
    """Reduce-scatter the flat ``src`` (not written): ``out`` receives segment ``bounds[rank]:
    bounds[rank + 1]`` reduced over every rank (a mean divided)."""
    base = bounds[rank]
    if size > 1:
        seg = lambda s: _chunks(bounds[s], bounds[s + 1], chunk_elems)  # noqa: E731
        for lo, hi in seg((rank - 1) % size):
            link.send(tag, src[lo:hi])
        scratch = np.empty(min(chunk_elems, max(src.size, 1)), src.dtype)
        # At step k receive segment (rank - k - 2), add this rank's part, forward; the
        # last step (k = N - 2) completes this rank's own segment, into ``out``.
        for step in range(size - 1):
            last = step == size - 2
            for lo, hi in seg((rank - step - 2) % size):
                theirs = incoming(link.recv(tag), src.dtype, hi - lo)
                part = out[lo - base:hi - base] if last else scratch[:hi - lo]
                reduce_pair(part, src[lo:hi], theirs, op)
                if not last:
                    link.send(tag, part)  # the link copies what it sends
    else:
        out[:] = src[bounds[rank]:bounds[rank + 1]]
    finalize(out, op, size)


def ring_reduce(src: np.ndarray, out: np.ndarray | None, root: int, rank: int, size: int, link: Link,
                op: ReduceOp, chunk_elems: int, tag: int = 0) -> None:
    """Reduce the flat ``src`` (not written) into ``out`` (flat, as large) on ``root``;
    ``out`` is not used on the other ranks."""
    bounds = segment_bounds(src.size, size)
    lo, hi = bounds[rank], bounds[rank + 1]
    mine = out[lo:hi] if rank == root else np.empty(hi - lo, src.dtype)
    ring_reduce_scatter(src, mine, bounds, rank, size, link, op, chunk_elems, tag)
    if rank != root:
        for a, b in _chunks(0, hi - lo, chunk_elems):
            link.send_to(root, tag, mine[a:b])
        return
    for peer in range(size):
        if peer != root:
            for a, b in _chunks(bounds[peer], bounds[peer + 1], chunk_elems):
                out[a:b] = incoming(link.recv_from(peer, tag), src.dtype, b - a)


def alltoallv(send: np.ndarray, send_counts: Sequence[int], out: np.ndarray, recv_counts: Sequence[int],
              rank: int, size: int, link: Link, chunk_elems: int, tag: int = 0) -> None:
    """Flat all-to-all: ``send_counts[j]`` elements of ``send`` (in order) go to rank j;
    ``out`` receives ``recv_counts[i]`` elements from rank i, in rank order."""
    sb, rb = offsets(send_counts), offsets(recv_counts)
    out[rb[rank]:rb[rank + 1]] = send[sb[rank]:sb[rank + 1]]
    for k in range(1, size):  # send everything first: sends never wait for the receiver
        dst = (rank + k) % size
        for lo, hi in _chunks(sb[dst], sb[dst + 1], chunk_elems):
            link.send_to(dst, tag, send[lo:hi])
    for k in range(1, size):
        src = (rank - k) % size
        for lo, hi in _chunks(rb[src], rb[src + 1], chunk_elems):
            out[lo:hi] = incoming(link.recv_from(src, tag), out.dtype, hi - lo)


def send_array(flat: np.ndarray, dst: int, link: Link, chunk_elems: int, tag: int = 0) -> None:
    for lo, hi in _chunks(0, flat.size, chunk_elems):
        link.send_to(dst, tag, flat[lo:hi])


def recv_array(flat: np.ndarray, src: int, link: Link, chunk_elems: int, tag: int = 0) -> None:
    for lo, hi in _chunks(0, flat.size, chunk_elems):
        flat[lo:hi] = incoming(link.recv_from(src, tag), flat.dtype, hi - lo)
