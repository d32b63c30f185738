"""The one-host fast lane: a blocking all-reduce that skips the negotiation through rank 0.

Horovod caches the responses to collectives it has negotiated before; on one host the
ranks can do better and agree through shared memory. Each rank posts, for the next lane
round, a key of the collective it is about to run (a hash of name, dtype, shape and op)
in its word of the shared control segment. When every rank posted the same key, the
calling threads run the data path at once; any other outcome (a different key, a rank
that negotiates through rank 0 this round, a rank that gave up or closed) sends the
collective through rank 0 as usual, which also reports mismatches.

Rounds stay in step because a rank posts for round k + 1 only after every rank posted
for round k, and every collective that goes through rank 0 is preceded by a "slow" word
for the next round when this rank may post one (``note_slow``). A rank waiting on rank 0
also posts a "slow" word while it waits, and when its negotiated work stalls (the
watchdog calls ``watch``), so a peer that wants the lane never waits on it for long.
A rank enters the lane only when nothing of its own is in flight; submissions made
while a caller holds the lane are announced when it is released.

The words are published with plain stores (a key, then its round number), which readers
see in that order only under x86-64's memory ordering: elsewhere the lane is off.
"""
from __future__ import annotations

import hashlib
import platform
import time
from typing import Callable, Protocol

import numpy as np

from ...errors import CollectiveTimeoutError, PeerLostError
from ..base import ReduceOp
from .control import BLOCKED_AFTER_S, BLOCKED_EVERY_S
from .messages import AllReduce, Entry, Step
from .pending import Pending, PendingHandle, PendingTable
from .shm_sync import ControlBlock, Waiter

__all__ = ["FastLane", "lane_key"]

# Lane words: keys are 63-bit hashes, so these never collide with one.
LANE_SLOW = -1    # this rank negotiates this round through rank 0
LANE_GONE = -2    # this rank closed its reducer
LANE_LEFT = 1 << 62   # the round a closed rank reports: past every real one


def lane_key(name: str, arr: np.ndarray, op: ReduceOp) -> int:
    """A collective's key: equal on every rank iff name, dtype, shape and op are (63 bits,
    so it never equals the reserved negative words)."""
    text = f"{name}\x00{arr.dtype.str}\x00{arr.shape}\x00{op.value}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


class _Control(Protocol):
    """What the lane needs of the control plane."""

    def entry(self, name: str, kind: str, arr: np.ndarray, op: ReduceOp, root: int) -> Entry: ...

    def announce(self, entry: Entry, alone: bool) -> None: ...

    def note_blocked(self, name: str | None) -> None: ...

    def wait_blocked(self, handle: PendingHandle, timeout: float | None) -> bool: ...


class _Execution(Protocol):
    def run(self, plan: list[Step]) -> None: ...


class _Words:
    """This rank's lane words in the control segment, and its view of its peers'.
    Rounds alternate between two key slots, so a rank one round ahead never overwrites a
    key that a peer has yet to read. Nothing is posted after ``leave``."""

    def __init__(self, block: ControlBlock) -> None:
        self._block = block
        self._left = False

    def post(self, seq: int, key: int) -> None:
        """Post this rank's word for round ``seq``: a collective's key, or LANE_SLOW."""
        if self._left:
            return
        self._block.ensure()[f"lane_k{seq % 2}"][self._block.rank] = key
        self._block.post("lane", seq)

    def withdraw(self, seq: int) -> None:
        """Turn this rank's word for round ``seq`` into LANE_SLOW (after giving up on it)."""
        if not self._left:
            self._block.words[f"lane_k{seq % 2}"][self._block.rank] = LANE_SLOW

    def decided(self, seq: int) -> bool:
        """Whether every rank has posted its word for round ``seq``."""
        return not self._left and int(self._block.ensure()["lane"].min()) >= seq

    def slow_posted(self, seq: int) -> bool:
        """Whether some open rank has already posted a "slow" word for round ``seq`` (a
        closed rank's words say "gone", which ``keys`` reports)."""
        w = self._block.ensure()
        lane, keys = w["lane"], w[f"lane_k{seq % 2}"]
        return any(seq <= int(lane[j]) < LANE_LEFT and int(keys[j]) == LANE_SLOW
                   for j in range(self._block.size) if j != self._block.rank)

    def latest(self) -> int:
        """The latest round any open rank has posted for."""
        return max(int(v) for v in self._block.ensure()["lane"] if int(v) < LANE_LEFT)

    def keys(self, seq: int, what: str, on_timeout: Callable[[list[int]], BaseException]) -> list[int]:
        """Wait until every rank has posted its word for round ``seq``; return the keys."""
        lane = self._block.ensure()["lane"]
        size = self._block.size

        def late() -> list[int]:
            return [j for j in range(size) if int(lane[j]) < seq]

        waiter = Waiter(self._block, what, on_timeout)
        while int(lane.min()) < seq:
            waiter.idle(late)
        return [int(k) for k in self._block.words[f"lane_k{seq % 2}"]]

    def leave(self) -> None:
        """At close: every later round sees this rank as gone, so no peer waits for it."""
        if not self._block.mapped or self._left:
            return
        self._left = True
        w, rank = self._block.words, self._block.rank
        w["lane_k0"][rank] = LANE_GONE
        w["lane_k1"][rank] = LANE_GONE
        self._block.post("lane", LANE_LEFT)


class FastLane:
    """The lane of one rank. Every method but ``allreduce`` runs under the table's lock
    (the caller holds it), so that rounds and admissions are ordered."""

    def __init__(self, block: ControlBlock, table: PendingTable, control: _Control, execution: _Execution, *,
                 timeout_s: float, submit: Callable[[str, np.ndarray, ReduceOp, np.ndarray | None], PendingHandle],
                 fail: Callable[[BaseException], None],
                 explain_departure: Callable[[PeerLostError], BaseException]) -> None:
        self._words = _Words(block)
        self._rank, self._timeout = block.rank, timeout_s
        self._table, self._control, self._execution = table, control, execution
        self._submit, self._fail, self._explain_departure = submit, fail, explain_departure
        self._seq = 0          # the last round this rank posted for
        self._slow = True      # whether that word is "slow" (round 0: every word is)
        self.busy = False      # a caller thread holds the lane: other submissions wait
        self._held: list[Entry] = []
        self._finished = -1    # negotiated collectives finished at the watchdog's last look

    @staticmethod
    def supported() -> bool:
        return platform.machine().lower() in ("x86_64", "amd64")

    # ------------------------------------------------------------------ the blocking all-reduce
    def allreduce(self, name: str, arr: np.ndarray, op: ReduceOp, out: np.ndarray | None) -> np.ndarray:
        table = self._table
        handle = PendingHandle(name, self._control.wait_blocked)
        with table.lock:
            table.check(name)
            fast = table.idle() and self._open()
            if fast:
                table.admit(name, Pending("allreduce", arr, out, op, 0, handle), negotiated=False)
                self.busy = True
        if not fast:
            return self.await_negotiated(self._submit(name, arr, op, out))
        try:
            key = lane_key(name, arr, op)
            self._run(name, arr, op, key, self._enter(key), handle)
        except BaseException as e:
            # Interrupted (Ctrl-C) inside an agreed round: this rank can no longer keep
            # step with its peers, so the job fails on every rank now, not at the timeout.
            self._fail(PeerLostError(f"Rank {self._rank}: collective {name!r} was interrupted on the fast "
                                     f"lane ({type(e).__name__})"))
            raise
        finally:
            with table.lock:
                held = self._release(announce=table.error is None)
            for entry in held:
                self._control.announce(entry, False)
        return self.await_negotiated(handle)

    def _run(self, name: str, arr: np.ndarray, op: ReduceOp, key: int, seq: int, handle: PendingHandle) -> None:
        table = self._table
        try:
            agreed = self._agree(seq, key, name)
        except BaseException as e:
            with table.lock:
                table.drop(name)
            handle.set_error(self._explain_departure(e) if isinstance(e, PeerLostError) else e)
            return
        if agreed:
            table.stats["fast_lane"] += 1
            self._execution.run([AllReduce([name])])
            return
        # Not every rank is on the lane this round: negotiate through rank 0.
        with table.lock:
            if not table.holds(name):  # failed meanwhile
                return
            table.count_negotiated(handle)
        self._control.announce(self._control.entry(name, "allreduce", arr, op, 0), True)

    def await_negotiated(self, handle: PendingHandle) -> np.ndarray:
        """Wait for a collective that may go through rank 0. Meanwhile a peer may wait on
        the lane for this rank's word of the next round: post "slow" for it at once."""
        table = self._table
        start = time.monotonic()
        noticed = 0.0
        try:
            while not handle.done():
                with table.lock:
                    if table.error is None:
                        self.note_slow()
                handle.wait_done(0.002)
                now = time.monotonic()
                if now - start >= BLOCKED_AFTER_S and now - noticed >= BLOCKED_EVERY_S:
                    self._control.note_blocked(handle.name)
                    noticed = now
        finally:
            if noticed:
                self._control.note_blocked(None)
        return handle.wait()

    # ------------------------------------------------------------------ rounds (under the table's lock)
    def hold(self, entry: Entry) -> bool:
        """A negotiated submission: held (True) while a caller is on the lane, to be
        announced when it leaves; otherwise marked with a "slow" word."""
        if self.busy:
            self._held.append(entry)
            return True
        self.note_slow()
        return False

    def _open(self) -> bool:
        """Whether this rank may post a key for the next round now. A round for which a
        peer already posted "slow" is lost to the lane: this rank completes it with a
        "slow" word of its own and looks at the one after (so ranks that fell out of
        step get back in step instead of missing each other round after round)."""
        if self.busy:
            return False
        for _ in range(4):  # peers are at most one round ahead: two passes suffice
            if not self._words.decided(self._seq):
                return False
            if not self._words.slow_posted(self._seq + 1):
                return True
            self._post_slow()
        return False

    def note_slow(self) -> None:
        """Before a collective goes through rank 0 (and when negotiated work stalls): post
        a "slow" word for the next round, so that a peer waiting there on the lane falls
        back. Only when it can matter: this rank's word is a key, or a peer has posted a
        later round; otherwise ranks would drift apart by the number of "slow" words."""
        if self.busy or not self._words.decided(self._seq):
            return
        if self._slow and self._words.latest() <= self._seq:
            return
        self._post_slow()

    def _post_slow(self) -> None:
        self._seq += 1
        self._slow = True
        self._words.post(self._seq, LANE_SLOW)

    def _enter(self, key: int) -> int:
        """Post ``key`` for the next round (``busy`` is set)."""
        self._seq += 1
        self._slow = False
        self._words.post(self._seq, key)
        return self._seq

    def _release(self, announce: bool) -> list[Entry]:
        """Give the lane back; returns the submissions held meanwhile (to announce, which
        this rank first marks with a "slow" word; not when the reducer is failing)."""
        self.busy = False
        held, self._held = self._held, []
        if held and announce:
            self.note_slow()
        return held

    # ------------------------------------------------------------------ the wait (lock not held)
    def _agree(self, seq: int, key: int, name: str) -> bool:
        """Wait for every rank's word of round ``seq``: True when all posted ``key``.
        Otherwise this rank also posts "slow" for the next round at once (its peers may
        want the lane there while it negotiates). Raises CollectiveTimeoutError (ranks
        that posted nothing within the timeout) or PeerLostError (a rank closed, or this
        rank's reducer failed); this rank's word then turns "slow"."""
        timeout = self._timeout
        try:
            keys = self._words.keys(seq, f"collective {name!r}", lambda late: CollectiveTimeoutError(
                f"Collective {name!r} was submitted by rank {self._rank} but not by ranks {late} within "
                f"{timeout} s (every rank must submit the same collectives)"))
            gone = [j for j, k in enumerate(keys) if k == LANE_GONE]
            if gone:
                raise PeerLostError(f"Rank {self._rank}: collective {name!r} cannot complete: ranks {gone} "
                                    "closed their reducers")
        except BaseException:
            self._words.withdraw(seq)
            self._slow = True
            raise
        if all(k == key for k in keys):
            return True
        self._post_slow()  # no lock needed: while ``busy`` no other thread posts
        return False

    # ------------------------------------------------------------------ watchdog and close
    def watch(self) -> None:
        """The watchdog's look: negotiated work in flight that made no progress since the
        last look, while a peer may wait on this rank's word: post "slow"."""
        table = self._table
        with table.lock:
            stuck = table.negotiating and table.negotiated == self._finished
            self._finished = table.negotiated
            if stuck and table.error is None:
                self.note_slow()

    def leave(self) -> None:
        """At close: wait (briefly) for a caller on the lane to stop, which it does within
        a wait slice once the reducer has an error; then leave the lane for good."""
        deadline = time.monotonic() + 2.0
        while self.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        self._words.leave()
