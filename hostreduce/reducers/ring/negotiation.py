"""Agreeing on one execution order for collectives submitted in any order.

Every rank announces each collective it submits (name, kind, dtype, shape, op, root)
to the coordinator on rank 0. When all ranks have announced a name, the coordinator
checks that the announcements agree and appends it to the plan that every rank then
executes in the same order. Consecutive all-reduces of the same dtype and op that
become ready together are fused into one bucket up to the fusion threshold. Small
all-reduces whose data every rank sent along with its announcement (``_data``) form
buckets of their own (up to ``gather_threshold`` bytes) that rank 0 reduces itself.
Disagreements and collectives that some ranks never submit become error items, so
every rank that submitted them fails with a message naming each rank's value.

Ranks also tell the coordinator when a wait of theirs has lasted a while ("blocked on
name", ``on_blocked``). When every rank is blocked on a name that it announced but that
some other rank has not, no collective can complete: a name announced by every rank is
planned at once, so none is pending everywhere, and a blocked rank submits nothing more.
After a short settling time (messages in flight) every pending collective of every rank
fails with one message naming each rank's pending names, instead of after the timeout.
Collectives that are merely not matched yet (a rank that will submit them later, and
is not waiting) are never reported this way.

Pure logic: no threads or sockets, so it is tested directly.
"""
from __future__ import annotations

import secrets
import threading
import time
from typing import Any, Callable

from .messages import Entry, Join, PlanItem, Welcome

__all__ = ["Coordinator", "describe", "decide_data_path"]

# How long every rank must stay blocked with nothing in common before it is reported.
_SETTLE_S = 0.3
_LIST_NAMES = 8   # pending names listed per rank in that report

_Described = dict[str, Any]   # an Entry with the fields derived for matching
_FIELDS = {
    "allreduce": ("kind", "dtype", "shape", "op"),
    "broadcast": ("kind", "dtype", "shape", "root"),
    "allgather": ("kind", "dtype", "inner_shape"),
    "barrier": ("kind",),
}


def describe(entry: Entry) -> _Described:
    """Add derived fields used for matching."""
    described: _Described = dict(entry)
    described["inner_shape"] = list(entry["shape"][1:])
    return described


class Coordinator:
    def __init__(self, size: int, fusion_threshold: int, send_plan: Callable[[list[PlanItem]], None],
                 timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 gather_threshold: int = 1 << 20, settle_s: float = _SETTLE_S) -> None:
        self.size = size
        self.fusion_threshold = fusion_threshold
        self.gather_threshold = gather_threshold
        self._send = send_plan
        self._timeout = timeout_s
        self._clock = clock
        self._table: dict[str, dict[int, _Described]] = {}
        self._first_seen: dict[str, float] = {}
        self._departed: set[int] = set()
        self._blocked: dict[int, str] = {}    # rank -> the name its caller waits for
        self._stuck_since: float | None = None
        self._settle = settle_s
        self._lock = threading.Lock()

    def on_ready(self, rank: int, entries: list[Entry]) -> None:
        with self._lock:
            # A rank that submits is not blocked (its blocked notice comes again if it is).
            self._blocked.pop(rank, None)
            self._stuck_since = None
            complete: list[str] = []
            for e in entries:
                name = e["name"]
                slot = self._table.setdefault(name, {})
                if not slot:
                    self._first_seen[name] = self._clock()
                slot[rank] = describe(e)
                if len(slot) == self.size:
                    complete.append(name)
            if complete:
                items = self._plan(complete)
                self._send(items)
            if self._departed:
                self._fail_waiting_on_departed()

    def on_blocked(self, rank: int, name: str | None) -> None:
        """``rank``'s caller has waited a while for collective ``name`` (None: it stopped
        waiting). Notices come again while the wait lasts."""
        with self._lock:
            if name is None:
                self._blocked.pop(rank, None)
            elif self._blocked.get(rank) != name:
                self._blocked[rank] = name
                self._stuck_since = None

    def check_blocked(self) -> None:
        """Fail every pending collective at once when every rank waits for one that some
        other rank has not submitted (and has for ``settle_s``)."""
        with self._lock:
            stuck = len(self._blocked) == self.size and all(
                rank in self._table.get(name, {}) for rank, name in self._blocked.items())
            if not stuck:
                self._stuck_since = None
                return
            now = self._clock()
            if self._stuck_since is None:
                self._stuck_since = now
                return
            if now - self._stuck_since < self._settle:
                return
            pending = {r: sorted(n for n, slot in self._table.items() if r in slot) for r in range(self.size)}
            waits = ", ".join(f"rank {r} waits for {_some(names)}" for r, names in pending.items())
            names = sorted(self._table)
            for name in names:
                del self._table[name]
                del self._first_seen[name]
            self._blocked.clear()
            self._stuck_since = None
            self._send([{
                "kind": "error", "etype": "unmatched", "names": names, "ranks": list(range(self.size)),
                "error": (f"No collective is pending on every rank, and every rank is waiting: {waits} "
                          "(every rank must submit the same collectives)"),
            }])

    def mark_departed(self, rank: int) -> None:
        """``rank`` closed its reducer: fail what waits for it, now and from now on."""
        with self._lock:
            self._departed.add(rank)
            self._fail_waiting_on_departed()

    def _fail_waiting_on_departed(self) -> None:
        items = []
        for name in [n for n, slot in self._table.items() if self._departed - set(slot)]:
            slot = self._table.pop(name)
            del self._first_seen[name]
            gone = sorted(self._departed - set(slot))
            items.append({
                "kind": "error", "etype": "departed", "names": [name], "ranks": sorted(slot),
                "error": f"Collective {name!r} cannot complete: ranks {gone} closed their reducers",
            })
        if items:
            self._send(items)

    def check_stalls(self, not_answering: Callable[[list[int]], str | None] | None = None) -> None:
        """Fail collectives that some ranks submitted and others did not, after the timeout.
        ``not_answering(ranks)`` says which of the missing ranks has stopped answering, if
        one has: the collective then fails as lost to that rank (etype "lost"), since the
        submission order is not to blame."""
        with self._lock:
            now = self._clock()
            stale = [n for n, t in self._first_seen.items() if now - t > self._timeout]
            items = []
            for name in stale:
                slot = self._table.pop(name)
                del self._first_seen[name]
                missing = sorted(set(range(self.size)) - set(slot))
                why = not_answering(missing) if not_answering is not None else None
                if why is not None:
                    items.append({"kind": "error", "etype": "lost", "names": [name], "ranks": sorted(slot),
                                  "error": why})
                    continue
                items.append({
                    "kind": "error", "etype": "stall", "names": [name], "ranks": sorted(slot),
                    "error": (f"Collective {name!r} was submitted by ranks {sorted(slot)} but not by ranks "
                              f"{missing} within {self._timeout} s (every rank must submit the same collectives)"),
                })
            if items:
                self._send(items)

    def _plan(self, names: list[str]) -> list[PlanItem]:
        items: list[PlanItem] = []
        bucket: list[str] = []
        bucket_key: tuple | None = None
        bucket_bytes = 0
        parts: dict[str, list[Any]] = {}

        def flush() -> None:
            nonlocal bucket, bucket_key, bucket_bytes, parts
            if bucket:
                item: PlanItem = {"kind": "allreduce", "names": bucket}
                if parts:
                    # Every rank sent its data with the announcement: rank 0 reduces and
                    # sends the result back (keys starting with "_" stay on rank 0).
                    item["gather"] = True
                    item["_parts"] = parts
                items.append(item)
            bucket, bucket_key, bucket_bytes, parts = [], None, 0, {}

        for name in names:
            slot = self._table.pop(name)
            del self._first_seen[name]
            ref = slot[0]
            error = self._mismatch(name, slot)
            if error is not None:
                flush()
                items.append({"kind": "error", "etype": "mismatch", "names": [name],
                              "ranks": list(range(self.size)), "error": error})
                continue
            kind = ref["kind"]
            if kind != "allreduce":
                flush()
                item = {"kind": kind, "names": [name]}
                if kind == "allgather":
                    item["counts"] = [slot[r]["shape"][0] if slot[r]["shape"] else 1 for r in range(self.size)]
                items.append(item)
                continue
            gathered = all("_data" in slot[r] for r in range(self.size))
            key = (ref["dtype"], ref["op"], gathered)
            nbytes = ref["nbytes"]
            limit = self.gather_threshold if gathered else self.fusion_threshold
            if bucket and (key != bucket_key or bucket_bytes + nbytes > limit):
                flush()
            bucket.append(name)
            bucket_key = key
            bucket_bytes += nbytes
            if gathered:
                parts[name] = [slot[r]["_data"] for r in range(self.size)]
        flush()
        return items

    def _mismatch(self, name: str, slot: dict[int, _Described]) -> str | None:
        fields = _FIELDS.get(slot[0]["kind"], ("kind",))
        if any(slot[r]["kind"] != slot[0]["kind"] for r in slot):
            fields = ("kind",)
        for field in fields:
            values = [slot[r].get(field) for r in range(self.size)]
            if any(v != values[0] for v in values):
                per_rank = ", ".join(f"rank {r}: {_fmt(field, v)}" for r, v in enumerate(values))
                return f"Tensor {name!r} mismatch across ranks in {field}: {per_rank}"
        return None


def _some(names: list[str]) -> str:
    if len(names) <= _LIST_NAMES:
        return str(names)
    return f"{names[:_LIST_NAMES]} and {len(names) - _LIST_NAMES} more"


def _fmt(field: str, value: Any) -> str:
    if field in ("shape", "inner_shape"):
        return str(tuple(value))
    return str(value)


def decide_data_path(joins: list[Join]) -> Welcome:
    """Rank 0's answer to every rank's start-up ``Join``: the data path for the job, or
    an error naming the setting on which the ranks disagree."""
    joins = sorted(joins, key=lambda j: j.rank)
    for field in ("transport", "chunk_bytes", "fast_lane", "single_copy"):
        values = [getattr(j, field) for j in joins]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {j.rank}: {getattr(j, field)!r}" for j in joins)
            return Welcome(0, error=f"Every worker needs the same `{field}` setting. Received: {per_rank}")
    same_host = len({j.host for j in joins}) == 1
    transport = joins[0].transport
    if transport == "shm" and not same_host:
        hosts = sorted({j.host for j in joins})
        return Welcome(0, error=f"`transport`='shm' needs every worker on one host. Received workers on {hosts}")
    if transport == "auto":
        transport = "shm" if same_host else "grpc"
    return Welcome(0, transport=transport, token=secrets.token_hex(8))
