"""The ``mpi`` reducer's collectives on one communicator (the world's or a group's), as
MPI nonblocking operations driven to completion by the engine's ``wait``.

Reductions run on the wire dtype: float32, float64, int32 and int64 with MPI's
predefined operations, float16 and bfloat16 in 16 bits with ``ops16``'s. ``mean``
is a sum divided afterwards by the communicator's size (integers: floor division;
16-bit floats: divided in float32 and rounded once). Data that is only moved
(broadcast, all-gather, all-to-all) travels as bytes. Collectives whose ranks may pass
different shapes (all-gather, all-to-all) exchange sizes and a fingerprint of dtype and
trailing dimensions first, so a disagreement raises ``TensorMismatchError`` on every
rank rather than corrupting data.
"""
from __future__ import annotations

import zlib
from typing import Any, Callable

import numpy as np

from ...errors import TensorMismatchError
from .._args import ReduceOp, apply_mean, is_low_precision
from .ops16 import op16, wire16

__all__ = ["Collectives"]

# numpy dtype -> name of the MPI predefined datatype reduced natively.
_NATIVE = {
    np.dtype(np.float32): "FLOAT",
    np.dtype(np.float64): "DOUBLE",
    np.dtype(np.int32): "INT32_T",
    np.dtype(np.int64): "INT64_T",
    np.dtype(np.int8): "INT8_T",
    np.dtype(np.uint8): "UINT8_T",
    np.dtype(np.int16): "INT16_T",
    np.dtype(np.uint16): "UINT16_T",
}
_OPS = {ReduceOp.SUM: "SUM", ReduceOp.MEAN: "SUM", ReduceOp.MIN: "MIN", ReduceOp.MAX: "MAX", ReduceOp.PROD: "PROD"}

Wait = Callable[[Any], None]


def _bytes(arr: np.ndarray) -> np.ndarray:
    """A contiguous array as a flat uint8 view (for datatype-agnostic transfers)."""
    return arr.reshape(-1).view(np.uint8)


def _fingerprint(arr: np.ndarray) -> int:
    """A 63-bit number identifying dtype and trailing dimensions."""
    key = f"{arr.dtype.str}|{arr.dtype.name}|{arr.shape[1:]}".encode()
    return zlib.crc32(key) | (len(arr.shape) << 32)


def finish_mean(buf: np.ndarray, op: ReduceOp, size: int) -> None:
    """Turn a reduced sum into the mean in place (16-bit floats divided in float32)."""
    if op is ReduceOp.MEAN and is_low_precision(buf.dtype) and size > 1 and buf.size:
        buf[...] = (buf.astype(np.float32) / np.float32(size)).astype(buf.dtype)
    else:
        apply_mean(buf, op, size)


class Collectives:
    """Collectives on ``comm``; ``wait(request)`` drives a request to completion (and
    raises at the collective's deadline)."""

    def __init__(self, MPI: Any, comm: Any, wait: Wait) -> None:
        self.MPI, self.comm, self.wait = MPI, comm, wait
        self.size = comm.Get_size()

    def _reduction(self, dtype: np.dtype, op: ReduceOp) -> tuple[Any, Any]:
        MPI = self.MPI
        if is_low_precision(dtype):
            return wire16(MPI), op16(MPI, dtype, op)
        return getattr(MPI, _NATIVE[dtype]), getattr(MPI, _OPS[op])

    def allreduce(self, arr: np.ndarray, op: ReduceOp, out: np.ndarray | None) -> np.ndarray:
        MPI = self.MPI
        result = np.empty(arr.shape, arr.dtype) if out is None else out
        target = result if result.flags.c_contiguous else np.empty(arr.shape, arr.dtype)
        src = np.ascontiguousarray(arr)
        dtype, mpi_op = self._reduction(arr.dtype, op)
        if src is target:
            self.wait(self.comm.Iallreduce(MPI.IN_PLACE, [_flat(target), dtype], mpi_op))
        else:
            if np.may_share_memory(src, target):
                src = src.copy()
            self.wait(self.comm.Iallreduce([_flat(src), dtype], [_flat(target), dtype], mpi_op))
        finish_mean(target, op, self.size)
        if target is not result:
            np.copyto(result, target)
        return result

    def reduce(self, arr: np.ndarray, op: ReduceOp, root: int) -> np.ndarray | None:
        src = np.ascontiguousarray(arr)
        dtype, mpi_op = self._reduction(arr.dtype, op)
        mine = self.comm.Get_rank() == root
        result = np.empty(arr.shape, arr.dtype) if mine else None
        recv = [_flat(result), dtype] if result is not None else None
        self.wait(self.comm.Ireduce([_flat(src), dtype], recv, mpi_op, root))
        if result is not None:
            finish_mean(result, op, self.size)
        return result

    def reduce_scatter(self, arr: np.ndarray, op: ReduceOp, counts: list[int]) -> np.ndarray:
        src = np.ascontiguousarray(arr)
        inner = int(np.prod(arr.shape[1:], dtype=np.int64))
        dtype, mpi_op = self._reduction(arr.dtype, op)
        result = np.empty((counts[self.comm.Get_rank()],) + arr.shape[1:], arr.dtype)
        self.wait(self.comm.Ireduce_scatter([_flat(src), dtype], [_flat(result), dtype],
                                            [c * inner for c in counts], mpi_op))
        finish_mean(result, op, self.size)
        return result

    def broadcast(self, arr: np.ndarray, root: int) -> np.ndarray:
        result = np.array(arr, order="C", copy=True)
        self.wait(self.comm.Ibcast([_bytes(result), self.MPI.BYTE], root=root))
        return result

    def _meta(self, name: str, what: str, arr: np.ndarray, rows: np.ndarray, exchange: str) -> np.ndarray:
        """Each rank's ``rows`` (one per rank for an all-to-all, else one) and fingerprint;
        raises ``TensorMismatchError`` on every rank when the fingerprints differ."""
        MPI, size = self.MPI, self.size
        mine = np.empty((len(rows), 2), np.int64)
        mine[:, 0], mine[:, 1] = rows, _fingerprint(arr)
        meta = np.empty((size, 2), np.int64)
        if exchange == "alltoall":
            self.wait(self.comm.Ialltoall([mine, MPI.INT64_T], [meta, MPI.INT64_T]))
        else:
            self.wait(self.comm.Iallgather([mine, MPI.INT64_T], [meta, MPI.INT64_T]))
        if np.any(meta[:, 1] != mine[0, 1]):
            bad = [r for r in range(size) if meta[r, 1] != mine[0, 1]]
            raise TensorMismatchError(
                f"Tensor {name!r}: {what} needs the same dtype and trailing dimensions on every rank; ranks {bad} "
                f"(of the communicator) disagree with this rank (dtype={arr.dtype}, shape={arr.shape})")
        return meta[:, 0]

    def allgather(self, name: str, arr: np.ndarray) -> np.ndarray:
        rows = self._meta(name, "all-gather", arr, np.array([arr.shape[0]]), "allgather")
        src = np.ascontiguousarray(arr)
        counts = rows * (src.itemsize * int(np.prod(src.shape[1:], dtype=np.int64)))
        displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
        result = np.empty((int(rows.sum()),) + src.shape[1:], src.dtype)
        self.wait(self.comm.Iallgatherv([_bytes(src), self.MPI.BYTE],
                                        [_bytes(result), (counts.tolist(), displs.tolist()), self.MPI.BYTE]))
        return result

    def alltoall(self, name: str, arr: np.ndarray, splits: list[int]) -> tuple[np.ndarray, np.ndarray]:
        received = self._meta(name, "all-to-all", arr, np.array(splits), "alltoall")
        src = np.ascontiguousarray(arr)
        row_bytes = src.itemsize * int(np.prod(src.shape[1:], dtype=np.int64))
        send = np.array(splits, np.int64) * row_bytes
        recv = received * row_bytes
        result = np.empty((int(received.sum()),) + src.shape[1:], src.dtype)
        self.wait(self.comm.Ialltoallv(
            [_bytes(src), (send.tolist(), _displs(send)), self.MPI.BYTE],
            [_bytes(result), (recv.tolist(), _displs(recv)), self.MPI.BYTE]))
        return result, received.astype(np.int32)


def _flat(arr: np.ndarray) -> np.ndarray:
    """A contiguous array as flat elements (2-byte floats as uint16, their wire type)."""
    flat = arr.reshape(-1)
    return flat.view(np.uint16) if is_low_precision(arr.dtype) else flat


def _displs(counts: np.ndarray) -> list[int]:
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64).tolist()
