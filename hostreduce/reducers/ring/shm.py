"""Shared-memory data path between ranks on one host.

Each rank owns a POSIX shared-memory segment split into two regions used alternately
by consecutive collectives (so a fast rank never overwrites data a slow rank still
reads). All-reduce: every rank writes its input into its region; after a barrier,
rank r reduces slice r of all regions into its own region; after a second barrier
every rank copies the reduced slices out. Each slice is computed by one rank only, so
results are bitwise identical everywhere. Each element is reduced in rank order,
x_0 op x_1 op ... op x_{N-1}, whichever rank computes it: where an element lands in a
fused bucket (so which rank reduces it) depends on timing, and its bits must not, or
two runs of the same job would differ. Where every rank may read its peers' memory
(``_cma.py``), an all-reduce reads the peers' buffers directly instead (one copy less).
The counters that order these steps, and the waits for them, are the control
segment's (``shm_sync.py``).

Segments grow to the largest collective seen; their names last only while they grow.
"""
from __future__ import annotations

import os
from typing import Callable, Sequence

import numpy as np

from ...errors import PeerLostError
from .algorithm import UFUNCS, finalize, reduce_into, segment_bounds
from .shm_sync import ControlBlock, Segment, Waiter
from ..base import ReduceOp

__all__ = ["ShmGroup"]

BLOCK_BYTES = 1024 * 1024


def _reduce_in_rank_order(acc: np.ndarray, rank: int, size: int, op: ReduceOp,
                          fetch: Callable[[int, np.ndarray | None], np.ndarray],
                          tmp: np.ndarray | None, head: np.ndarray | None) -> None:
    """``acc`` holds this rank's operand x_rank; make it x_0 op x_1 op ... op x_{size-1},
    left to right, as rank 0 computes it. ``fetch(j, dst)`` gives rank j's operand (read
    into ``dst``, or a view); ``tmp`` receives the ranks after this one; ``head`` (ranks
    >= 2) accumulates the ranks before it. As many passes as own-operand-first."""
    if rank == 1:
        reduce_into(acc, fetch(0, tmp), op, src_first=True)
    elif rank > 1:
        assert head is not None
        x0 = fetch(0, head)
        if x0 is head:
            reduce_into(head, fetch(1, tmp), op)
        else:
            UFUNCS[op](x0, fetch(1, tmp), out=head)
        for j in range(2, rank):
            reduce_into(head, fetch(j, tmp), op)
        reduce_into(acc, head, op, src_first=True)
    for j in range(rank + 1, size):
        reduce_into(acc, fetch(j, tmp), op)


class ShmGroup:
    """Collectives through shared memory among the ranks of ``control``'s job."""

    def __init__(self, control: ControlBlock, token: str, use_cma: bool = True) -> None:
        self.rank, self.size = control.rank, control.size
        self.control = control
        self._token = token
        self._direct: bool | None = None if use_cma else False
        self._direct_ops = 0
        self._probe = np.full(8, 0x5EED0000 + self.rank, np.int64)
        self._pids: list[int] = []
        self._copied_base = 0
        self._reduced_base = [0] * self.size
        self._op = 0
        self._cap = [0] * self.size      # bytes per region of each rank's segment
        self._gen = [0] * self.size
        self._segs: list[Segment | None] = [None] * self.size
        self._tmp: list[np.ndarray | None] = [None, None]   # block-sized scratch

    def barrier(self) -> None:
        self.control.barrier()

    # ------------------------------------------------------------------ single-copy path
    def direct_available(self) -> bool:
        """Whether every rank can read every peer's memory (probed once, collectively)."""
        if self._direct is None:
            from . import _cma

            w = self.control.ensure()
            ok = _cma.available()
            if ok:
                _cma.allow_peers()
            w["pid"][self.rank] = os.getpid()
            w["addr"][self.rank] = self._probe.ctypes.data
            self.barrier()
            if ok:
                got = np.zeros(8, np.int64)
                for j in range(self.size):
                    if j == self.rank:
                        continue
                    try:
                        _cma.read_into(int(w["pid"][j]), int(w["addr"][j]), got)
                    except OSError:
                        ok = False
                        break
                    if int(got[0]) != 0x5EED0000 + j:
                        ok = False
                        break
            w["cma_ok"][self.rank] = 1 if ok else 2
            self.barrier()
            self._direct = all(int(v) == 1 for v in w["cma_ok"])
            self._pids = [int(p) for p in w["pid"]]
        return bool(self._direct)

    def allreduce_direct(self, buf: np.ndarray, op: ReduceOp) -> None:
        """All-reduce the private flat array ``buf`` in place, reading peers' buffers
        directly (no shared segment): rank r reduces slice r from every peer's buffer,
        then copies every other slice from its owner. Three counter waits per call."""
        from . import _cma

        n = buf.size
        if n == 0:
            return
        w = self.control.words
        size, rank = self.size, self.rank
        self._direct_ops += 1
        seq = self._direct_ops
        w["addr"][rank] = buf.ctypes.data
        target_c = self._copied_base + 1
        self.control.post("copied", target_c)
        bounds = segment_bounds(n, size)
        waiter = Waiter(self.control, "a direct all-reduce (buffers published)")
        while int(w["copied"].min()) < target_c:
            waiter.idle(lambda: [j for j in range(size) if int(w["copied"][j]) < target_c])
        addrs = [int(a) for a in w["addr"]]
        item = buf.dtype.itemsize
        lo, hi = bounds[rank], bounds[rank + 1]
        block = max(1, BLOCK_BYTES // item)
        count = min(block, max(hi - lo, 1))
        tmp, head = self._scratch(buf.dtype, count, 0), self._scratch(buf.dtype, count, 1)
        try:
            for a in range(lo, hi, block):
                b = min(hi, a + block)
                acc = buf[a:b]

                def fetch(j: int, dst: np.ndarray | None) -> np.ndarray:
                    assert dst is not None
                    _cma.read_into(self._pids[j], addrs[j] + a * item, dst)
                    return dst

                _reduce_in_rank_order(acc, rank, size, op, fetch, tmp[: b - a], head[: b - a])
                finalize(acc, op, size)
            self.control.post("reduced", self._reduced_base[rank] + 1)
            for k in range(1, size):
                j = (rank + k) % size
                target_r = self._reduced_base[j] + 1
                waiter = Waiter(self.control, f"rank {j}'s reduced slice")
                while int(w["reduced"][j]) < target_r:
                    waiter.idle(lambda: [j] if int(w["reduced"][j]) < target_r else [])
                a, b = bounds[j], bounds[j + 1]
                _cma.read_into(self._pids[j], addrs[j] + a * item, buf[a:b])
        except OSError as e:
            raise PeerLostError(f"Rank {rank}: reading rank {j}'s buffer failed ({e}); rank {j} has probably "
                                "exited") from None
        self._copied_base += 1
        for j in range(size):
            self._reduced_base[j] += 1
        self.control.post("done", seq)
        waiter = Waiter(self.control, "the end of a direct all-reduce")
        while int(w["done"].min()) < seq:  # peers may still be reading our slice
            waiter.idle(lambda: [j for j in range(size) if int(w["done"][j]) < seq])

    def _scratch(self, dtype: np.dtype, count: int, slot: int) -> np.ndarray:
        buf = self._tmp[slot]
        if buf is None or buf.nbytes < count * dtype.itemsize:
            buf = self._tmp[slot] = np.empty(max(count * dtype.itemsize, BLOCK_BYTES), np.uint8)
        return buf[: count * dtype.itemsize].view(dtype)

    # ------------------------------------------------------------------ buffers
    def _prepare(self, needs: Sequence[int]) -> int:
        """Grow segments so that rank j's region holds ``needs[j]`` bytes (every rank
        computes the same growth from the same negotiated sizes). Returns the region
        index this collective uses."""
        grew = False
        for j, need in enumerate(needs):
            if need > self._cap[j]:
                cap = max(1 << 16, 1 << (need - 1).bit_length())
                self._cap[j] = cap
                self._gen[j] += 1
                old = self._segs[j]
                self._segs[j] = None
                if old is not None:
                    old.close()
                if j == self.rank:
                    self._segs[j] = Segment(self._name(j), 2 * cap, create=True)
                grew = True
        if grew:
            # Attach to every new segment once its owner created it, then remove the
            # names at once: the mappings stay valid and names last only while a
            # segment grows.
            self.barrier()
            for j in range(self.size):
                self._peer(j) if self._cap[j] else None
            self.barrier()
            own = self._segs[self.rank]
            if own is not None:
                own.unlink()
        region = self._op & 1
        self._op += 1
        return region

    def _name(self, j: int) -> str:
        return f"hostreduce-{self._token}-r{j}-g{self._gen[j]}"

    def _peer(self, j: int) -> Segment:
        seg = self._segs[j]
        if seg is None:  # created by its owner before the barrier we just passed
            seg = self._segs[j] = Segment(self._name(j), 2 * self._cap[j], create=False)
        return seg

    def _region(self, j: int, region: int, dtype: np.dtype, count: int) -> np.ndarray:
        seg = self._peer(j)
        return seg.view(dtype, region * self._cap[j], count)

    # ------------------------------------------------------------------ collectives
    def allreduce(self, parts: Sequence[np.ndarray], dtype: np.dtype, n: int, op: ReduceOp,
                  out: np.ndarray) -> None:
        """Reduce the concatenation of flat ``parts`` (n elements) into flat ``out``.

        Pipelined in cache-sized blocks: every rank copies block b in and bumps its
        "copied" counter; block b's owner (b mod size) reduces it once every rank has
        copied it and bumps its "reduced" counter; every rank copies it out once it is
        reduced. A block stays in cache between the three steps, and no full-buffer
        barrier separates them.
        """
        if n == 0:
            return
        w = self.control.ensure()
        copied, reduced = w["copied"], w["reduced"]
        region = self._prepare([n * dtype.itemsize] * self.size)
        views = [self._region(j, region, dtype, n) for j in range(self.size)]
        mine = views[self.rank]
        block = max(1, BLOCK_BYTES // dtype.itemsize)
        nblocks = -(-n // block)
        size, rank = self.size, self.rank
        base_c = self._copied_base
        base_r = self._reduced_base
        owned = list(range(rank, nblocks, size))
        # Input pieces as (start, array) for copying block by block.
        starts, off = [], 0
        for p in parts:
            starts.append(off)
            off += p.size
        piece = 0
        n_in = n_red = n_out = 0
        waiter = Waiter(self.control, "a shared-memory all-reduce step")
        while n_out < nblocks:
            progressed = False
            if n_in < nblocks:
                lo, hi = n_in * block, min(n, (n_in + 1) * block)
                while piece < len(parts) and starts[piece] + parts[piece].size <= lo:
                    piece += 1
                k = piece
                while k < len(parts) and starts[k] < hi:
                    a, b = max(lo, starts[k]), min(hi, starts[k] + parts[k].size)
                    mine[a:b] = parts[k][a - starts[k]: b - starts[k]]
                    k += 1
                n_in += 1
                self.control.post("copied", base_c + n_in)
                progressed = True
            while n_red < len(owned) and int(copied.min()) >= base_c + owned[n_red] + 1:
                b = owned[n_red]
                lo, hi = b * block, min(n, (b + 1) * block)
                acc = mine[lo:hi]
                _reduce_in_rank_order(acc, rank, size, op, lambda j, _: views[j][lo:hi], None,
                                      self._scratch(dtype, hi - lo, 1) if rank > 1 else None)
                finalize(acc, op, size)
                n_red += 1
                self.control.post("reduced", base_r[rank] + n_red)
                progressed = True
            while n_out < nblocks:
                owner = n_out % size
                if int(reduced[owner]) < base_r[owner] + n_out // size + 1:
                    break
                lo, hi = n_out * block, min(n, (n_out + 1) * block)
                out[lo:hi] = views[owner][lo:hi]
                n_out += 1
                progressed = True
            if not progressed:
                def blocking() -> list[int]:
                    # The ranks this rank waits for right now, first the one it needs next.
                    late = []
                    if n_red < len(owned):
                        late += [j for j in range(size) if int(copied[j]) < base_c + owned[n_red] + 1]
                    owner = n_out % size
                    if owner != rank and int(reduced[owner]) < base_r[owner] + n_out // size + 1:
                        late.append(owner)
                    return late

                waiter.idle(blocking)
        self._copied_base = base_c + nblocks
        for j in range(size):
            base_r[j] += len(range(j, nblocks, size))

    def allgather(self, part: np.ndarray, counts: Sequence[int], out: np.ndarray) -> None:
        dtype = part.dtype
        if not sum(counts):
            return
        region = self._prepare([c * dtype.itemsize for c in counts])
        if part.size:
            self._region(self.rank, region, dtype, part.size)[:] = part
        self.barrier()
        off = 0
        for j, c in enumerate(counts):
            if c:
                out[off:off + c] = self._region(j, region, dtype, c)
            off += c

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        nbytes = buf.size * buf.dtype.itemsize
        region = self._prepare([nbytes if j == root else 0 for j in range(self.size)])
        if self.rank == root:
            self._region(root, region, buf.dtype, buf.size)[:] = buf
        self.barrier()
        if self.rank != root:
            buf[:] = self._region(root, region, buf.dtype, buf.size)

    def close(self) -> None:
        for seg in self._segs:
            if seg is not None:
                seg.close()
        self._segs = [None] * self.size
        self.control.close()
