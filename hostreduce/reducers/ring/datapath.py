"""Runs one planned collective on this rank's data path: the shared-memory group when
every rank is on one host, else the ring over gRPC, where small all-reduces go through
rank 0 with their announcements (and two ranks exchange their buffers: the ring at
N = 2). The caller has already agreed with every rank on what
runs next; this module only moves and reduces the data."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..base import ReduceOp
from . import algorithm

__all__ = ["DataPath"]


class DataPath:
    def __init__(self, rank: int, size: int, chunk_bytes: int, link: Any = None, shm: Any = None) -> None:
        self.rank, self.size = rank, size
        self._chunk_bytes = chunk_bytes
        self._link = link
        self._shm = shm
        self._fusion: dict[np.dtype, np.ndarray] = {}

    def _chunk_elems(self, itemsize: int) -> int:
        return max(1, self._chunk_bytes // itemsize)

    def allreduce(self, arrays: Sequence[np.ndarray], outs: Sequence[np.ndarray], op: ReduceOp, tag: int,
                  gathered: bool = False, parts: Sequence[Sequence[Any]] | None = None) -> None:
        """Reduce ``arrays`` (one fused bucket, same dtype) into ``outs``. ``gathered``:
        every rank sent its data to rank 0 with the announcements; ``parts`` (rank 0
        only) holds each tensor's contributions in rank order."""
        dtype = arrays[0].dtype
        flats_in = [a.reshape(-1) for a in arrays]
        n = sum(f.size for f in flats_in)
        work = outs[0].reshape(-1) if len(arrays) == 1 else self._fusion_buffer(dtype, n)
        if gathered:
            self._gathered(flats_in, parts, work, op, tag)
        elif self._shm is not None and not self._shm.direct_available():
            self._shm.allreduce(flats_in, dtype, n, op, work)
        else:
            off = 0
            for f in flats_in:
                if work[off:off + f.size].__array_interface__["data"][0] != f.__array_interface__["data"][0]:
                    work[off:off + f.size] = f
                off += f.size
            if self._shm is not None:
                self._shm.allreduce_direct(work, op)
            elif self.size == 2:
                algorithm.pair_allreduce(work, self.rank, self._link, op, self._chunk_elems(dtype.itemsize), tag)
            else:
                algorithm.ring_allreduce(work, self.rank, self.size, self._link, op,
                                         self._chunk_elems(dtype.itemsize), tag)
        if len(arrays) > 1:
            off = 0
            for o in outs:
                o.reshape(-1)[:] = work[off:off + o.size]
                off += o.size

    def _gathered(self, flats_in: list[np.ndarray], parts: Sequence[Sequence[Any]] | None, work: np.ndarray,
                  op: ReduceOp, tag: int) -> None:
        """Rank 0 holds every rank's data: it reduces each tensor in rank order and sends
        the bucket's result to every other rank, which receives it."""
        if self.rank == 0:
            assert parts is not None
            off = 0
            for f, contributions in zip(flats_in, parts):
                seg = work[off:off + f.size]
                seg[:] = f
                for data in contributions[1:]:
                    algorithm.reduce_into(seg, algorithm.incoming(data, work.dtype, f.size), op)
                algorithm.finalize(seg, op, self.size)
                off += f.size
            for peer in range(1, self.size):
                self._link.send_to(peer, tag, work)
        else:
            work[:] = algorithm.incoming(self._link.recv_from(0, tag), work.dtype, work.size)

    def _fusion_buffer(self, dtype: np.dtype, n: int) -> np.ndarray:
        buf = self._fusion.get(dtype)
        if buf is None or buf.size < n:
            buf = np.empty(max(n, 1 << (max(n, 1) - 1).bit_length()), dtype)
            self._fusion[dtype] = buf
        return buf[:n]

    def broadcast(self, array: np.ndarray, root: int, tag: int) -> np.ndarray:
        out = np.array(array, copy=True, order="C")
        flat = out.reshape(-1)
        if self.size > 1 and flat.size:
            if self._shm is not None:
                self._shm.broadcast(flat, root)
            else:
                algorithm.ring_broadcast(flat, root, self.rank, self.size, self._link,
                                         self._chunk_elems(out.dtype.itemsize), tag)
        return out

    def allgather(self, array: np.ndarray, counts: Sequence[int], tag: int) -> np.ndarray:
        inner = array.shape[1:]
        per = int(np.prod(inner, dtype=np.int64)) if inner else 1
        elems = [c * per for c in counts]
        out = np.empty((sum(counts),) + inner, array.dtype)
        flat = out.reshape(-1)
        if self._shm is not None:
            self._shm.allgather(np.ascontiguousarray(array).reshape(-1), elems, flat)
        else:
            off = sum(elems[: self.rank])
            flat[off:off + elems[self.rank]] = array.reshape(-1)
            if self.size > 1:
                algorithm.ring_allgather(flat, elems, self.rank, self.size, self._link,
                                         self._chunk_elems(out.dtype.itemsize), tag)
        return out
