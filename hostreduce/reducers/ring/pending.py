"""The table of collectives this rank has submitted and not yet finished.

Every plane meets here and nowhere else: submission admits an entry (refusing a name
already in flight, or any work once the job has failed), execution takes the entries
a plan step names, and a failure ends every entry at once, so that no handle is left
waiting. Whoever takes an entry out owns its handle from then on; an entry is in the
table or in one plane's hands, never both, which is why no handle can complete twice
with different outcomes.

The table also counts the collectives negotiated through rank 0 that are in flight: the
fast lane opens only when none is (``fastlane.py``), and how many have finished is the
watchdog's measure of progress. Its ``lock`` orders admissions with the lane's rounds.
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...errors import CollectiveTimeoutError, ConfigError
from ..base import Handle, ReduceOp

__all__ = ["Pending", "PendingHandle", "PendingTable"]


class PendingHandle(Handle):
    """A collective's handle. Its long waits go through ``waits(handle, timeout)``
    (which tells rank 0 that this rank is blocked); while it counts among the
    negotiated collectives in flight it tells the table when it finishes, before its
    waiter wakes (so a caller that waited sees the lane open)."""

    __slots__ = ("_waits", "_table")

    def __init__(self, name: str, waits: Callable[["PendingHandle", float | None], bool]) -> None:
        super().__init__(name)
        self._waits = waits
        self._table: PendingTable | None = None   # set under the table's lock

    def wait(self, timeout: float | None = None) -> Any:
        if not self._event.is_set() and not self._waits(self, timeout):
            raise CollectiveTimeoutError(f"Collective {self.name!r} did not complete within timeout={timeout} s")
        return super().wait(0)

    def _finish(self, result: Any, error: BaseException | None) -> None:
        with self._lock:
            table, self._table = self._table, None
        if table is not None:
            table.negotiated_finished()
        super()._finish(result, error)


@dataclass(slots=True)
class Pending:
    """A submitted collective: its arguments and its handle (``wire``: the 16-bit dtype
    a compressed all-reduce travels as)."""

    kind: str
    array: np.ndarray
    out: np.ndarray | None
    op: ReduceOp
    root: int
    handle: PendingHandle
    wire: np.dtype | None = None


class PendingTable:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.lock = threading.Lock()
        self._entries: dict[str, Pending] = {}
        self.error: BaseException | None = None
        self.failed = False         # ``error`` is a failure (not rank 0's orderly goodbye)
        self.negotiating = 0        # negotiated through rank 0 and not finished
        self.negotiated = 0         # negotiated and finished, since start
        self.stats: collections.Counter = collections.Counter()

    # Under ``lock``.
    def check(self, name: str) -> None:
        """Raise the job's error once it has one, and refuse a name already in flight
        (the caller holds ``lock``)."""
        if self.error is not None:
            raise self.error
        if name in self._entries:
            raise ConfigError(f"A collective named {name!r} is already in flight on rank {self.rank}; "
                              "wait for it before submitting the name again")

    def admit(self, name: str, entry: Pending, negotiated: bool = True) -> int:
        """Add ``entry`` after ``check`` (the caller holds ``lock``); returns how many
        are in flight."""
        self.check(name)
        self._entries[name] = entry
        if negotiated:
            self.count_negotiated(entry.handle)
        return len(self._entries)

    def count_negotiated(self, handle: PendingHandle) -> None:
        """``handle``'s collective goes through rank 0 (the caller holds ``lock``)."""
        self.negotiating += 1
        handle._table = self

    def idle(self) -> bool:
        """Nothing in flight on this rank (the caller holds ``lock``)."""
        return not self._entries and not self.negotiating

    def holds(self, name: str) -> bool:
        return name in self._entries

    def drop(self, name: str) -> None:
        self._entries.pop(name, None)

    # Taking the lock.
    def negotiated_finished(self) -> None:
        with self.lock:
            self.negotiating -= 1
            self.negotiated += 1

    def take(self, names: list[str]) -> list[Pending]:
        """Remove and return the entries of ``names`` that are still here, in order."""
        with self.lock:
            return [self._entries.pop(n) for n in names if n in self._entries]

    def fail(self, error: BaseException, failure: bool = True) -> list[Pending] | None:
        """Record the job's ``error`` and empty the table; returns what was in it, or
        None if the job already had an error (the first one stands)."""
        with self.lock:
            if self.error is not None:
                return None
            self.error, self.failed = error, failure
            entries, self._entries = list(self._entries.values()), {}
        return entries

    def close(self, error: BaseException) -> list[Pending]:
        """Empty the table for good (``error`` stands unless the job already has one)."""
        with self.lock:
            entries, self._entries = list(self._entries.values()), {}
            if self.error is None:
                self.error = error
        return entries
