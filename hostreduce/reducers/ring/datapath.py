"""Runs one planned collective on this rank's data path: the shared-memory group when
every rank is on one host, else the ring over gRPC, where small all-reduces go through
rank 0 with their announcements (and two ranks exchange their buffers: the ring at
N = 2). A process group's collectives (``group``: its world ranks; empty: the world),
and sends and receives, always take the gRPC links between its members
(``collectives.GroupLink``): shared memory is synchronised job-wide. The caller has
already agreed with every rank on what runs next; this module only moves and reduces
the data."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..base import ReduceOp
from ..compression import from_wire, to_wire
from . import algorithm, collectives, shm_scatter
from ._buffers import ResultPool

__all__ = ["DataPath"]


class DataPath:
    def __init__(self, rank: int, size: int, chunk_bytes: int, link: Any = None, shm: Any = None) -> None:
        self.rank, self.size = rank, size
        self._chunk_bytes = chunk_bytes
        self._link = link
        self._shm = shm
        self._fusion: dict[np.dtype, np.ndarray] = {}
        self._results = ResultPool()   # the new arrays collectives return

    def _chunk_elems(self, itemsize: int) -> int:
        return max(1, self._chunk_bytes // itemsize)

    def _on(self, group: Sequence[int]) -> tuple[int, int, Any, Any]:
        """(this rank's rank in ``group``, its size, its link, shared memory or None)."""
        if not group or len(group) == self.size:
            return self.rank, self.size, self._link, self._shm
        me = list(group).index(self.rank)
        return me, len(group), collectives.GroupLink(self._link, group, me), None

    def allreduce(self, arrays: Sequence[np.ndarray], outs: Sequence[np.ndarray], op: ReduceOp, tag: int,
                  gathered: bool = False, parts: Sequence[Sequence[Any]] | None = None,
                  group: Sequence[int] = (), wire: np.dtype | None = None) -> None:
        """Reduce ``arrays`` (one fused bucket) into ``outs``. ``gathered``: every rank
        sent its data to rank 0 with the announcements; ``parts`` (rank 0 only) holds
        each tensor's contributions in rank order. ``wire``: the 16-bit dtype the bucket
        travels and is summed in (wire compression), else the arrays' own dtype. On the
        ring the casts run chunk by chunk inside the pipeline, elsewhere before and after."""
        rank, size, link, shm = self._on(group)
        dtype = arrays[0].dtype if wire is None else np.dtype(wire)
        flats_in = [a.reshape(-1) for a in arrays]
        n = sum(f.size for f in flats_in)
        in_place = len(arrays) == 1 and outs[0].dtype == dtype   # the ring runs on the output itself
        work = outs[0].reshape(-1) if in_place else self._fusion_buffer(dtype, n)
        ring = shm is None and size > 2 and not gathered
        pieces, bounds = _layout([f.size for f in flats_in], size if ring else 1)
        segments = bounds if ring and len(arrays) > 1 else None
        chunk = self._chunk_elems(dtype.itemsize)
        if any(f.dtype != dtype for f in flats_in) and n and size > 1 and shm is None and not gathered:
            casts = algorithm.Casts(flats_in, [o.reshape(-1) for o in outs], work, pieces)
            if size == 2:
                algorithm.pair_allreduce(work, rank, link, op, chunk, tag, casts)
            else:
                algorithm.ring_allreduce(work, rank, size, link, op, chunk, tag, casts, segments)
            return
        flats_in = [f if f.dtype == dtype else to_wire(f, dtype) for f in flats_in]
        if gathered:
            self._gathered(flats_in, parts, work, op, tag)
        elif shm is not None and not shm.direct_available():
            shm.allreduce(flats_in, dtype, n, op, work)
        else:
            for t, lo, hi, at in pieces:
                f = flats_in[t]
                if work[at:].__array_interface__["data"][0] != f[lo:].__array_interface__["data"][0]:
                    work[at:at + hi - lo] = f[lo:hi]
            if shm is not None:
                shm.allreduce_direct(work, op)
            elif size == 2:
                algorithm.pair_allreduce(work, rank, link, op, chunk, tag)
            else:
                algorithm.ring_allreduce(work, rank, size, link, op, chunk, tag, bounds=segments)
            if not in_place:
                for t, lo, hi, at in pieces:
                    from_wire(work[at:at + hi - lo], outs[t].dtype, outs[t].reshape(-1)[lo:hi])
            return
        if not in_place:
            off = 0
            for o in outs:
                from_wire(work[off:off + o.size], o.dtype, o.reshape(-1))
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

    def broadcast(self, array: np.ndarray, root: int, tag: int, group: Sequence[int] = ()) -> np.ndarray:
        rank, size, link, shm = self._on(group)
        out = self._results.empty(array.shape, array.dtype)
        out[...] = array
        flat = out.reshape(-1)
        if size > 1 and flat.size:
            if shm is not None:
                shm.broadcast(flat, root)
            else:
                algorithm.ring_broadcast(flat, root, rank, size, link, self._chunk_elems(out.dtype.itemsize), tag)
        return out

    def allgather(self, array: np.ndarray, counts: Sequence[int], tag: int, group: Sequence[int] = ()) -> np.ndarray:
        rank, size, link, shm = self._on(group)
        inner = array.shape[1:]
        per = _row(inner)
        elems = [c * per for c in counts]
        out = self._results.empty((sum(counts),) + inner, array.dtype)
        flat = out.reshape(-1)
        if shm is not None:
            shm.allgather(np.ascontiguousarray(array).reshape(-1), elems, flat)
        else:
            off = sum(elems[:rank])
            flat[off:off + elems[rank]] = array.reshape(-1)
            if size > 1:
                algorithm.ring_allgather(flat, elems, rank, size, link, self._chunk_elems(out.dtype.itemsize), tag)
        return out

    def reduce_scatter(self, array: np.ndarray, op: ReduceOp, counts: Sequence[int], tag: int,
                       group: Sequence[int] = ()) -> np.ndarray:
        """This rank's rows (``counts`` per group rank) of the reduction of ``array``."""
        rank, size, link, shm = self._on(group)
        per = _row(array.shape[1:])
        bounds = collectives.offsets([c * per for c in counts])
        out = self._results.empty((counts[rank],) + array.shape[1:], array.dtype)
        if shm is not None and size > 1:
            shm_scatter.reduce_scatter(shm, array.reshape(-1), bounds, op, out.reshape(-1))
            return out
        collectives.ring_reduce_scatter(np.ascontiguousarray(array).reshape(-1), out.reshape(-1), bounds, rank, size,
                                        link, op, self._chunk_elems(array.dtype.itemsize), tag)
        return out

    def reduce(self, array: np.ndarray, op: ReduceOp, root: int, tag: int,
               group: Sequence[int] = ()) -> np.ndarray | None:
        """The reduction of ``array`` on the group's ``root``; None elsewhere."""
        rank, size, link, shm = self._on(group)
        out = self._results.empty(array.shape if rank == root or shm is not None else (0,), array.dtype)
        if shm is not None and size > 1:  # one host: as cheap as its all-reduce
            self.allreduce([array], [out], op, tag)
            return out if rank == root else None
        collectives.ring_reduce(np.ascontiguousarray(array).reshape(-1), out.reshape(-1), root, rank, size, link, op,
                                self._chunk_elems(array.dtype.itemsize), tag)
        return out if rank == root else None

    def alltoall(self, array: np.ndarray, splits: Sequence[Sequence[int]], tag: int,
                 group: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """What every group rank sends here (``splits[i][rank]`` rows from rank i), in
        rank order, and those counts."""
        rank, size, link, shm = self._on(group)
        inner = array.shape[1:]
        per = _row(inner)
        received = [row[rank] for row in splits]
        out = self._results.empty((sum(received),) + inner, array.dtype)
        flat = np.ascontiguousarray(array).reshape(-1)
        if shm is not None and size > 1:
            shm_scatter.alltoall(shm, flat, [[c * per for c in row] for row in splits], out.reshape(-1))
        else:
            collectives.alltoallv(flat, [c * per for c in splits[rank]], out.reshape(-1), [c * per for c in received],
                                  rank, size, link, self._chunk_elems(array.dtype.itemsize), tag)
        return out, np.array(received, np.int32)

    def send(self, array: np.ndarray, dst: int, tag: int) -> None:
        """Send ``array`` to world rank ``dst`` (which receives it in the same step)."""
        collectives.send_array(np.ascontiguousarray(array).reshape(-1), dst, self._link,
                               self._chunk_elems(array.dtype.itemsize), tag)

    def recv(self, out: np.ndarray, src: int, tag: int) -> np.ndarray:
        """Receive into ``out`` (C-contiguous) the array world rank ``src`` sends."""
        collectives.recv_array(out.reshape(-1), src, self._link, self._chunk_elems(out.dtype.itemsize), tag)
        return out


def _layout(sizes: Sequence[int], parts: int) -> tuple[list[tuple[int, int, int, int]], list[int]]:
    """Lay a fused bucket out segment by segment: segment ``s`` of the bucket holds segment
    ``s`` of each tensor, so each element is summed in the same rank order whatever else
    shares its bucket (reproducible runs). Returns pieces ``(tensor, lo, hi, offset in the
    bucket)`` and the bucket's segment bounds."""
    cuts = [algorithm.segment_bounds(n, parts) for n in sizes]
    pieces: list[tuple[int, int, int, int]] = []
    bounds, at = [0], 0
    for s in range(parts):
        for t, b in enumerate(cuts):
            if b[s + 1] > b[s]:
                pieces.append((t, b[s], b[s + 1], at))
                at += b[s + 1] - b[s]
        bounds.append(at)
    return pieces, bounds


def _row(inner: tuple[int, ...]) -> int:
    """Elements per row of an array whose rows have shape ``inner``."""
    return int(np.prod(inner, dtype=np.int64)) if inner else 1
