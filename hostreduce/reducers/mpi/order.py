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

A rank that has joined (``Reducer.join``, on the world's communicator) keeps taking
part in every round, on the engine's thread, until every rank has joined: it shows
"joined" instead of a collective and lists nothing. The other ranks choose among
themselves as above; when some rank has joined, the first of them then broadcasts what
the chosen collective is (kind, dtype, shape, op), and every rank decides alike: an
all-reduce runs with the joined ranks' zeros (a mean still divides by the
communicator's size), a barrier passes them (its round's all-gather is the barrier),
anything else fails with
``JoinedRankError`` on the ranks that submitted it. Each of the joined rank's rounds
waits at most the timeout. The round in which every rank shows "joined" ends the join;
every rank returns the highest of the ranks that had not joined the round before (the
last to join), as each saw the same rounds.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
import zlib
from typing import Any, Callable

import numpy as np

from ...errors import JoinedRankError, TensorMismatchError, UnmatchedCollectiveError
from .._args import ReduceOp, as_dtype
from ..handle import Handle

__all__ = ["Entry", "Order", "key_of", "JOIN_NAME"]

Translate = Callable[[str, BaseException], "tuple[BaseException, bool]"]
_MAX_BACKOFF_S = 0.01
_LIST_NAMES = 8
# How long every rank's pending list must stay the same, with nothing in common, before
# the ranks are taken to have submitted different collectives.
SETTLE_S = 1.0
JOIN_NAME = "__join__"
_JOINED = -1   # a joined rank's key in a round (names' keys are CRC-32s: never negative)


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
    # What a joined rank needs to take part: {"kind": ..., and for an all-reduce "dtype",
    # "shape", "op"}; ``join``: this rank's join.
    spec: dict[str, Any] = dataclasses.field(default_factory=dict)
    join: bool = False

    def __post_init__(self) -> None:
        self.key = key_of(self.name)


@dataclasses.dataclass
class _Round:
    """What one round decided, the same on every rank: ``key`` (None: nothing yet) of
    the collective the ranks that have not joined run (``chosen``: this rank's entry of
    it, None on a joined rank), their fingerprints, the joined ranks; or that every
    rank has joined (``last``); or the ranks' lists when nothing is common (``lists``),
    None when every rank voted that nothing will be."""

    key: int | None = None
    chosen: Entry | None = None
    prints: list[int] = dataclasses.field(default_factory=list)
    joined: list[int] = dataclasses.field(default_factory=list)
    last: int | None = None
    lists: Any = None


class Order:
    """The pending collectives of each communicator (``Collectives``) of one engine."""

    def __init__(self, translate: Translate) -> None:
        self._translate = translate
        self._lock = threading.Lock()
        self._pending: dict[int, list[Entry]] = {}
        # Per communicator: the ranks that had not joined in the last round (every rank
        # sees every round, so all agree on it).
        self._active: dict[int, list[int]] = {}

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
        """Negotiate and run one collective of ``coll`` (on the engine's thread); when
        this rank's join is first, take part in the others' rounds until every rank
        has joined."""
        backoff = 1e-4
        seen: tuple[Any, float] | None = None   # (everyone's lists, since when) with nothing in common
        while True:
            with self._lock:
                entries = list(self._pending.get(id(coll), ()))
            if not entries:  # every entry failed as unmatched by an earlier drive
                return
            if entries[0].join:
                self._joined(coll, entries[0], deadline)
                return
            settled = seen is not None and time.monotonic() - seen[1] >= SETTLE_S
            rnd = self._round(coll, entries, settled)
            if rnd.chosen is not None:
                break
            if rnd.lists is None:  # every rank voted: the lists have not changed for SETTLE_S
                self._unmatched(coll, entries)
                return
            if seen is None or seen[0] != rnd.lists:
                seen = (rnd.lists, time.monotonic())
            if deadline.passed():
                raise UnmatchedCollectiveError(
                    f"Collective {entries[0].name!r} did not start within the deadline: no collective is pending on "
                    f"every rank of the communicator; pending here: {[e.name for e in entries[:_LIST_NAMES]]}")
            time.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF_S)
        chosen = rnd.chosen
        self._take(coll, chosen)
        spec = self._spec(coll, rnd)
        bad = [r for r, p in enumerate(rnd.prints) if p is not None and p != chosen.fingerprint]
        if bad:
            chosen.handle.set_error(TensorMismatchError(
                f"Tensor {chosen.name!r}: {chosen.describe}; ranks {bad} (of the communicator) disagree with this "
                "rank"))
            return
        if rnd.joined and spec.get("kind") not in ("allreduce", "barrier"):
            chosen.handle.set_error(JoinedRankError(
                f"Collective {chosen.name!r} ({spec.get('kind')}) cannot run while ranks {rnd.joined} (of the "
                "communicator) have joined: only all-reduces and barriers run with joined ranks (as in Horovod)"))
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

    def _joined(self, coll: Any, join: Entry, deadline: Any) -> None:
        """This rank has joined: take part in every round, with zeros in the all-reduces
        and in the barriers, until every rank has joined. Each round waits at most the
        deadline's timeout."""
        while True:
            deadline.at = time.monotonic() + deadline.timeout_s
            rnd = self._round(coll, [join], True)
            if rnd.last is not None:
                self._take(coll, join)
                join.handle.set_result(rnd.last)
                return
            if rnd.key is None:   # nothing common to the others yet, or they found nothing will be
                continue
            spec = self._spec(coll, rnd)
            if len({p for p in rnd.prints if p is not None}) > 1:  # they fail it as a mismatch
                continue
            if spec.get("kind") == "allreduce":   # (a barrier is the round itself)
                zeros = np.zeros(spec["shape"], as_dtype(spec["dtype"]))
                coll.allreduce(zeros, ReduceOp.parse(spec["op"]), zeros)

    def _spec(self, coll: Any, rnd: _Round) -> dict[str, Any]:
        """With joined ranks: what the chosen collective is, from the first rank that has
        not joined to every rank (else this rank's own entry's, unsent)."""
        if not rnd.joined:
            return rnd.chosen.spec if rnd.chosen is not None else {}
        MPI = coll.MPI
        root = next(r for r in range(coll.size) if r not in rnd.joined)
        mine = rnd.chosen is not None and coll.comm.Get_rank() == root
        payload = np.frombuffer(json.dumps(rnd.chosen.spec).encode(), np.uint8) if mine else np.zeros(0, np.uint8)
        length = np.array([payload.size], np.int64)
        coll.wait(coll.comm.Ibcast([length, MPI.INT64_T], root=root))
        data = payload.copy() if mine else np.zeros(int(length[0]), np.uint8)
        coll.wait(coll.comm.Ibcast([data, MPI.BYTE], root=root))
        return json.loads(data.tobytes())

    def _unmatched(self, coll: Any, entries: list[Entry]) -> None:
        """The ranks submitted different collectives: fail what was pending here."""
        error = UnmatchedCollectiveError(
            f"Collective {entries[0].name!r}: the ranks of the communicator submitted different collectives (none is "
            f"pending on every rank, and none came for {SETTLE_S} s); pending here: "
            f"{[e.name for e in entries[:_LIST_NAMES]]}. Every rank must run the same collectives")
        for entry in entries:
            self._take(coll, entry)
            entry.handle.set_error(error)

    def _round(self, coll: Any, entries: list[Entry], settled: bool) -> _Round:
        """One round of the communicator's ranks: the collective every rank that has not
        joined runs now, or why none. Every rank reaches the same decision from the same
        exchanged numbers (a joined rank passes its join as ``entries``)."""
        MPI, size = coll.MPI, coll.size
        head = entries[0]
        joined_here = head.join
        if size == 1:
            return _Round(last=coll.comm.Get_rank()) if joined_here else _Round(head.key, head, [head.fingerprint])
        mine = np.array([_JOINED, 0] if joined_here else [head.key, head.fingerprint], np.int64)
        meta = np.empty((size, 2), np.int64)
        coll.wait(coll.comm.Iallgather([mine, MPI.INT64_T], [meta, MPI.INT64_T]))
        joined = [r for r in range(size) if meta[r, 0] == _JOINED]
        active = [r for r in range(size) if meta[r, 0] != _JOINED]
        before = self._active.get(id(coll), list(range(size)))
        self._active[id(coll)] = active if active else list(range(size))
        if not active:
            return _Round(last=max(before))
        keys = {int(meta[r, 0]) for r in active}
        if len(keys) == 1:
            key = keys.pop()
            prints = [int(meta[r, 1]) if r in active else None for r in range(size)]
            return _Round(key, None if joined_here else head, prints, joined)
        # Ranks differ in what they run first: exchange everything pending, and votes.
        listed = np.array([[e.key, e.fingerprint] for e in ([] if joined_here else entries)], np.int64).reshape(-1, 2)
        counts = np.empty((size, 2), np.int64)
        coll.wait(coll.comm.Iallgather([np.array([len(listed), int(settled or joined_here)], np.int64), MPI.INT64_T],
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
        for key in firsts[active[0]]:
            if all(key in firsts[r] for r in active):
                chosen = None if joined_here else next(e for e in entries if e.key == key)
                return _Round(key, chosen, [firsts[r][key] if r in active else None for r in range(size)], joined)
        if counts[:, 1].all():
            return _Round()
        return _Round(lists=counts[:, 0].tobytes() + gathered.tobytes())
