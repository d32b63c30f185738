"""Shared-memory data path between ranks on one host.

Each rank owns a POSIX shared-memory segment split into two regions used alternately
by consecutive collectives (so a fast rank never overwrites data a slow rank still
reads). All-reduce: every rank writes its input into its region; after a barrier,
rank r reduces slice r of all regions into its own region; after a second barrier
every rank copies the reduced slices out. Each slice is computed by one rank only, so
results are bitwise identical everywhere. Barriers are per-rank counters in a small
control segment; waits yield the CPU and give up on a peer failure or a timeout.

Segment names are derived from a per-job random token; files are created with mode
0600 and unlinked on close.
"""
from __future__ import annotations

import mmap
import os
import time
from typing import Callable, Sequence

import numpy as np

from ...errors import PeerLostError
from .algorithm import finalize, reduce_into, segment_bounds
from ..base import ReduceOp

__all__ = ["ShmGroup"]

_DIR = "/dev/shm"
_ALIGN = 64


class _Segment:
    def __init__(self, name: str, nbytes: int, create: bool) -> None:
        self.path = os.path.join(_DIR, name)
        self.nbytes = nbytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            self.map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.owner = create

    def view(self, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
        return np.frombuffer(self.map, dtype=dtype, count=count, offset=offset)

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a numpy view is still alive; the mapping goes with the process
            pass
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class ShmGroup:
    """Collectives through shared memory among ``size`` ranks of one host."""

    def __init__(self, rank: int, size: int, token: str, timeout_s: float,
                 failed: Callable[[], BaseException | None]) -> None:
        self.rank, self.size = rank, size
        self._token = token
        self._timeout = timeout_s
        self._failed = failed
        ctl_name = f"hostreduce-{token}-ctl"
        # Rank 0 creates the control segment before announcing the token to peers.
        self._ctl = _Segment(ctl_name, _ALIGN * size, create=rank == 0) if rank == 0 else None
        self._counters: np.ndarray | None = None
        self._seq = 0
        self._op = 0
        self._cap = [0] * size      # bytes per region of each rank's segment
        self._gen = [0] * size
        self._segs: list[_Segment | None] = [None] * size

    def _ensure_ctl(self) -> np.ndarray:
        if self._counters is None:
            if self._ctl is None:
                self._ctl = _Segment(f"hostreduce-{self._token}-ctl", _ALIGN * self.size, create=False)
            self._counters = self._ctl.view(np.dtype(np.int64), 0, self.size * _ALIGN // 8)[:: _ALIGN // 8]
        return self._counters

    # ------------------------------------------------------------------ sync
    def barrier(self) -> None:
        counters = self._ensure_ctl()
        self._seq += 1
        target = self._seq
        counters[self.rank] = target
        start = time.monotonic()
        spins = 0
        while True:
            if int(counters.min()) >= target:
                return
            spins += 1
            if spins < 200:
                os.sched_yield()
                continue
            err = self._failed()
            if err is not None:
                raise err
            waited = time.monotonic() - start
            if waited > self._timeout:
                late = [r for r in range(self.size) if int(counters[r]) < target]
                raise PeerLostError(
                    f"Rank {self.rank}: ranks {late} did not reach shared-memory barrier #{target} within "
                    f"{self._timeout} s (hung or dead)"
                )
            time.sleep(20e-6 if waited < 0.01 else 200e-6)

    # ------------------------------------------------------------------ buffers
    def _prepare(self, needs: Sequence[int]) -> int:
        """Grow segments so that rank j's region holds ``needs[j]`` bytes (every rank
        computes the same growth from the same negotiated sizes). Returns the region
        index this collective uses."""
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
                    self._segs[j] = _Segment(self._name(j), 2 * cap, create=True)
        region = self._op & 1
        self._op += 1
        return region

    def _name(self, j: int) -> str:
        return f"hostreduce-{self._token}-r{j}-g{self._gen[j]}"

    def _peer(self, j: int) -> _Segment:
        seg = self._segs[j]
        if seg is None:  # created by its owner before the barrier we just passed
            seg = self._segs[j] = _Segment(self._name(j), 2 * self._cap[j], create=False)
        return seg

    def _region(self, j: int, region: int, dtype: np.dtype, count: int) -> np.ndarray:
        seg = self._peer(j)
        return seg.view(dtype, region * self._cap[j], count)

    # ------------------------------------------------------------------ collectives
    def allreduce(self, parts: Sequence[np.ndarray], dtype: np.dtype, n: int, op: ReduceOp,
                  out: np.ndarray) -> None:
        """Reduce the concatenation of flat ``parts`` (n elements) into flat ``out``."""
        if n == 0:
            return
        region = self._prepare([n * dtype.itemsize] * self.size)
        mine = self._region(self.rank, region, dtype, n)
        off = 0
        for p in parts:
            mine[off:off + p.size] = p
            off += p.size
        self.barrier()
        bounds = segment_bounds(n, self.size)
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        if hi > lo:
            acc = mine[lo:hi]
            for j in range(self.size):
                if j != self.rank:
                    reduce_into(acc, self._region(j, region, dtype, n)[lo:hi], op)
            finalize(acc, op, self.size)
        self.barrier()
        for j in range(self.size):
            a, b = bounds[j], bounds[j + 1]
            if b > a:
                out[a:b] = self._region(j, region, dtype, n)[a:b]

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
        self._counters = None
        for seg in self._segs:
            if seg is not None:
                seg.close()
        self._segs = [None] * self.size
        if self._ctl is not None:
            self._ctl.close()
            self._ctl = None
