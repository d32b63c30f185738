"""Agreeing on which collective runs next, so that ranks may submit in different orders.

MPI matches collectives by position. A TF1 graph run by a ``Session`` starts the
independent ops of one run in any order, so two ranks may submit the same collectives
in different orders. Before each collective, the ranks of its communicator compare the
name and the fingerprint (dtype, shape, op, root) of the first collective each has
pending, with one all-gather of two numbers per rank:

* all names equal: that collective runs (or fails with ``TensorMismatchError`` on every
  rank when the fingerprints differ; the engine stays usable);
* otherwise every rank sends the list of everything it has pending, and all run the
  first collective of rank 0's list that every rank has pending; when there is none
  yet, they ask again (backing off up to 10 ms) until a rank submits it. When no rank's
  list has changed for ``SETTLE_S`` on every rank (each votes), the ranks submitted
  different collectives: what each had pending then fails with
  ``UnmatchedCollectiveError`` on every rank, and the engine stays usable.

Each submission adds one entry and queues one "drive" on the engine's thread, and each
drive runs exactly one negotiated collective, so the k-th drive of every rank runs the
same collective. In programs that submit in one order (the usual case) the cost is the
one small all-gather per collective that the shape check already took.
"""
from __future__ import annotations

import dataclasses
import threading
import time
import zlib
from typing import Any, Callable

import numpy as np

from ...errors import TensorMismatchError, UnmatchedCollectiveError
from ..handle import Handle

__all__ = ["Entry", "Order", "key_of"]

Translate = Callable[[str, BaseException], "tuple[BaseException, bool]"]
_MAX_BACKOFF_S = 0.01
_LIST_NAMES = 8
# How long every rank's pending list must stay the same, with nothing in common, before
# the ranks are taken to have submitted different collectives.
SETTLE_S = 1.0


def key_of(text: str) -> int:
    return zlib.crc32(text.encode())


@dataclasses.dataclass
class Entry:
    """A submitted collective waiting for its turn."""

    name: str
    fingerprint: int
    describe: str                      # what the fingerprint covers, for the mismatch message
    run: Callable[[Any], Any]          # run(collectives) -> result
    handle: Handle
    key: int = 0

    def __post_init__(self) -> None:
        self.key = key_of(self.name)


class Order:
    """The pending collectives of each communicator (``Collectives``) of one engine."""

    def __init__(self, translate: Translate) -> None:
        self._translate = translate
        self._lock = threading.Lock()
        self._pending: dict[int, list[Entry]] = {}

    def add(self, coll: Any, entry: Entry) -> None:
        with self._lock:
            self._pending.setdefault(id(coll), []).append(entry)

    def fail_all(self, error: BaseException) -> None:
        """The engine cannot run what is pending (it broke, or closed): fail it."""
        with self._lock:
            victims = [e for entries in self._pending.values() for e in entries]
            self._pending.clear()
        for entry in victims:
            entry.handle.set_error(error)

    def _take(self, coll: Any, entry: Entry) -> None:
        with self._lock:
            entries = self._pending.get(id(coll), [])
            if entry in entries:
                entries.remove(entry)

    def drive(self, coll: Any, deadline: Any) -> None:
        """Negotiate and run one collective of ``coll`` (on the engine's thread)."""
        backoff = 1e-4
        seen: tuple[Any, float] | None = None   # (everyone's lists, since when) with nothing in common
        while True:
            with self._lock:
                entries = list(self._pending.get(id(coll), ()))
            if not entries:  # every entry failed as unmatched by an earlier drive
                return
            settled = seen is not None and time.monotonic() - seen[1] >= SETTLE_S
            chosen, prints, lists = self._choose(coll, entries, settled)
            if chosen is not None:
                break
            if lists is None:  # every rank voted: the lists have not changed for SETTLE_S
                self._unmatched(coll, entries)
                return
            if seen is None or seen[0] != lists:
                seen = (lists, time.monotonic())
            if deadline.passed():
                raise UnmatchedCollectiveError(
                    f"Collective {entries[0].name!r} did not start within the deadline: no collective is pending on "
                    f"every rank of the communicator; pending here: {[e.name for e in entries[:_LIST_NAMES]]}")
            time.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF_S)
        self._take(coll, chosen)
        bad = [r for r, p in enumerate(prints) if p != chosen.fingerprint]
        if bad:
            chosen.handle.set_error(TensorMismatchError(
                f"Tensor {chosen.name!r}: {chosen.describe}; ranks {bad} (of the communicator) disagree with this "
                "rank"))
            return
        try:
            result = chosen.run(coll)
        except Exception as exc:  # noqa: BLE001 - delivered to the collective's handle
            error, fatal = self._translate(chosen.name, exc)
            chosen.handle.set_error(error)
            if fatal:
                raise
            return
        chosen.handle.set_result(result)

    def _unmatched(self, coll: Any, entries: list[Entry]) -> None:
        """The ranks submitted different collectives: fail what was pending here."""
        error = UnmatchedCollectiveError(
            f"Collective {entries[0].name!r}: the ranks of the communicator submitted different collectives (none is "
            f"pending on every rank, and none came for {SETTLE_S} s); pending here: "
            f"{[e.name for e in entries[:_LIST_NAMES]]}. Every rank must run the same collectives")
        for entry in entries:
            self._take(coll, entry)
            entry.handle.set_error(error)

    def _choose(self, coll: Any, entries: list[Entry], settled: bool
                ) -> tuple[Entry | None, list[int], Any]:
        """The collective every rank runs now and each rank's fingerprint of it; else
        (None, [], everyone's lists) when no collective is pending everywhere yet, or
        (None, [], None) when every rank voted ``settled``. Every rank reaches the same
        decision from the same exchanged numbers."""
        MPI, size = coll.MPI, coll.size
        head = entries[0]
        if size == 1:
            return head, [head.fingerprint], None
        mine = np.array([head.key, head.fingerprint], np.int64)
        meta = np.empty((size, 2), np.int64)
        coll.wait(coll.comm.Iallgather([mine, MPI.INT64_T], [meta, MPI.INT64_T]))
        if (meta[:, 0] == head.key).all():
            return head, meta[:, 1].tolist(), None
        # Ranks differ in what they run first: exchange everything pending, and votes.
        listed = np.array([[e.key, e.fingerprint] for e in entries], np.int64)
        counts = np.empty((size, 2), np.int64)
        coll.wait(coll.comm.Iallgather([np.array([len(entries), int(settled)], np.int64), MPI.INT64_T],
                                       [counts, MPI.INT64_T]))
        gathered = np.empty((int(counts[:, 0].sum()), 2), np.int64)
        sizes = (counts[:, 0] * 2).tolist()
        displs = np.concatenate(([0], np.cumsum(counts[:, 0] * 2)[:-1])).tolist()
        coll.wait(coll.comm.Iallgatherv([listed, MPI.INT64_T], [gathered, (sizes, displs), MPI.INT64_T]))
        firsts: list[dict[int, int]] = []
        at = 0
        for n in counts[:, 0].tolist():
            first: dict[int, int] = {}
            for key, fingerprint in gathered[at:at + n].tolist():
                first.setdefault(key, fingerprint)
            firsts.append(first)
            at += n
        for key in firsts[0]:
            if all(key in f for f in firsts):
                chosen = next(e for e in entries if e.key == key)
                return chosen, [f[key] for f in firsts], None
        if counts[:, 1].all():
            return None, [], None
        return None, [], counts[:, 0].tobytes() + gathered.tobytes()
