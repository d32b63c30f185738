"""``RingReducer``: the gRPC ring engine behind the common reducer interface.

This module only wires the planes together; each has a module of its own:

- ``pending.py``: the table of submitted collectives, where the planes meet;
- ``messages.py``: the typed messages ranks exchange, and their one codec;
- ``startup.py``: the mesh, the agreed data path and the one-host paths;
- ``control.py``: announcements, and rank 0's coordinator that publishes plans;
- ``execution.py``: running the plans on the data path (``datapath.py``);
- ``fastlane.py``: on one host, a blocking all-reduce that skips rank 0;
- ``liveness.py``: heartbeats, and naming the peer to blame when a wait runs out.

Threads: the caller submits and announces; rank 0's coordinator (driven by incoming
announcements) issues the plan; one executor thread per rank runs the plan in order
(on a one-host follower, the pipe's reader runs it), and completes the handles; an
announcer thread batches announcements, and a watchdog beats and checks.

Faults are named for what they are: a mismatch (``TensorMismatchError``), ranks all
waiting for collectives that differ (``UnmatchedCollectiveError``, see
``negotiation.py``), a peer that stopped answering or failed (``PeerLostError`` naming
it), a peer that closed in an orderly way.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ...config import Config
from ...errors import ConfigError, PeerLostError, ReducerClosedError
from ..base import Group, Handle, ReduceOp, Reducer
from ..registry import register_reducer
from .control import Control
from .datapath import DataPath
from .execution import Execution
from .fastlane import FastLane
from .liveness import Liveness, NamingLink, Watchdog
from .messages import JOIN_NAME, Beat, Blocked, Departed, Join, Message, Plan, Ready, Welcome, decode, encode
from .pending import Pending, PendingHandle, PendingTable
from .startup import Paths, Startup

__all__ = ["RingReducer"]

log = logging.getLogger("hostreduce.ring")


@register_reducer("ring")
class RingReducer(Reducer):
    """Ring all-reduce between the workers of a ``TF_CONFIG`` cluster.

    Args:
        cluster: a ``ClusterSpec`` with every rank's address (default: resolved from
            ``TF_CONFIG``).
        config: a ``Config`` (default: from ``HOSTREDUCE_*`` variables). ``secret`` is
            required when there is more than one worker.
    """

    out_contiguous = True  # results are written through flat views

    def __init__(self, cluster: Any = None, config: Config | None = None) -> None:
        from ...cluster import resolve_cluster

        self._cluster = resolve_cluster() if cluster is None else cluster
        self._config = cfg = Config.from_env() if config is None else config
        super().__init__(compression=cfg.compression)
        self._rank, self._size = rank, size = self._cluster.rank, self._cluster.size
        if cfg.log_level:
            logging.getLogger("hostreduce").setLevel(cfg.log_level.upper())
        if size > 1:
            if not self._cluster.addresses:
                raise ConfigError(
                    "The 'ring' reducer needs every worker's address: start workers with TF_CONFIG "
                    "(or `hostreduce run -np N`). Received: a cluster without addresses "
                    f"(source={self._cluster.source!r}); under mpirun use the 'mpi' or 'horovod' reducer"
                )
            if not cfg.secret:
                raise ConfigError(
                    "The 'ring' reducer needs a shared secret to admit only this job's workers: set "
                    "HOSTREDUCE_SECRET to the same value on every worker (`hostreduce run` does this). "
                    "Received: secret=None"
                )
        self._barriers: dict[str, int] = {}   # barriers so far, per group
        self._table = table = PendingTable(rank)
        self._paths = paths = Paths()
        self._live = live = Liveness(rank, size, cfg.timeout_s, table)
        self._execution = Execution(rank, size, cfg.timeout_s, table, fail=self._fail,
                                    explain_os_error=live.explain_os_error,
                                    joined_barrier=lambda: self._count_barrier(self.world))
        self._control = Control(rank, size, cfg, paths, table, run_plan=self._execution.accept, fail=self._fail)
        self._startup = Startup(rank, size, tuple(self._cluster.addresses), cfg, paths, live,
                                on_message=self._on_payload, on_local=self._on_local,
                                on_peer_lost=self._on_peer_lost, on_departed=self._on_departed,
                                failed=lambda: table.error)
        self._lane: FastLane | None = None   # one host only
        self._watchdog: Watchdog | None = None
        if size > 1 and cfg.tune_malloc:
            from ...transport.malloc import tune_malloc

            tune_malloc()
        try:
            if size > 1:
                self._startup.run()
        except BaseException as e:
            # A configuration refusal is an orderly goodbye; anything else is not. A file
            # of the job that went away means a peer failed: say which, not the path.
            err = live.explain_os_error(e) if isinstance(e, OSError) else e
            self._shutdown(graceful=isinstance(err, ConfigError))
            if err is e:
                raise
            raise err from None
        link = None if paths.link is None else NamingLink(paths.link, live.explain_timeout)
        if paths.shm is not None and cfg.fast_lane and FastLane.supported():
            self._lane = FastLane(paths.shm.control, table, self._control, self._execution, timeout_s=cfg.timeout_s,
                                  submit=self._allreduce_async, fail=self._fail,
                                  explain_departure=live.explain_departure)
        self._control.start()
        self._execution.start(DataPath(rank, size, cfg.chunk_bytes, link, paths.shm),
                              inline=paths.transport == "shm" and rank != 0)
        if size > 1:
            # With the lane, every 50 ms: a peer may wait on this rank's lane word.
            self._watchdog = Watchdog(live, 0.05 if self._lane is not None else 0.1, self._fail,
                                      self._on_tick).start()
        self._register_live()

    # ------------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def transport(self) -> str:
        """The data path: "local" (one rank), "grpc", "tcp" or "shm"."""
        return self._paths.transport

    @property
    def _shm(self) -> Any:
        return self._paths.shm

    def stats(self) -> dict[str, int]:
        """Counts since start: all-reduced tensors and the fused buckets that carried
        them, and the all-reduces that took the fast lane."""
        return dict(self._table.stats)

    # ------------------------------------------------------------------ collectives
    def _submit(self, name: str, kind: str, arr: np.ndarray, out: np.ndarray | None, op: ReduceOp,
                root: int, group: Group | None = None, counts: list[int] | None = None,
                wire: np.dtype | None = None) -> PendingHandle:
        handle = PendingHandle(name, self._control.wait_blocked)
        ranks = None if group is None or group.size == self._size else group.ranks
        entry = self._control.entry(name, kind, arr, op, root, ranks, counts, wire)
        with self._table.lock:
            in_flight = self._table.admit(name, Pending(kind, arr, out, op, root, handle, wire))
            if self._lane is not None and self._lane.hold(entry):
                return handle  # announced when the lane is released
        self._control.announce(entry, alone=in_flight == 1)
        return handle

    # Every collective goes through rank 0's plan; ``root``, ``dst``, ``src`` and counts
    # are group ranks, and a group's data moves between its members (``datapath.py``).
    def _allreduce_async(self, name: str, arr: np.ndarray, op: ReduceOp, out: np.ndarray | None,
                         group: Group | None = None) -> PendingHandle:
        return self._submit(name, "allreduce", arr, out, op, 0, group)

    def _allreduce_wire_async(self, name: str, arr: np.ndarray, op: ReduceOp, out: np.ndarray | None,
                              group: Group, wire: np.dtype) -> Handle:
        # Announced as ``wire``; the data path casts inside its pipeline (``datapath.py``).
        return self._submit(name, "allreduce", arr, out, op, 0, group, wire=wire)

    def _allreduce(self, name: str, arr: np.ndarray, op: ReduceOp, out: np.ndarray | None,
                   group: Group | None = None) -> np.ndarray:
        if self._lane is None or (group is not None and group.size != self._size):
            return super()._allreduce(name, arr, op, out, group if group is not None else self.world)
        return self._lane.allreduce(name, arr, op, out)

    def _broadcast_async(self, name: str, arr: np.ndarray, root: int, group: Group) -> Handle:
        return self._submit(name, "broadcast", arr, None, ReduceOp.SUM, root, group)

    def _allgather_async(self, name: str, arr: np.ndarray, group: Group) -> Handle:
        return self._submit(name, "allgather", arr, None, ReduceOp.SUM, 0, group)

    def _reduce_scatter_async(self, name: str, arr: np.ndarray, op: ReduceOp, counts: list[int],
                              group: Group) -> Handle:
        return self._submit(name, "reducescatter", arr, None, op, 0, group, counts)

    def _reduce_async(self, name: str, arr: np.ndarray, op: ReduceOp, root: int, group: Group) -> Handle:
        return self._submit(name, "reduce", arr, None, op, root, group)

    def _alltoall_async(self, name: str, arr: np.ndarray, splits: list[int], group: Group) -> Handle:
        return self._submit(name, "alltoall", arr, None, ReduceOp.SUM, 0, group, splits)

    def _send_async(self, name: str, arr: np.ndarray, dst: int, group: Group) -> Handle:
        return self._submit(name, "send", arr, None, ReduceOp.SUM, dst, group)

    def _recv_async(self, name: str, shape: tuple[int, ...], dtype: np.dtype, src: int, group: Group) -> Handle:
        # The array received into: announced for its shape and dtype, then filled.
        return self._submit(name, "recv", np.empty(shape, dtype), None, ReduceOp.SUM, src, group)

    def _count_barrier(self, group: Group) -> int:
        """The number of ``group``'s barrier that this rank enters (or passes as joined)."""
        count = self._barriers[group.key] = self._barriers.get(group.key, 0) + 1
        return count

    def _barrier(self, timeout: float | None, group: Group) -> None:
        count = self._count_barrier(group)
        where = "" if group.size == self._size else f"{group.key}/"
        handle = self._submit(f"__barrier__/{where}{count}", "barrier", np.zeros(0, np.float32), None,
                              ReduceOp.SUM, 0, group)
        handle.wait(timeout if timeout is not None else self._config.timeout_s * 2)

    def _join(self, timeout: float | None) -> int:
        # Announced after everything this rank announced before; rank 0 plans the job's
        # all-reduces with this rank's zeros until every rank has joined (negotiation.py).
        handle = self._submit(JOIN_NAME, "join", np.zeros(0, np.float32), None, ReduceOp.SUM, 0)
        if self._lane is not None and timeout is None:
            # Peers that try the fast lane meanwhile find this rank's "slow" word at once.
            return int(self._lane.await_negotiated(handle))
        return int(handle.wait(timeout))

    # ------------------------------------------------------------------ incoming
    def _on_payload(self, src: int, payload: memoryview) -> None:
        """A control message from ``src`` over gRPC."""
        try:
            self._on_message(src, decode(payload))
        except Exception as e:  # a message that cannot be handled: the job cannot go on
            self._fail(PeerLostError(f"Rank {self._rank}: control message from rank {src} failed: "
                                     f"{type(e).__name__}: {e}"))

    def _on_local(self, payload: bytes) -> None:
        """A control message through this rank's pipe (its sender is in it)."""
        try:
            msg = decode(payload)
            self._on_message(msg.rank, msg)
        except Exception as e:  # keep the pipe's reader alive; the job cannot go on
            self._fail(PeerLostError(f"Rank {self._rank}: control message failed: {type(e).__name__}: {e}"))

    def _on_message(self, src: int, msg: Message) -> None:
        self._live.heard(src)
        if isinstance(msg, Plan):
            # A one-host follower's pipe reader runs the plan itself, in arrival order.
            self._execution.accept(msg.steps)
        elif isinstance(msg, Ready):
            self._control.on_ready(src, msg)
        elif isinstance(msg, Blocked):
            self._control.on_blocked(src, msg)
        elif isinstance(msg, (Join, Welcome)):
            self._startup.deliver(msg)
        elif isinstance(msg, Departed):
            self._execution.coordinator_left(through_pipe=True)
        elif not isinstance(msg, Beat):
            raise ValueError(f"unexpected {type(msg).__name__} message")

    def _on_departed(self, peer: int) -> None:
        """A peer closed its reducer in an orderly way (its goodbye over gRPC)."""
        self._live.departed(peer)
        self._control.departed(peer)
        if peer == 0 and self._rank != 0:
            # No plan can come any more; what is pending fails once every plan already
            # sent has run (plans through the pipes end with rank 0's goodbye there).
            self._execution.coordinator_left(through_pipe=False)

    def _on_peer_lost(self, peer: int, why: str) -> None:
        err = PeerLostError(f"Rank {self._rank}: {why}")
        self._peer_failed(err)
        self._fail(err)

    def _on_tick(self, stalls: bool) -> None:
        self._control.watch(stalls, self._live.blame)
        if self._lane is not None:
            self._lane.watch()

    # ------------------------------------------------------------------ failure and close
    @property
    def failure(self) -> BaseException | None:
        return self._table.error

    def _fail(self, err: BaseException, *, failure: bool = True) -> None:
        """Fail every pending and later collective with ``err``. A ``failure`` is logged
        and reported to every peer; rank 0's orderly goodbye is not one: it only ends
        what can no longer run here."""
        entries = self._table.fail(err, failure)
        if entries is None:
            return
        if failure:
            log.error("%s", err)
        else:
            log.debug("%s", err)
        mesh = self._paths.mesh
        if mesh is not None:
            if failure:
                mesh.broadcast_abort(str(err))
            mesh.wake_all()
        for p in entries:
            p.handle.set_error(err)
        self._startup.deliver(err)

    def _close(self) -> None:
        # After rank 0's goodbye this rank still says goodbye to the others: it did not fail.
        self._shutdown(graceful=self._table.error is None or not self._table.failed)

    def _close_failed(self, reason: str) -> None:
        # Peers fail at once with this rank's error, not with a goodbye.
        if self._paths.mesh is not None:
            self._paths.mesh.broadcast_failure(reason)
        self._shutdown(graceful=False)

    def _shutdown(self, graceful: bool) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
        for p in self._table.close(ReducerClosedError(f"The 'ring' reducer on rank {self._rank} is closed")):
            p.handle.set_error(ReducerClosedError(f"Collective {p.handle.name!r} was pending when the reducer closed"))
        paths = self._paths
        if graceful and self._rank == 0 and paths.local is not None:
            # Followers that read plans from the pipes learn of the goodbye there too,
            # after every plan already sent.
            bye = encode(Departed(0))
            for peer in range(1, self._size):
                try:
                    paths.local.send(peer, bye, timeout_s=1.0)
                except Exception:  # a follower that reads nothing learns it over gRPC
                    pass
        self._execution.stop()
        self._control.stop()
        if self._lane is not None:
            self._lane.leave()  # peers waiting on this rank's lane word stop now
        if paths.mesh is not None:
            paths.mesh.close(graceful=graceful)
        if paths.data is not None:   # (the mesh closes them once they are in use)
            paths.data.close(graceful=graceful)
        self._execution.join(5.0)
        if paths.local is not None:
            paths.local.close(unlink=paths.owns_fifos)
        if paths.shm is not None:
            paths.shm.close()
        if paths.token is not None and (self._rank == 0 or not graceful):
            # A failed job's entries go with it, whichever rank made them (a killed rank
            # cannot remove its own); rank 0 removes the owners file of a finished one.
            from ._stale import remove_job

            remove_job(paths.token)
