"""The control plane: announcing this rank's collectives to rank 0, and on rank 0 the
coordinator that turns every rank's announcements into plans and publishes them.

Every rank announces each collective it submits (``Ready``) and runs what rank 0's plans
say, in their order (``execution.py``); the coordinator's rules are in
``negotiation.py``. Announcements go through one thread, which sends everything
submitted since its last send in one message, so that tensors submitted together reach
the coordinator together and can be fused (after waiting ``cycle_time_ms`` for more, if
set). A lone collective (nothing else in flight on this rank) is announced by the
submitting thread itself: one thread hand-off less on its latency.

Over gRPC, an all-reduce whose buffer times (N - 1) is at most 256 KiB travels with its
announcement; rank 0 reduces such tensors itself and returns the result right after the
plan: two message latencies instead of a negotiation round trip plus the ring's 2(N-1)
steps.

A caller that has waited a while tells rank 0 it is blocked (``Blocked``, through the
announcer, so after this rank's announcements), so that ranks all waiting for
collectives that differ fail at once instead of at the timeout.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Callable, Union

import numpy as np

from ...config import Config
from ...errors import PeerLostError
from ..base import ReduceOp
from ..compression import to_wire
from .local_ctl import MAX_MESSAGE
from .messages import Blocked, Entry, Plan, PlanItem, Ready, Step, encode, encode_split, steps
from .negotiation import Coordinator
from .pending import PendingHandle, PendingTable

if TYPE_CHECKING:
    from .startup import Paths

__all__ = ["Control", "BLOCKED_AFTER_S", "BLOCKED_EVERY_S"]

log = logging.getLogger("hostreduce.ring")

# All-reduces sent along with their announcement, and the buckets rank 0 reduces them in.
_GATHER_MAX_BYTES = 256 * 1024
_GATHER_BUCKET_BYTES = 1 << 20
# A caller waiting this long tells rank 0 it is blocked, and again at this interval.
BLOCKED_AFTER_S = 0.25
BLOCKED_EVERY_S = 0.5

_Queued = Union[Entry, Blocked, None]


class Control:
    """Announcements of this rank and, on rank 0, the coordinator. ``run_plan`` gets
    rank 0's own plans; ``fail`` fails the job."""

    def __init__(self, rank: int, size: int, config: Config, paths: "Paths", table: PendingTable, *,
                 run_plan: Callable[[list[Step]], None], fail: Callable[[BaseException], None]) -> None:
        self._rank, self._size, self._config = rank, size, config
        self._paths, self._table = paths, table
        self._run_plan, self._fail = run_plan, fail
        self._coordinator: Coordinator | None = None
        if rank == 0:
            self._coordinator = Coordinator(size, config.fusion_threshold_bytes, self._publish, config.timeout_s,
                                            gather_threshold=_GATHER_BUCKET_BYTES)
        self._queue: "queue.SimpleQueue[_Queued]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._announcer, name=f"hostreduce-announce-{rank}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)

    # ------------------------------------------------------------------ announcing
    def entry(self, name: str, kind: str, arr: np.ndarray, op: ReduceOp, root: int,
              group: tuple[int, ...] | None = None, counts: list[int] | None = None,
              wire: np.dtype | None = None) -> Entry:
        """The announcement of a collective (``group``: its world ranks, None for the
        world; ``wire``: the 16-bit dtype a compressed all-reduce travels as, which it
        announces); a small all-reduce of the world over gRPC carries its data."""
        dtype = arr.dtype if wire is None else wire
        entry: Entry = {"name": name, "kind": kind, "dtype": str(dtype), "shape": list(arr.shape),
                        "op": op.value, "root": root, "nbytes": int(arr.size * dtype.itemsize)}
        if group is not None:
            entry["group"] = list(group)
        if counts is not None:
            entry["counts"] = list(counts)
        if (kind == "allreduce" and group is None and self._paths.transport in ("grpc", "tcp")
                and entry["nbytes"] * (self._size - 1) <= _GATHER_MAX_BYTES):
            entry["_data"] = arr if wire is None else to_wire(arr, wire)
        return entry

    def announce(self, entry: Entry, alone: bool) -> None:
        if alone and not self._config.cycle_time_ms and self._queue.empty():
            try:
                self._send_entries([entry])
            except Exception as e:  # the pending handle carries the error
                self._fail(PeerLostError(f"Rank {self._rank}: announcing a collective failed: "
                                         f"{type(e).__name__}: {e}"))
            return
        self._queue.put(entry)

    def _announcer(self) -> None:
        cycle = self._config.cycle_time_ms / 1000.0
        while True:
            first = self._queue.get()
            if first is None:
                return
            if cycle:
                time.sleep(cycle)
            queued = [first]
            while True:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                queued.append(nxt)
            try:
                # Blocked notices keep their place among the announcements.
                batch: list[Entry] = []
                for item in queued:
                    if not isinstance(item, Blocked):
                        batch.append(item)
                        continue
                    if batch:
                        self._send_entries(batch)
                        batch = []
                    self._send_note(item)
                if batch:
                    self._send_entries(batch)
            except Exception as e:
                self._fail(PeerLostError(f"Rank {self._rank}: announcing a collective failed: "
                                         f"{type(e).__name__}: {e}"))

    def _send_entries(self, entries: list[Entry]) -> None:
        if self._coordinator is not None:
            self._coordinator.on_ready(0, entries)
        elif self._paths.local is not None:
            # The pipe to rank 0 has several writers: only short writes are atomic.
            for payload in encode_split(Ready(self._rank, entries), MAX_MESSAGE):
                self._paths.send(0, payload)
        else:
            self._paths.send(0, encode(Ready(self._rank, entries)))

    def _send_note(self, note: Blocked) -> None:
        if self._coordinator is not None:
            self._coordinator.on_blocked(0, note.name)
        else:
            self._paths.send(0, encode(note))

    # ------------------------------------------------------------------ blocked callers
    def note_blocked(self, name: str | None) -> None:
        """Tell rank 0 that a caller on this rank has been waiting for ``name`` (None: it
        stopped waiting); through the announcer, so after this rank's announcements."""
        if self._size > 1 and self._table.error is None:
            self._queue.put(Blocked(self._rank, name))

    def wait_blocked(self, handle: PendingHandle, timeout: float | None) -> bool:
        """``handle.wait``'s wait: whether the handle finished within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if handle.wait_done(BLOCKED_AFTER_S if timeout is None else min(BLOCKED_AFTER_S, timeout)):
            return True
        noticed = False
        try:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.note_blocked(handle.name)
                noticed = True
                if handle.wait_done(BLOCKED_EVERY_S if left is None else min(BLOCKED_EVERY_S, left)):
                    return True
        finally:
            if noticed:
                self.note_blocked(None)

    # ------------------------------------------------------------------ rank 0
    def on_ready(self, src: int, msg: Ready) -> None:
        """Announcements from ``src`` (only rank 0 takes them)."""
        if self._coordinator is not None:
            self._coordinator.on_ready(src, msg.entries)

    def on_blocked(self, src: int, msg: Blocked) -> None:
        if self._coordinator is not None:
            self._coordinator.on_blocked(src, msg.name)

    def departed(self, peer: int) -> None:
        """``peer`` closed its reducer in an orderly way: fail what waits for it."""
        if self._coordinator is not None:
            self._coordinator.mark_departed(peer)

    def watch(self, stalls: bool, blame: Callable[[list[int]], str | None]) -> None:
        """The watchdog's look (rank 0): ranks all blocked, and, with ``stalls``,
        collectives some ranks never submitted (``blame`` names a silent one)."""
        if self._coordinator is not None:
            self._coordinator.check_blocked()
            if stalls:
                self._coordinator.check_stalls(blame)

    def _publish(self, items: list[PlanItem]) -> None:
        plan = steps(items)
        if self._size > 1:
            payload = encode(Plan(0, plan))
            for peer in range(1, self._size):
                self._paths.send(peer, payload, atomic=False)
        self._run_plan(plan)
