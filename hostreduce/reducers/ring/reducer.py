"""``RingReducer``: the gRPC ring engine behind the common reducer interface.

Threads: the caller submits and announces; rank 0's coordinator (driven by incoming
announcements) issues the plan; one executor thread per rank runs the plan in order
over the ring (gRPC) or the shared-memory path, and completes the handles.

On one host a blocking ``allreduce`` with nothing else in flight may skip rank 0 and
run on the calling thread (``lane.py``).

Faults are named for what they are. A caller that has waited a while tells rank 0 it is
blocked, so that ranks all waiting for collectives that differ fail at once
(``UnmatchedCollectiveError``, see ``negotiation.py``). Every rank sends a heartbeat to
every peer a few times a second; a peer silent for ``timeout_s`` (stopped or hung: its
connection may stay open) fails the job with a ``PeerLostError`` that names it, and any
other wait that times out names a silent peer first, since it is the likely cause.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...config import Config
from ...errors import (ConfigError, PeerLostError, ReducerClosedError, TensorMismatchError,
                       CollectiveTimeoutError, HostReduceError, UnmatchedCollectiveError)
from ..base import Handle, ReduceOp, Reducer, register_reducer
from .datapath import DataPath
from .negotiation import Coordinator, decide_data_path
from .lane import CountedHandle, FastLane, lane_key

__all__ = ["RingReducer"]

log = logging.getLogger("hostreduce.ring")

# Over gRPC, an all-reduce whose buffer times (N - 1) is at most this many bytes travels
# with its announcement to rank 0, which reduces it (in buckets of at most
# _GATHER_BUCKET_BYTES) and returns the result right after the plan: two message
# latencies instead of a negotiation round trip plus the ring's 2(N-1) steps.
_GATHER_MAX_BYTES = 256 * 1024
_GATHER_BUCKET_BYTES = 1 << 20
# A caller waiting this long tells rank 0 it is blocked, and again at this interval.
_BLOCKED_AFTER_S = 0.25
_BLOCKED_EVERY_S = 0.5
# Heartbeats to every peer at this interval; a wait that times out blames a peer silent
# for _SILENT_S (or timeout_s / 2, if less) before anything else.
_BEAT_S = 0.25
_SILENT_S = 1.0
_BEAT = b'{"t": "beat"}'


@dataclass
class _Pending:
    kind: str
    array: np.ndarray
    out: np.ndarray | None
    op: ReduceOp
    root: int
    handle: Handle


class _RingHandle(CountedHandle):
    """A handle whose long waits tell rank 0 that this rank is blocked (``_waits``)."""

    __slots__ = ("_waits",)

    def __init__(self, name: str, waits: Any) -> None:
        super().__init__(name)
        self._waits = waits

    def wait(self, timeout: float | None = None) -> Any:
        if not self._event.is_set() and not self._waits(self, timeout):
            raise CollectiveTimeoutError(f"Collective {self.name!r} did not complete within timeout={timeout} s")
        return super().wait(0)


class _NamingLink:
    """The ring's link, whose receive timeouts name the peer that stopped answering (in
    a ring, every rank times out waiting for its neighbour, not only the frozen one's)."""

    def __init__(self, link: Any, explain: Any) -> None:
        self._link, self._explain = link, explain

    def send(self, tag: int, data: np.ndarray) -> None:
        self._link.send(tag, data)

    def send_to(self, dst: int, tag: int, data: np.ndarray) -> None:
        self._link.send_to(dst, tag, data)

    def recv(self, tag: int) -> memoryview:
        try:
            return self._link.recv(tag)
        except PeerLostError as e:
            raise self._explain(e) from None

    def recv_from(self, src: int, tag: int) -> memoryview:
        try:
            return self._link.recv_from(src, tag)
        except PeerLostError as e:
            raise self._explain(e) from None


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
        super().__init__()
        from ...cluster import resolve_cluster

        self._cluster = resolve_cluster() if cluster is None else cluster
        self._config = Config.from_env() if config is None else config
        self._rank, self._size = self._cluster.rank, self._cluster.size
        if self._config.log_level:
            logging.getLogger("hostreduce").setLevel(self._config.log_level.upper())
        if self._size > 1:
            if not self._cluster.addresses:
                raise ConfigError(
                    "The 'ring' reducer needs every worker's address: start workers with TF_CONFIG "
                    "(or `hostreduce run -np N`). Received: a cluster without addresses "
                    f"(source={self._cluster.source!r}); under mpirun use the 'mpi' or 'horovod' reducer"
                )
            if not self._config.secret:
                raise ConfigError(
                    "The 'ring' reducer needs a shared secret to admit only this job's workers: set "
                    "HOSTREDUCE_SECRET to the same value on every worker (`hostreduce run` does this). "
                    "Received: secret=None"
                )
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._plans: queue.SimpleQueue = queue.SimpleQueue()
        self._setup: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._failed = False  # _error is a failure (not rank 0's orderly goodbye)
        self._barriers = 0
        self._tag = 0
        self._stats: collections.Counter = collections.Counter()
        self._mesh: Any = None
        self._link: Any = None
        # The collective each executing thread is running (the executor, and on a
        # one-host follower the pipe's reader thread), to fail its handles on an error.
        self._running = threading.local()
        self._shm: Any = None
        self._local: Any = None
        self._owns_fifos = False
        self._coordinator: Coordinator | None = None
        self.transport = "local"
        self._inline_plans = False
        self._lane: FastLane | None = None   # one host only
        self._slow_open = 0       # collectives negotiated through rank 0 and not finished
        self._slow_done = 0
        self._token: str | None = None   # names the job's entries in /dev/shm (one host)
        self._heard = [time.monotonic()] * self._size   # when each peer was last heard from
        self._gone: set[int] = set()     # peers that closed in an orderly way
        self._silent_s = min(_SILENT_S, self._config.timeout_s / 2)
        if self._rank == 0:
            self._coordinator = Coordinator(self._size, self._config.fusion_threshold_bytes,
                                            self._publish_plan, self._config.timeout_s,
                                            gather_threshold=_GATHER_BUCKET_BYTES)
        if self._size > 1 and self._config.tune_malloc:
            from ._malloc import tune_malloc

            tune_malloc()
        try:
            if self._size > 1:
                self._start_mesh()
        except BaseException as e:
            # A configuration refusal is an orderly goodbye; anything else is not. A file
            # of the job that went away means a peer failed: say which, not the path.
            err = self._explain_os_error(e) if isinstance(e, OSError) else e
            self._shutdown(graceful=isinstance(err, ConfigError))
            if err is e:
                raise
            raise err from None
        link = None if self._link is None else _NamingLink(self._link, self._explain_timeout)
        self._data = DataPath(self._rank, self._size, self._config.chunk_bytes, link, self._shm)
        if self.transport == "shm" and self._config.fast_lane and FastLane.supported():
            self._lane = FastLane(self._shm, self._rank, self._config.timeout_s)
        self._stop = threading.Event()
        self._announcements: queue.SimpleQueue = queue.SimpleQueue()
        self._announce_thread = threading.Thread(target=self._announcer, name=f"hostreduce-announce-{self._rank}",
                                                 daemon=True)
        self._announce_thread.start()
        self._executor = threading.Thread(target=self._run, name=f"hostreduce-ring-{self._rank}", daemon=True)
        self._executor.start()
        self._watchdog: threading.Thread | None = None
        if self._size > 1:
            self._watchdog = threading.Thread(target=self._watch, name="hostreduce-watchdog", daemon=True)
            self._watchdog.start()
        self._register_live()

    # ------------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    # ------------------------------------------------------------------ start-up
    def _start_mesh(self) -> None:
        from .grpc_mesh import CTL, GrpcMesh, RingLink

        cfg = self._config
        self._mesh = GrpcMesh(self._rank, tuple(self._cluster.addresses), cfg.secret or "",
                              bind_host=cfg.bind_host, timeout_s=cfg.timeout_s,
                              on_ctl=self._on_ctl, on_peer_lost=self._on_peer_lost,
                              on_departed=self._on_departed, on_announce=self._on_announce)
        self._mesh.start(cfg.connect_timeout_s)
        from ._stale import start_time

        hello = {"t": "join", "rank": self._rank, "transport": cfg.transport, "chunk_bytes": cfg.chunk_bytes,
                 "fast_lane": cfg.fast_lane, "single_copy": cfg.single_copy, "host": socket.gethostname(),
                 "pid": os.getpid(), "start": start_time(os.getpid())}
        if self._rank == 0:
            joins = [hello]
            while len(joins) < self._size:
                joins.append(self._setup_get())
            welcome = decide_data_path(joins)
            if welcome.get("transport") == "shm":
                from ._stale import sweep, write_owners

                sweep()  # entries that jobs killed earlier on this host left behind
                joins.sort(key=lambda j: j["rank"])
                self._token = welcome["token"]
                write_owners(self._token, [j.get("pid", 0) for j in joins], [j.get("start", -1) for j in joins])
                # Shared resources exist before any peer learns their names.
                self._open_local_paths(welcome["token"], create=True)
            for peer in range(1, self._size):
                self._mesh.send(peer, CTL, 0, json.dumps(welcome).encode())
        else:
            self._mesh.send(0, CTL, 0, json.dumps(hello).encode())
            welcome = self._setup_get()
        if "error" in welcome:
            raise ConfigError(welcome["error"])
        self.transport = welcome["transport"]
        if self.transport == "shm":
            if self._rank != 0:
                self._token = welcome["token"]
                self._open_local_paths(welcome["token"], create=False)
            assert self._shm is not None and self._local is not None
            self._shm.barrier()  # every rank reads its own pipe before anyone writes
            self._local.connect()
            self._shm.barrier()  # every rank has mapped and opened everything by name
            if self._rank == 0:
                self._shm.release_names()
                self._local.release_names()
        self._inline_plans = self.transport == "shm" and self._rank != 0
        nxt, prev = (self._rank + 1) % self._size, (self._rank - 1) % self._size
        self._link = RingLink(self._mesh, nxt, prev, cfg.timeout_s)
        log.info("rank %d/%d: ring up, data path %s", self._rank, self._size, self.transport)

    def _open_local_paths(self, token: str, create: bool) -> None:
        """Shared memory and named pipes of a one-host job (rank 0 creates them)."""
        from .local_ctl import LocalControl, create_fifos
        from .shm import ShmGroup

        cfg = self._config
        if create:
            create_fifos(token, self._size)
            self._owns_fifos = True
        self._shm = ShmGroup(self._rank, self._size, token, cfg.timeout_s, lambda: self._error,
                             use_cma=cfg.single_copy, not_answering=self._silent_peer_error)
        self._local = LocalControl(self._rank, self._size, token, self._on_local, cfg.timeout_s)

    def _on_local(self, payload: bytes) -> None:
        try:
            msg = json.loads(payload)
            self._on_ctl(int(msg.get("rank", 0)), payload)
        except Exception as e:  # keep the pipe's reader alive; the job cannot go on
            self._fail(PeerLostError(f"Rank {self._rank}: control message failed: {type(e).__name__}: {e}"))

    def _setup_get(self) -> dict:
        try:
            msg = self._setup.get(timeout=self._config.connect_timeout_s)
        except queue.Empty:
            raise PeerLostError(f"Rank {self._rank}: the ring did not finish its start-up handshake within "
                                f"connect_timeout_s={self._config.connect_timeout_s}") from None
        if isinstance(msg, BaseException):
            raise msg
        return msg

    # ------------------------------------------------------------------ messages
    def _on_ctl(self, src: int, payload: bytes) -> None:
        if 0 <= src < self._size:
            self._heard[src] = time.monotonic()
        msg = payload if isinstance(payload, dict) else json.loads(bytes(payload))
        t = msg.get("t")
        if t == "beat":
            return
        if t == "ready" and self._coordinator is not None:
            self._coordinator.on_ready(src, msg["entries"])
        elif t == "blocked" and self._coordinator is not None:
            self._coordinator.on_blocked(src, msg.get("name"))
        elif t == "plan":
            if self._inline_plans:
                # A follower on one host: the pipe's reader thread runs the plan itself,
                # in arrival order, saving a thread hand-off per collective.
                self._run_items(msg["items"])
            else:
                self._plans.put(msg["items"])
        elif t in ("join", "welcome"):
            self._setup.put(msg)
        elif t == "departed" and self._inline_plans:
            # Rank 0's goodbye through the pipe: after every plan it sent.
            self._run_items([{"kind": "departed", "names": [], "rank": 0}])

    def _publish_plan(self, items: list[dict]) -> None:
        if self._size > 1:
            from .grpc_mesh import CTL

            shared = [{k: v for k, v in it.items() if not k.startswith("_")} for it in items]
            payload = json.dumps({"t": "plan", "items": shared}).encode()
            for peer in range(1, self._size):
                if self._local is not None:
                    self._local.send(peer, payload, atomic=False)
                else:
                    self._mesh.send(peer, CTL, 0, payload)
        self._plans.put(items)

    def _announce(self, entry: dict, alone: bool) -> None:
        if alone and not self._config.cycle_time_ms and self._announcements.empty():
            # A lone collective (nothing else in flight on this rank) is announced by the
            # submitting thread itself: one thread hand-off less on its latency.
            try:
                self._send_entries([entry])
            except Exception as e:  # the pending handle carries the error
                self._fail(PeerLostError(f"Rank {self._rank}: announcing a collective failed: "
                                         f"{type(e).__name__}: {e}"))
            return
        self._announcements.put(entry)

    def _announcer(self) -> None:
        # Sends everything submitted since the last send in one message, so that tensors
        # submitted together reach the coordinator together and can be fused (after
        # waiting cycle_time_ms for more, if set).
        cycle = self._config.cycle_time_ms / 1000.0
        while True:
            first = self._announcements.get()
            if first is None:
                return
            if cycle:
                time.sleep(cycle)
            entries = [first]
            while True:
                try:
                    nxt = self._announcements.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._announcements.put(None)
                    break
                entries.append(nxt)
            try:
                # Blocked notices ("t") keep their place among the announcements.
                batch: list[dict] = []
                for entry in entries:
                    if "t" not in entry:
                        batch.append(entry)
                        continue
                    if batch:
                        self._send_entries(batch)
                        batch = []
                    self._send_note(entry)
                if batch:
                    self._send_entries(batch)
            except Exception as e:
                self._fail(PeerLostError(f"Rank {self._rank}: announcing a collective failed: "
                                         f"{type(e).__name__}: {e}"))

    def _send_entries(self, entries: list[dict]) -> None:
        if self._rank == 0:
            assert self._coordinator is not None
            self._coordinator.on_ready(0, entries)
        elif self._local is not None:
            self._local.send_entries(0, self._rank, entries)
        else:
            from .grpc_mesh import ANNOUNCE, CTL, encode_announcement

            if any("_data" in e for e in entries):
                self._mesh.send(0, ANNOUNCE, 0, encode_announcement(entries))
            else:
                self._mesh.send(0, CTL, 0, json.dumps({"t": "ready", "entries": entries}).encode())

    def _send_note(self, note: dict) -> None:
        if self._rank == 0:
            assert self._coordinator is not None
            self._coordinator.on_blocked(0, note["name"])
        elif self._local is not None:
            self._local.send(0, json.dumps(note).encode())
        else:
            from .grpc_mesh import CTL

            self._mesh.send(0, CTL, 0, json.dumps(note).encode())

    def _note_blocked(self, name: str | None) -> None:
        """Tell rank 0 that a caller on this rank has been waiting for ``name`` (None: it
        stopped waiting); through the announcer, so after this rank's announcements."""
        if self._size > 1 and self._error is None:
            self._announcements.put({"t": "blocked", "rank": self._rank, "name": name})

    def _wait_blocked(self, handle: Handle, timeout: float | None) -> bool:
        """``handle.wait``'s wait: whether the handle finished within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if handle.wait_done(_BLOCKED_AFTER_S if timeout is None else min(_BLOCKED_AFTER_S, timeout)):
            return True
        noticed = False
        try:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._note_blocked(handle.name)
                noticed = True
                if handle.wait_done(_BLOCKED_EVERY_S if left is None else min(_BLOCKED_EVERY_S, left)):
                    return True
        finally:
            if noticed:
                self._note_blocked(None)

    def _on_announce(self, src: int, payload: memoryview) -> None:
        """Rank 0: announcements from ``src`` with the data of its small all-reduces."""
        from .grpc_mesh import decode_announcement

        if 0 <= src < self._size:
            self._heard[src] = time.monotonic()
        try:
            if self._coordinator is None:
                raise ValueError("only rank 0 takes announcements")
            self._coordinator.on_ready(src, decode_announcement(payload))
        except Exception as e:
            self._fail(PeerLostError(f"Rank {self._rank}: bad announcement from rank {src}: {type(e).__name__}: {e}"))

    def _on_departed(self, peer: int) -> None:
        """A peer closed its reducer in an orderly way."""
        self._gone.add(peer)
        if self._coordinator is not None:
            self._coordinator.mark_departed(peer)
        elif peer == 0:
            # No plan can come any more; the executor fails what is still pending once it
            # has run every plan that was already sent. Plans that go through the pipes
            # end with rank 0's goodbye there, which does this in order; this one only
            # waits for that, in case the goodbye is lost.
            self._plans.put([{"kind": "departed", "names": [], "rank": 0, "wait": self._inline_plans}])

    def _on_peer_lost(self, peer: int, why: str) -> None:
        err = PeerLostError(f"Rank {self._rank}: {why}")
        self._peer_failed(err)
        self._fail(err)

    def _fail(self, err: BaseException, *, failure: bool = True) -> None:
        """Fail every pending and later collective with ``err``. A ``failure`` is logged
        and reported to every peer; rank 0's orderly goodbye is not one: it only ends
        what can no longer run here."""
        with self._lock:
            if self._error is not None:
                return
            self._error = err
            self._failed = failure
            pending, self._pending = self._pending, {}
        if failure:
            log.error("%s", err)
        else:
            log.debug("%s", err)
        if self._mesh is not None:
            if failure:
                self._mesh.broadcast_abort(str(err))
            self._mesh.wake_all()
        for p in pending.values():
            p.handle.set_error(err)
        self._setup.put(err)

    def _watch(self) -> None:
        # Every 50 ms (on one host, with the lane: negotiated work that made no progress,
        # while a peer may wait on its lane word) or 100 ms: heartbeats, silent peers,
        # ranks all blocked (rank 0); stalls every 0.5 s.
        period = 0.05 if self._lane is not None else 0.1
        finished, tick, beat_at, last = -1, 0, 0.0, time.monotonic()
        while not self._stop.wait(period):
            tick += 1
            now = time.monotonic()
            late, last = now - last - period, now
            try:
                if late > 0.5:
                    # This process did not run (stopped, or starved): peers could not be
                    # heard meanwhile, so that silence is not theirs.
                    self._heard = [max(h, min(h + late, now)) for h in self._heard]
                if now >= beat_at:
                    beat_at = now + _BEAT_S
                    self._beat()
                lost = self._silent_peer_error(self._config.timeout_s)
                if lost is not None:
                    self._fail(lost)
                finished = self._watch_once(finished, tick % round(0.5 / period) == 0)
            except Exception as e:  # keep watching: peers may depend on this thread
                log.warning("rank %d: watchdog: %s: %s", self._rank, type(e).__name__, e)

    def _beat(self) -> None:
        from .grpc_mesh import CTL

        for peer in range(self._size):
            if peer != self._rank and peer not in self._gone:
                self._mesh.send(peer, CTL, 0, _BEAT)

    def _silent_peer(self, after: float, ranks: list[int] | None = None) -> tuple[int, float] | None:
        """The peer (of ``ranks``, default all) silent the longest, if over ``after`` s."""
        now = time.monotonic()
        frames = getattr(self._mesh, "_last_frame", None) or {}
        worst: tuple[int, float] | None = None
        for peer in range(self._size) if ranks is None else ranks:
            if peer == self._rank or peer in self._gone:
                continue
            silent = now - max(self._heard[peer], frames.get(peer, 0.0))
            if silent > after and (worst is None or silent > worst[1]):
                worst = (peer, silent)
        return worst

    @staticmethod
    def _silence_text(peer: int, silent: float) -> str:
        return f"rank {peer} has not answered for {silent:.1f} s (stopped or hung)"

    def _silent_peer_error(self, after: float | None = None) -> PeerLostError | None:
        if self._error is not None:
            return None
        found = self._silent_peer(self._silent_s if after is None else after)
        return None if found is None else PeerLostError(f"Rank {self._rank}: {self._silence_text(*found)}")

    def _explain_timeout(self, err: PeerLostError) -> BaseException:
        """A wait for a peer ended: the job's error if it has one, else a silent peer's."""
        if self._error is not None:
            return self._error
        return self._silent_peer_error() or err

    def _reported_failure(self, within: float) -> BaseException | None:
        """The job's error, waiting up to ``within`` s for it: a failed peer's report
        travels over gRPC and may trail what this rank saw first. None if none came,
        or if it is only this reducer's own close."""
        deadline = time.monotonic() + within
        while self._error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        error = self._error
        if isinstance(error, HostReduceError) and not isinstance(error, ReducerClosedError):
            return error
        return None

    def _explain_departure(self, err: PeerLostError) -> BaseException:
        """A peer left the lane: if it left because it failed, its report (naming its
        error) is on its way; prefer it to "closed its reducer"."""
        return self._reported_failure(0.5) or err

    def _explain_os_error(self, err: OSError) -> BaseException:
        """A file of the job went away (a peer that failed removed it, or died): wait a
        moment for the connection that names the lost peer, else say what is known."""
        return self._reported_failure(2.0) or self._silent_peer_error() or PeerLostError(
            f"Rank {self._rank}: the job's shared memory went away ({type(err).__name__}: {err}); a peer has "
            "probably exited")

    def _watch_once(self, finished: int, stalls: bool) -> int:
        if self._coordinator is not None:
            self._coordinator.check_blocked()
        if self._coordinator is not None and stalls:
            found = self._silent_peer
            self._coordinator.check_stalls(
                lambda missing: None if (f := found(self._silent_s, missing)) is None else self._silence_text(*f))
        if self._lane is not None:
            with self._lock:
                stuck = self._slow_open and self._slow_done == finished
                finished = self._slow_done
                if stuck and self._error is None:
                    # A peer that wants the lane may wait for this rank's word of the
                    # next round while this rank waits on rank 0.
                    self._lane.note_slow()
        return finished

    # ------------------------------------------------------------------ submission
    def _submit(self, name: str, kind: str, arr: np.ndarray, out: np.ndarray | None,
                op: ReduceOp, root: int) -> Handle:
        self._check_open()
        handle = _RingHandle(name, self._wait_blocked)
        entry = self._entry(name, kind, arr, op, root)
        with self._lock:
            self._admit(name)
            self._pending[name] = _Pending(kind, arr, out, op, root, handle)
            self._slow_open += 1
            handle._owner = self
            if self._lane is not None:
                if self._lane.busy:  # announced when the lane is released
                    self._lane.held.append(entry)
                    return handle
                self._lane.note_slow()
            alone = len(self._pending) == 1
        if (kind == "allreduce" and self.transport == "grpc"
                and arr.nbytes * (self._size - 1) <= _GATHER_MAX_BYTES):
            entry["_data"] = arr  # sent along with the announcement
        self._announce(entry, alone)
        return handle

    @staticmethod
    def _entry(name: str, kind: str, arr: np.ndarray, op: ReduceOp, root: int) -> dict:
        return {"name": name, "kind": kind, "dtype": str(arr.dtype), "shape": list(arr.shape),
                "op": op.value, "root": root, "nbytes": int(arr.nbytes)}

    def _admit(self, name: str) -> None:
        """Under the lock: refuse a submission on a failed reducer or a name in flight."""
        if self._error is not None:
            raise self._error
        if name in self._pending:
            raise ConfigError(f"A collective named {name!r} is already in flight on rank {self._rank}; "
                              "wait for it before submitting the name again")

    def _slow_finished(self) -> None:
        with self._lock:
            self._slow_open -= 1
            self._slow_done += 1

    # ------------------------------------------------------------------ fast lane
    def _allreduce(self, name: str, arr: np.ndarray, rop: ReduceOp, out: np.ndarray | None) -> np.ndarray:
        lane = self._lane
        if lane is None:
            return super()._allreduce(name, arr, rop, out)
        handle = _RingHandle(name, self._wait_blocked)
        with self._lock:
            self._admit(name)
            fast = not self._pending and not self._slow_open and lane.open()
            if fast:
                self._pending[name] = _Pending("allreduce", arr, out, rop, 0, handle)
                lane.busy = True
        if not fast:
            return self._await_negotiated(self._allreduce_async(name, arr, rop, out))
        try:
            key = lane_key(name, arr, rop)
            self._lane_run(lane, name, arr, rop, key, lane.enter(key), handle)
        except BaseException as e:
            # Interrupted (Ctrl-C) inside an agreed round: this rank can no longer keep
            # step with its peers, so the job fails on every rank now, not at the timeout.
            self._fail(PeerLostError(f"Rank {self._rank}: collective {name!r} was interrupted on the fast "
                                     f"lane ({type(e).__name__})"))
            raise
        finally:
            with self._lock:
                held = lane.release(announce=self._error is None)
            for entry in held:
                self._announce(entry, False)
        return self._await_negotiated(handle)

    def _await_negotiated(self, handle: Handle) -> Any:
        """Wait for a collective that may go through rank 0. Meanwhile a peer may wait on
        the lane for this rank's word of the next round: post "slow" for it at once."""
        lane = self._lane
        assert lane is not None
        start = time.monotonic()
        noticed = 0.0
        try:
            while not handle.done():
                with self._lock:
                    if self._error is None:
                        lane.note_slow()
                handle.wait_done(0.002)
                now = time.monotonic()
                if now - start >= _BLOCKED_AFTER_S and now - noticed >= _BLOCKED_EVERY_S:
                    self._note_blocked(handle.name)
                    noticed = now
        finally:
            if noticed:
                self._note_blocked(None)
        return handle.wait()

    def _lane_run(self, lane: FastLane, name: str, arr: np.ndarray, op: ReduceOp, key: int, seq: int,
                  handle: CountedHandle) -> None:
        try:
            agreed = lane.agree(seq, key, name)
        except BaseException as e:
            with self._lock:
                self._pending.pop(name, None)
            handle.set_error(self._explain_departure(e) if isinstance(e, PeerLostError) else e)
            return
        if agreed:
            self._stats["fast_lane"] += 1
            self._run_items([{"kind": "allreduce", "names": [name]}])
            return
        # Not every rank is on the lane this round: negotiate through rank 0.
        with self._lock:
            if name not in self._pending:  # failed meanwhile
                return
            self._slow_open += 1
            handle._owner = self
        self._announce(self._entry(name, "allreduce", arr, op, 0), True)

    def _allreduce_async(self, name: str, arr: np.ndarray, op: ReduceOp, out: np.ndarray | None) -> Handle:
        return self._submit(name, "allreduce", arr, out, op, 0)

    def _broadcast_async(self, name: str, arr: np.ndarray, root: int) -> Handle:
        return self._submit(name, "broadcast", arr, None, ReduceOp.SUM, root)

    def _allgather_async(self, name: str, arr: np.ndarray) -> Handle:
        return self._submit(name, "allgather", arr, None, ReduceOp.SUM, 0)

    def _barrier(self, timeout: float | None) -> None:
        self._barriers += 1
        handle = self._submit(f"__barrier__/{self._barriers}", "barrier", np.zeros(0, np.float32), None,
                              ReduceOp.SUM, 0)
        handle.wait(timeout if timeout is not None else self._config.timeout_s * 2)

    # ------------------------------------------------------------------ execution
    def _run(self) -> None:
        while True:
            items = self._plans.get()
            if items is None:
                return
            self._run_items(items)

    def _run_items(self, items: list[dict]) -> None:
        for item in items:
            try:
                self._execute(item)
            except Exception as e:  # an engine bug must not leave ranks hanging
                if isinstance(e, HostReduceError):
                    err: BaseException = e
                elif isinstance(e, OSError):
                    err = self._explain_os_error(e)
                else:
                    err = PeerLostError(f"Rank {self._rank}: collective failed: {type(e).__name__}: {e}")
                self._fail(err)
                for p in getattr(self._running, "entries", ()):
                    p.handle.set_error(err)
            finally:
                self._running.entries = []

    def _take(self, names: list[str]) -> list[_Pending]:
        with self._lock:
            entries = [self._pending.pop(n) for n in names if n in self._pending]
        self._running.entries = entries
        return entries

    def _execute(self, item: dict) -> None:
        kind = item["kind"]
        if kind == "departed":
            if item.get("wait"):
                deadline = time.monotonic() + self._config.timeout_s
                while self._error is None and time.monotonic() < deadline:
                    time.sleep(0.05)
            time.sleep(0.2)  # plans sent just before the goodbye may still be on their way
            while True:
                try:
                    more = self._plans.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._plans.put(None)
                    break
                for it in more:
                    if it.get("kind") != "departed":
                        self._execute(it)
            self._fail(PeerLostError(f"Rank {self._rank}: rank 0 (the coordinator) closed its reducer; "
                                     "no further collectives can run"), failure=False)
            return
        if kind == "error":
            if item["etype"] == "lost":  # a rank stopped answering: the job cannot go on
                self._fail(PeerLostError(f"Rank {self._rank}: {item['error']}"))
                return
            if self._rank not in item.get("ranks", [self._rank]):
                return
            cls = {"mismatch": TensorMismatchError, "departed": PeerLostError,
                   "unmatched": UnmatchedCollectiveError}.get(item["etype"], CollectiveTimeoutError)
            for p in self._take(item["names"]):
                p.handle.set_error(cls(item["error"]))
            return
        entries = self._take(item["names"])
        if len(entries) != len(item["names"]):
            if self._error is not None:
                return
            raise PeerLostError(f"Rank {self._rank}: plan names collectives {item['names']} not pending here")
        if kind == "barrier":
            entries[0].handle.set_result(None)
            return
        self._tag += 1
        if kind == "allreduce":
            self._run_allreduce(entries, item)
        elif kind == "broadcast":
            self._run_broadcast(entries[0])
        elif kind == "allgather":
            self._run_allgather(entries[0], item["counts"])

    def stats(self) -> dict[str, int]:
        """Counts since start: all-reduced tensors and the fused buckets that carried them."""
        return dict(self._stats)

    def _run_allreduce(self, entries: list[_Pending], item: dict) -> None:
        self._stats["allreduce_tensors"] += len(entries)
        self._stats["allreduce_buckets"] += 1
        dtype = entries[0].array.dtype
        outs = [p.out if p.out is not None else np.empty(p.array.shape, dtype) for p in entries]
        gathered = bool(item.get("gather"))
        parts = [item["_parts"][n] for n in item["names"]] if gathered and self._rank == 0 else None
        self._data.allreduce([p.array for p in entries], outs, entries[0].op, self._tag, gathered, parts)
        for p, o in zip(entries, outs):
            p.handle.set_result(o)

    def _run_broadcast(self, p: _Pending) -> None:
        p.handle.set_result(self._data.broadcast(p.array, p.root, self._tag))

    def _run_allgather(self, p: _Pending, counts: list[int]) -> None:
        p.handle.set_result(self._data.allgather(p.array, counts, self._tag))

    # ------------------------------------------------------------------ shutdown
    def _close(self) -> None:
        # After rank 0's goodbye this rank still says goodbye to the others: it did not fail.
        self._shutdown(graceful=self._error is None or not self._failed)

    def _close_failed(self, reason: str) -> None:
        # Peers fail at once with this rank's error, not with a goodbye.
        if self._mesh is not None:
            self._mesh.broadcast_failure(reason)
        self._shutdown(graceful=False)

    def _shutdown(self, graceful: bool) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        with self._lock:
            pending, self._pending = self._pending, {}
            if self._error is None:
                self._error = ReducerClosedError(f"The 'ring' reducer on rank {self._rank} is closed")
        for p in pending.values():
            p.handle.set_error(ReducerClosedError(f"Collective {p.handle.name!r} was pending when the reducer closed"))
        if graceful and self._rank == 0 and self._local is not None:
            # Followers that read plans from the pipes learn of the goodbye there too,
            # after every plan already sent.
            bye = json.dumps({"t": "departed", "rank": 0}).encode()
            for peer in range(1, self._size):
                try:
                    self._local.send(peer, bye, timeout_s=1.0)
                except Exception:  # a follower that reads nothing learns it over gRPC
                    pass
        self._plans.put(None)
        announcements = getattr(self, "_announcements", None)
        if announcements is not None:
            announcements.put(None)
        executor = getattr(self, "_executor", None)
        if self._lane is not None:
            # A thread on the lane stops within a wait slice (the reducer has an error now).
            deadline = time.monotonic() + 2.0
            while self._lane.busy and time.monotonic() < deadline:
                time.sleep(0.01)
        if self._shm is not None:
            self._shm.lane_leave()  # peers waiting on this rank's lane word stop now
        if self._mesh is not None:
            self._mesh.close(graceful=graceful)
        if executor is not None and executor is not threading.current_thread():
            executor.join(timeout=5.0)
        if self._local is not None:
            self._local.close(unlink=self._owns_fifos)
        if self._shm is not None:
            self._shm.close()
        if self._token is not None and (self._rank == 0 or not graceful):
            # A failed job's entries go with it, whichever rank made them (a killed rank
            # cannot remove its own); rank 0 removes the owners file of a finished one.
            from ._stale import remove_job

            remove_job(self._token)
