"""Which peers are alive, and whom to blame when a wait runs out.

Every rank sends a heartbeat to every peer a few times a second, and anything heard from
a peer (a frame, a message) counts. A peer silent for ``timeout_s`` (stopped or hung:
its connection may stay open) fails the job with a ``PeerLostError`` that names it,
and any other wait that times out names a silent peer first, since it is the likely
cause: in a ring every rank times out waiting for its neighbour, not only the frozen
one's. A rank that did not run for a while itself (stopped, or starved of CPU) could not
hear its peers meanwhile, so that silence is not held against them.

The watchdog thread does the heartbeats and the checks, and gives the control plane and
the fast lane their periodic look (``on_tick``).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import numpy as np

from ...errors import HostReduceError, PeerLostError, ReducerClosedError
from .grpc_inbound import CTL
from .messages import Beat, encode
from .pending import PendingTable

__all__ = ["Liveness", "NamingLink", "Watchdog"]

log = logging.getLogger("hostreduce.ring")

# Heartbeats to every peer at this interval; a wait that times out blames a peer silent
# for _SILENT_S (or timeout_s / 2, if less) before anything else.
_BEAT_S = 0.25
_SILENT_S = 1.0


class Liveness:
    def __init__(self, rank: int, size: int, timeout_s: float, table: PendingTable) -> None:
        self.rank, self._size, self._table = rank, size, table
        self.timeout_s = timeout_s
        self._heard = [time.monotonic()] * size   # when each peer was last heard from
        self._gone: set[int] = set()               # peers that closed in an orderly way
        self.silent_s = min(_SILENT_S, timeout_s / 2)
        self._mesh: Any = None
        self._beat = encode(Beat(rank))

    def attach(self, mesh: Any) -> None:
        """The mesh, whose frames count as hearing from a peer and which carries beats."""
        self._mesh = mesh

    def heard(self, src: int) -> None:
        if 0 <= src < self._size:
            self._heard[src] = time.monotonic()

    def departed(self, peer: int) -> None:
        self._gone.add(peer)

    def forgive(self, late: float, now: float) -> None:
        """This process did not run for ``late`` s: peers could not be heard meanwhile."""
        self._heard = [max(h, min(h + late, now)) for h in self._heard]

    def beat(self) -> None:
        for peer in range(self._size):
            if peer != self.rank and peer not in self._gone:
                self._mesh.send(peer, CTL, 0, self._beat)

    def silent_peer(self, after: float, ranks: list[int] | None = None) -> tuple[int, float] | None:
        """The peer (of ``ranks``, default all) silent the longest, if over ``after`` s."""
        now = time.monotonic()
        frames = self._mesh.last_frames() if self._mesh is not None else {}
        worst: tuple[int, float] | None = None
        for peer in range(self._size) if ranks is None else ranks:
            if peer == self.rank or peer in self._gone:
                continue
            silent = now - max(self._heard[peer], frames.get(peer, 0.0))
            if silent > after and (worst is None or silent > worst[1]):
                worst = (peer, silent)
        return worst

    @staticmethod
    def silence_text(peer: int, silent: float) -> str:
        return f"rank {peer} has not answered for {silent:.1f} s (stopped or hung)"

    def blame(self, ranks: list[int]) -> str | None:
        """Which of ``ranks`` has stopped answering, if one has (for the coordinator)."""
        found = self.silent_peer(self.silent_s, ranks)
        return None if found is None else self.silence_text(*found)

    def silent_peer_error(self, after: float | None = None) -> PeerLostError | None:
        if self._table.error is not None:
            return None
        found = self.silent_peer(self.silent_s if after is None else after)
        return None if found is None else PeerLostError(f"Rank {self.rank}: {self.silence_text(*found)}")

    def explain_timeout(self, err: PeerLostError) -> BaseException:
        """A wait for a peer ended: the job's error if it has one, else a silent peer's."""
        if self._table.error is not None:
            return self._table.error
        return self.silent_peer_error() or err

    def _reported_failure(self, within: float) -> BaseException | None:
        """The job's error, waiting up to ``within`` s for it: a failed peer's report
        travels over gRPC and may trail what this rank saw first. None if none came,
        or if it is only this reducer's own close."""
        deadline = time.monotonic() + within
        while self._table.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        error = self._table.error
        if isinstance(error, HostReduceError) and not isinstance(error, ReducerClosedError):
            return error
        return None

    def explain_departure(self, err: PeerLostError) -> BaseException:
        """A peer left the lane: if it left because it failed, its report (naming its
        error) is on its way; prefer it to "closed its reducer"."""
        return self._reported_failure(0.5) or err

    def explain_os_error(self, err: OSError) -> BaseException:
        """A file of the job went away (a peer that failed removed it, or died): wait a
        moment for the connection that names the lost peer, else say what is known."""
        return self._reported_failure(2.0) or self.silent_peer_error() or PeerLostError(
            f"Rank {self.rank}: the job's shared memory went away ({type(err).__name__}: {err}); a peer has "
            "probably exited")


class NamingLink:
    """The ring's link, whose receive timeouts name the peer that stopped answering."""

    def __init__(self, link: Any, explain: Callable[[PeerLostError], BaseException]) -> None:
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


class Watchdog:
    """Every ``period`` s: heartbeats, silent peers (which fail the job), then
    ``on_tick(stalls)``, with ``stalls`` true every 0.5 s."""

    def __init__(self, live: Liveness, period: float, fail: Callable[[BaseException], None],
                 on_tick: Callable[[bool], None]) -> None:
        self._live, self._period, self._fail, self._on_tick = live, period, fail, on_tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hostreduce-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        live, period = self._live, self._period
        tick, beat_at, last = 0, 0.0, time.monotonic()
        while not self._stop.wait(period):
            tick += 1
            now = time.monotonic()
            late, last = now - last - period, now
            try:
                if late > 0.5:
                    # This process did not run (stopped, or starved): peers could not be
                    # heard meanwhile, so that silence is not theirs.
                    live.forgive(late, now)
                if now >= beat_at:
                    beat_at = now + _BEAT_S
                    live.beat()
                lost = live.silent_peer_error(live.timeout_s)
                if lost is not None:
                    self._fail(lost)
                self._on_tick(tick % round(0.5 / period) == 0)
            except Exception as e:  # keep watching: peers may depend on this thread
                log.warning("rank %d: watchdog: %s: %s", live.rank, type(e).__name__, e)
