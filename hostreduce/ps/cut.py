"""Async applies paused at one cut of every ps, so that a checkpoint of async training is
a consistent state of the whole model.

In async mode each push is applied on arrival, and a worker's push of one step goes to
every ps at once (each its own call). Two ps that each snapshot "now" can thus hold
different sets of pushes: one has applied worker 1's push of step 7, the other has not
received it yet. A cut is consistent when, for every worker, every ps has settled
(applied or refused) the same number of that worker's pushes.

The chief makes one (``PSClient.cut``): it pauses every ps (:meth:`ApplyGate.pause`:
pushes arriving meanwhile wait, those being applied finish) and compares what each has
settled per worker. Where one ps is behind on a worker, that worker's push is in flight
to it (sent at once to every ps, and the worker sends no other until all answered), so
a second pause names the counts to reach (``until``): the ps lets exactly those pushes
through, and the counts are then equal everywhere. Each ps then snapshots its shard in
memory and the applies go on (:meth:`ApplyGate.resume`); the files are written after,
outside the pause.

Pushes without a step (``PSClient.push`` without ``step`` goes only to the ps its
gradients concern) are held while paused but not counted. A worker that died between
its pushes to two ps (lost or done, as the ps knows it) is not waited for: its last
push is then in the shards that received it only.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Mapping

from ..errors import CollectiveTimeoutError, PeerLostError

__all__ = ["ApplyGate"]


class ApplyGate:
    """One ps's async applies: counted per worker, and paused for a cut."""

    def __init__(self, ps_index: int) -> None:
        self.index = ps_index
        self._cond = threading.Condition()
        self._paused = False
        self._applying = 0
        self._until: dict[int, int] = {}
        self._aborted: str | None = None
        self.settled: dict[int, int] = {}  # worker -> how many of its pushes with a step were applied or refused

    def _may_pass(self, rank: int, counted: bool) -> bool:
        return not self._paused or (counted and self.settled.get(rank, 0) < self._until.get(rank, 0))

    def enter(self, rank: int, counted: bool, wait_s: float) -> None:
        """Before worker ``rank`` applies a push (``counted``: it carries a step): wait
        while a cut holds the applies, at most ``wait_s``."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while not self._may_pass(rank, counted) and self._aborted is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeoutError(
                        f"ps task {self.index}: a push of worker {rank} waited {wait_s:.1f} s for the chief's "
                        "checkpoint to let applies go on (the chief paused them and did not resume)")
                self._cond.wait(left)
            if self._aborted is not None:
                raise PeerLostError(f"ps task {self.index} stopped serving ({self._aborted})")
            self._applying += 1

    def leave(self, rank: int, counted: bool) -> None:
        """After the push :meth:`enter` let through was applied or refused."""
        with self._cond:
            self._applying -= 1
            if counted:
                self.settled[rank] = self.settled.get(rank, 0) + 1
            self._cond.notify_all()

    def pause(self, until: Mapping[int, int], wait_s: float, gone: Callable[[], set[int]]) -> dict[int, int]:
        """Hold every later push; let through the pushes that bring each worker in
        ``until`` to its count (not those of workers in ``gone()``: lost or done); return
        the counts once no apply is running and those are reached. Raises
        CollectiveTimeoutError, still paused, when that takes longer than ``wait_s``."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            self._paused = True
            self._until = dict(until)
            self._cond.notify_all()
            while True:
                missing = {r: n for r, n in self._until.items() if self.settled.get(r, 0) < n and r not in gone()}
                if not self._applying and not missing:
                    return dict(self.settled)
                left = deadline - time.monotonic()
                if left <= 0:
                    if self._applying:
                        raise CollectiveTimeoutError(f"ps task {self.index}: {self._applying} apply(s) still ran "
                                                     f"{wait_s:.1f} s after the chief paused them for a checkpoint")
                    raise CollectiveTimeoutError(
                        f"ps task {self.index}: for a consistent checkpoint this ps waited {wait_s:.1f} s for "
                        + ", ".join(f"worker {r}'s push #{n} (another ps has applied it)" for r, n in missing.items())
                        + "; it never came. No checkpoint is taken")
                self._cond.wait(min(left, 0.5))  # gone() changes without a notify

    def resume(self) -> None:
        """Let every push through again."""
        with self._cond:
            self._paused = False
            self._until = {}
            self._cond.notify_all()

    def abort(self, why: str) -> None:
        """This ps stops serving: pushes waiting here fail at once."""
        with self._cond:
            self._aborted = why
            self._cond.notify_all()
