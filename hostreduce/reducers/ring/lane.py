"""The one-host fast lane: a blocking all-reduce that skips the negotiation through rank 0.

Horovod caches the responses to collectives it has negotiated before; on one host the
ranks can do better and agree through shared memory. Each rank posts, for the next lane
round, a key of the collective it is about to run (a hash of name, dtype, shape and op)
in its word of the shared control segment (``ShmGroup.lane_post``). When every rank
posted the same key, the calling threads run the data path at once; any other outcome
(a different key, a rank that negotiates through rank 0 this round, a rank that gave up
or closed) sends the collective through rank 0 as usual, which also reports mismatches.

Rounds stay in step because a rank posts for round k + 1 only after every rank posted
for round k, and every collective that goes through rank 0 is preceded by a "slow" word
for the next round when this rank may post one (``note_slow``). A rank waiting on rank 0
also posts a "slow" word when its negotiated work stalls (the reducer's watchdog calls
``note_slow``), so a peer that wants the lane never waits on it for long.

The caller serializes every method with the reducer's lock, except ``agree`` (the wait),
which runs while this rank holds the lane (``busy``).
"""
from __future__ import annotations

import hashlib
import platform
from typing import Any

import numpy as np

from ...errors import CollectiveTimeoutError, PeerLostError
from ..base import Handle, ReduceOp
from .shm import LANE_GONE, LANE_SLOW

__all__ = ["CountedHandle", "FastLane", "lane_key"]


def lane_key(name: str, arr: np.ndarray, op: ReduceOp) -> int:
    """A collective's key: equal on every rank iff name, dtype, shape and op are (63 bits,
    so it never equals the reserved negative words)."""
    text = f"{name}\x00{arr.dtype.str}\x00{arr.shape}\x00{op.value}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


class CountedHandle(Handle):
    """A handle that tells its owner it finished, before its waiter wakes, while it counts
    among the collectives negotiated through rank 0 (a rank enters the lane only when
    none is in flight). ``_owner`` is set under the owner's lock."""

    __slots__ = ("_owner",)

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._owner: Any = None

    def _finish(self, result: Any, error: BaseException | None) -> None:
        with self._lock:
            owner, self._owner = self._owner, None
        if owner is not None:
            owner._slow_finished()
        super()._finish(result, error)


class FastLane:
    def __init__(self, shm: Any, rank: int, timeout_s: float) -> None:
        self._shm, self._rank, self._timeout = shm, rank, timeout_s
        self._seq = 0          # the last round this rank posted for
        self._slow = True      # whether that word is "slow" (round 0: every word is)
        self.busy = False      # a caller thread holds the lane: other submissions wait
        self.held: list[dict] = []

    @staticmethod
    def supported() -> bool:
        """The words are published with plain stores (a key, then its round number), which
        readers see in that order only under x86-64's memory ordering."""
        return platform.machine().lower() in ("x86_64", "amd64")

    def open(self) -> bool:
        """Whether this rank may post a key for the next round now. A round for which a
        peer already posted "slow" is lost to the lane: this rank completes it with a
        "slow" word of its own and looks at the one after (so ranks that fell out of
        step get back in step instead of missing each other round after round)."""
        if self.busy:
            return False
        for _ in range(4):  # peers are at most one round ahead: two passes suffice
            if not self._shm.lane_decided(self._seq):
                return False
            if not self._shm.lane_slow_posted(self._seq + 1):
                return True
            self._post_slow()
        return False

    def note_slow(self) -> None:
        """Before a collective goes through rank 0 (and when negotiated work stalls): post
        a "slow" word for the next round, so that a peer waiting there on the lane falls
        back. Only when it can matter: this rank's word is a key, or a peer has posted a
        later round; otherwise ranks would drift apart by the number of "slow" words."""
        if self.busy or not self._shm.lane_decided(self._seq):
            return
        if self._slow and self._shm.lane_latest() <= self._seq:
            return
        self._post_slow()

    def _post_slow(self) -> None:
        self._seq += 1
        self._slow = True
        self._shm.lane_post(self._seq, LANE_SLOW)

    def enter(self, key: int) -> int:
        """Post ``key`` for the next round (the caller set ``busy`` after ``open()``)."""
        self.busy = True
        self._seq += 1
        self._slow = False
        self._shm.lane_post(self._seq, key)
        return self._seq

    def agree(self, seq: int, key: int, name: str) -> bool:
        """Wait for every rank's word of round ``seq``: True when all posted ``key``.
        Otherwise this rank also posts "slow" for the next round at once (its peers may
        want the lane there while it negotiates). Raises CollectiveTimeoutError (ranks
        that posted nothing within the timeout) or PeerLostError (a rank closed, or this
        rank's reducer failed); this rank's word then turns "slow"."""
        timeout = self._timeout
        try:
            keys = self._shm.lane_keys(seq, f"collective {name!r}", lambda late: CollectiveTimeoutError(
                f"Collective {name!r} was submitted by rank {self._rank} but not by ranks {late} within "
                f"{timeout} s (every rank must submit the same collectives)"))
            gone = [j for j, k in enumerate(keys) if k == LANE_GONE]
            if gone:
                raise PeerLostError(f"Rank {self._rank}: collective {name!r} cannot complete: ranks {gone} "
                                    "closed their reducers")
        except BaseException:
            self._shm.lane_withdraw(seq)
            self._slow = True
            raise
        if all(k == key for k in keys):
            return True
        self._post_slow()
        return False

    def release(self, announce: bool = True) -> list[dict]:
        """Give the lane back; returns the submissions held meanwhile (to announce, which
        this rank first marks with a "slow" word; not when the reducer is failing)."""
        self.busy = False
        held, self.held = self.held, []
        if held and announce:
            self.note_slow()
        return held
