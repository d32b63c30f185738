"""Agreeing on one execution order for collectives submitted in any order.

Every rank announces each collective it submits (name, kind, dtype, shape, op, root,
group) to the coordinator on rank 0. A collective is known by its name and its group
(and, for a send/receive, by the pair of ranks), so disjoint groups may use the same
names at once. When every member has announced it, the coordinator checks that the
announcements agree and appends it to the plan, numbered (the step id that tags its
data), which every member then executes in plan order (a rank skips the steps of
groups it is not in, so the steps of disjoint groups run at once). Two ranks that
each count the other as a member of a collective but announced it with different
groups can never complete it (a rank has a name in flight once): it fails as a
mismatch naming every rank's group, on every member. Consecutive all-reduces of the same dtype and op that
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

A rank out of data joins (an entry of kind "join", after everything it announced
before): from then on it counts as having announced every collective of the whole job
(the world group; process groups are not joined, as in Horovod). An all-reduce that
every other rank announced is planned with the joined ranks listed, with each tensor's
dtype and shape and the op, so that they add zeros (a mean still divides by the job's
size); a barrier passes them; any other collective fails on the ranks that submitted
it (``Cause.JOINED``), as Horovod refuses it. When the last rank joins, a "join" item
returns it to every rank and the job is no longer joined. The join fails like a
collective: when a rank that has not joined closes its reducer, or when the ranks that
have not joined announce nothing for the timeout (or one stops answering).

Pure logic: no threads or sockets, so it is tested directly.
"""
from __future__ import annotations

import secrets
import threading
import time
from typing import Any, Callable

from .messages import JOIN_NAME, Entry, Join, PlanItem, Welcome

__all__ = ["Coordinator", "describe", "decide_data_path"]

# How long every rank must stay blocked with nothing in common before it is reported.
_SETTLE_S = 0.3
_LIST_NAMES = 8   # pending names listed per rank in that report

_Described = dict[str, Any]   # an Entry with the fields derived for matching
# A collective's key: its name, its group's world ranks and, for a send/receive, the pair
# (sender, receiver) in world ranks. Disjoint groups may use one name at once.
_Key = tuple[str, tuple[int, ...], "tuple[int, int] | None"]
_FIELDS = {
    "allreduce": ("kind", "dtype", "shape", "op"),
    "broadcast": ("kind", "dtype", "shape", "root"),
    "allgather": ("kind", "dtype", "inner_shape"),
    "reducescatter": ("kind", "dtype", "shape", "op", "counts"),
    "reduce": ("kind", "dtype", "shape", "op", "root"),
    "alltoall": ("kind", "dtype", "inner_shape"),
    "p2p": ("dtype", "shape"),
    "barrier": ("kind",),
}
_P2P = ("send", "recv")


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
        self._world = tuple(range(size))
        self._table: dict[_Key, dict[int, _Described]] = {}
        self._by_name: dict[str, set[_Key]] = {}
        self._first_seen: dict[_Key, float] = {}
        # Collectives failed for a group mismatch, and their members yet to submit them
        # (who fail as they do): key -> (error, ranks, since).
        self._poisoned: dict[_Key, tuple[str, set[int], float]] = {}
        self._departed: set[int] = set()
        self._blocked: dict[int, str] = {}    # rank -> the name its caller waits for
        self._stuck_since: float | None = None
        self._settle = settle_s
        self._sid = 0
        # The ranks that have joined, in the order they did, and when a rank last
        # announced anything while some had.
        self._joined: list[int] = []
        self._join_activity = 0.0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ keys and slots
    def _key(self, rank: int, e: Entry) -> _Key:
        group = tuple(e.get("group") or self._world)
        if e["kind"] == "send":
            return (e["name"], group, (rank, group[e["root"]]))
        if e["kind"] == "recv":
            return (e["name"], group, (group[e["root"]], rank))
        return (e["name"], group, None)

    @staticmethod
    def _members(key: _Key) -> tuple[int, ...]:
        return key[2] if key[2] is not None else key[1]

    def _pop(self, key: _Key) -> dict[int, _Described]:
        slot = self._table.pop(key)
        del self._first_seen[key]
        keys = self._by_name[key[0]]
        keys.discard(key)
        if not keys:
            del self._by_name[key[0]]
        return slot

    def _complete(self, key: _Key, slot: dict[int, _Described]) -> bool:
        """Whether every member announced ``key`` (a joined rank counts for the world's)."""
        covered = set(slot)
        if self._joined and key[1] == self._world:
            covered.update(self._joined)
        return all(m in covered for m in self._members(key))

    def _holds(self, rank: int, name: str) -> bool:
        """Whether ``rank`` has announced ``name`` (on any group) and it is not planned."""
        return any(rank in self._table[k] for k in self._by_name.get(name, ()))

    def on_ready(self, rank: int, entries: list[Entry]) -> None:
        with self._lock:
            # A rank that submits is not blocked (its blocked notice comes again if it is).
            self._blocked.pop(rank, None)
            self._stuck_since = None
            items: list[PlanItem] = []
            complete: list[_Key] = []
            joined_now = False
            if self._joined:
                self._join_activity = self._clock()
            for e in entries:
                if e["kind"] == "join":
                    if rank not in self._joined:
                        self._joined.append(rank)
                    self._join_activity = self._clock()
                    joined_now = True
                    continue
                key = self._key(rank, e)
                if self._poison_hit(key, rank, items):
                    continue
                slot = self._table.setdefault(key, {})
                if not slot:
                    self._first_seen[key] = self._clock()
                    self._by_name.setdefault(key[0], set()).add(key)
                slot[rank] = describe(e)
                if self._group_clash(key, rank, items):
                    continue
                if self._complete(key, slot):
                    complete.append(key)
            if joined_now:  # what waited only for the ranks that joined now
                complete += [k for k, slot in self._table.items() if k not in complete and self._complete(k, slot)]
            if complete:
                items += self._plan(complete)
            if joined_now and len(self._joined) == self.size:
                items.append({"kind": "join", "names": [JOIN_NAME], "last": self._joined[-1]})
                self._joined = []
            if items:
                self._send(items)
            if self._departed:
                self._fail_waiting_on_departed()

    def _group_clash(self, key: _Key, rank: int, items: list[PlanItem]) -> bool:
        """Ranks that count each other as members of collective ``name`` but submitted it
        with different groups: neither can ever complete (a rank has a name in flight
        once), so both fail as a mismatch, naming every rank's group."""
        name, group, pair = key
        if pair is not None:
            return False
        for other in sorted(self._by_name.get(name, ()), key=repr):
            if other == key or other[2] is not None or rank not in other[1]:
                continue
            if not any(b in group for b in self._table[other]):
                continue
            slots = {k: self._pop(k) for k in (key, other)}
            per_rank = sorted((r, k[1]) for k, slot in slots.items() for r in slot)
            error = (f"Tensor {name!r} mismatch across ranks in group: "
                     + ", ".join(f"rank {r}: group{list(g)}" for r, g in per_rank))
            now = self._clock()
            for k, slot in slots.items():
                items.append({"kind": "error", "etype": "mismatch", "names": [name], "ranks": sorted(slot),
                              "error": error})
                later = set(k[1]) - set(slot)
                if later:
                    self._poisoned[k] = (error, later, now)
            return True
        return False

    def _poison_hit(self, key: _Key, rank: int, items: list[PlanItem]) -> bool:
        record = self._poisoned.get(key)
        if record is None or rank not in record[1]:
            return False
        record[1].discard(rank)
        if not record[1]:
            del self._poisoned[key]
        items.append({"kind": "error", "etype": "mismatch", "names": [key[0]], "ranks": [rank], "error": record[0]})
        return True

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
                self._holds(rank, name) or (name == JOIN_NAME and rank in self._joined)
                for rank, name in self._blocked.items())
            if not stuck:
                self._stuck_since = None
                return
            now = self._clock()
            if self._stuck_since is None:
                self._stuck_since = now
                return
            if now - self._stuck_since < self._settle:
                return
            pending = {r: sorted({k[0] for k, slot in self._table.items() if r in slot}) for r in range(self.size)}
            waits = ", ".join(f"rank {r} has joined" if r in self._joined else f"rank {r} waits for {_some(names)}"
                              for r, names in pending.items())
            names = sorted({k[0] for k in self._table})
            for key in list(self._table):
                self._pop(key)
            self._blocked.clear()
            self._stuck_since = None
            self._send([{
                "kind": "error", "etype": "unmatched", "names": names, "ranks": list(range(self.size)),
                "error": (f"No collective is pending on every rank, and every rank is waiting: {waits} "
                          "(every rank must submit the same collectives; a rank whose threads all block in "
                          "waits cannot submit the rest, as in a TF1 graph that runs more independent "
                          "collectives at once than it has inter-op threads)"),
            }])

    def mark_departed(self, rank: int) -> None:
        """``rank`` closed its reducer: fail what waits for it, now and from now on."""
        with self._lock:
            self._departed.add(rank)
            self._fail_waiting_on_departed()

    def _fail_waiting_on_departed(self) -> None:
        items = []
        gone = sorted(self._departed - set(self._joined))
        if self._joined and gone:
            items.append({
                "kind": "error", "etype": "departed", "names": [JOIN_NAME], "ranks": sorted(self._joined),
                "error": f"The join cannot complete: ranks {gone} closed their reducers without joining",
            })
            self._joined = []
        for key in [k for k, slot in self._table.items() if (self._departed & set(self._members(k))) - set(slot)]:
            slot = self._pop(key)
            gone = sorted((self._departed & set(self._members(key))) - set(slot))
            items.append({
                "kind": "error", "etype": "departed", "names": [key[0]], "ranks": sorted(slot),
                "error": f"Collective {key[0]!r} cannot complete: ranks {gone} closed their reducers",
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
            for key in [k for k, rec in self._poisoned.items() if now - rec[2] > self._timeout]:
                del self._poisoned[key]
            stale = [k for k, t in self._first_seen.items() if now - t > self._timeout]
            items = []
            for key in stale:
                name = key[0]
                slot = self._pop(key)
                missing = sorted(set(self._members(key)) - set(slot))
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
            if self._joined and now - self._join_activity > self._timeout:
                joined = sorted(self._joined)
                waiting = [r for r in range(self.size) if r not in joined]
                self._joined = []
                why = not_answering(waiting) if not_answering is not None else None
                items.append({
                    "kind": "error", "etype": "lost" if why is not None else "stall", "names": [JOIN_NAME],
                    "ranks": joined,
                    "error": why or (f"Ranks {joined} joined, but ranks {waiting} neither joined nor submitted a "
                                     f"collective within {self._timeout} s"),
                })
            if items:
                self._send(items)

    def _next_sid(self) -> int:
        self._sid += 1
        return self._sid

    def _plan(self, keys: list[_Key]) -> list[PlanItem]:
        items: list[PlanItem] = []
        bucket: list[str] = []
        bucket_key: tuple | None = None
        bucket_bytes = 0
        bucket_group: list[int] = []
        parts: dict[str, list[Any]] = {}
        zeros: list[list[Any]] = []   # with joined ranks: each name's dtype and shape

        def flush() -> None:
            nonlocal bucket, bucket_key, bucket_bytes, parts, zeros
            if bucket:
                item: PlanItem = {"kind": "allreduce", "names": bucket, "sid": self._next_sid()}
                if bucket_group:
                    item["group"] = bucket_group
                if zeros:
                    assert bucket_key is not None
                    item["joined"] = list(bucket_key[4])
                    item["zeros"] = zeros
                    item["op"] = bucket_key[1]
                if parts:
                    # Every rank sent its data with the announcement: rank 0 reduces and
                    # sends the result back (keys starting with "_" stay on rank 0).
                    item["gather"] = True
                    item["_parts"] = parts
                items.append(item)
            bucket, bucket_key, bucket_bytes, parts, zeros = [], None, 0, {}, []

        for key in keys:
            if key not in self._table:  # failed meanwhile
                continue
            name, group, pair = key
            slot = self._pop(key)
            members = self._members(key)
            present = tuple(r for r in members if r in slot)
            absent = [r for r in members if r not in slot]   # joined ranks
            ref = slot[present[0]]
            error = self._mismatch(name, slot, present, "p2p" if pair is not None else None)
            if error is not None:
                flush()
                items.append({"kind": "error", "etype": "mismatch", "names": [name],
                              "ranks": sorted(slot), "error": error})
                continue
            kind = ref["kind"]
            if absent and (pair is not None or kind not in ("allreduce", "barrier")):
                flush()
                items.append({"kind": "error", "etype": "joined", "names": [name], "ranks": sorted(slot),
                              "error": (f"Collective {name!r} ({'send/receive' if pair is not None else kind}) cannot "
                                        f"run while ranks {absent} have joined: only all-reduces and barriers of the "
                                        "whole job run with joined ranks (as in Horovod)")})
                continue
            glist = [] if group == self._world else list(group)
            if pair is not None:
                flush()
                items.append({"kind": "p2p", "names": [name], "src": pair[0], "dst": pair[1],
                              "sid": self._next_sid()})
                continue
            if kind != "allreduce":
                flush()
                item: PlanItem = {"kind": kind, "names": [name]}
                if glist:
                    item["group"] = glist
                if kind != "barrier":
                    item["sid"] = self._next_sid()
                elif absent:
                    item["joined"] = absent
                if kind == "allgather":
                    item["counts"] = [slot[r]["shape"][0] if slot[r]["shape"] else 1 for r in members]
                elif kind == "reducescatter":
                    item["counts"] = ref["counts"]
                elif kind == "reduce":
                    item["root"] = ref["root"]
                elif kind == "alltoall":
                    item["splits"] = [slot[r]["counts"] for r in members]
                items.append(item)
                continue
            # Only the world's small all-reduces go through rank 0 (it may not be a member).
            gathered = not glist and not absent and all("_data" in slot[r] for r in members)
            fuse = (ref["dtype"], ref["op"], gathered, group, tuple(absent))
            nbytes = ref["nbytes"]
            limit = self.gather_threshold if gathered else self.fusion_threshold
            if bucket and (fuse != bucket_key or bucket_bytes + nbytes > limit):
                flush()
            bucket.append(name)
            bucket_key = fuse
            bucket_group = glist
            bucket_bytes += nbytes
            if absent:
                zeros.append([ref["dtype"], list(ref["shape"])])
            if gathered:
                parts[name] = [slot[r]["_data"] for r in members]
        flush()
        return items

    def _mismatch(self, name: str, slot: dict[int, _Described], members: tuple[int, ...],
                  kind: str | None = None) -> str | None:
        ref = slot[members[0]]
        fields = _FIELDS.get(kind or ref["kind"], ("kind",))
        if kind is None and any(slot[r]["kind"] != ref["kind"] for r in slot):
            fields = ("kind",)
        for field in fields:
            values = [slot[r].get(field) for r in members]
            if any(v != values[0] for v in values):
                per_rank = ", ".join(f"rank {r}: {_fmt(field, v)}" for r, v in zip(members, values))
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
        transport = "shm" if same_host else "tcp"
    ports = [j.data_port for j in joins] if transport == "tcp" else []
    bad = [j.rank for j in joins if transport == "tcp" and not (type(j.data_port) is int and 0 < j.data_port < 65536)]
    if bad:
        return Welcome(0, error=f"The `tcp` data path needs every worker's data port. Received none usable from "
                                f"ranks {bad} (ports {[joins[r].data_port for r in bad]})")
    return Welcome(0, transport=transport, token=secrets.token_hex(8), ports=ports)
