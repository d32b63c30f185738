"""The ring's control protocol: every message ranks exchange, as a type, and the one
codec that both control paths use (gRPC frames between hosts, named pipes on one host).

A message is a frozen dataclass whose first field, ``rank``, is its sender; receivers
dispatch on its type. On the wire a message is

    code (1 byte) | header length (4 bytes, little-endian) | header (JSON) | data

where the header lists the message's fields in order and ``data`` holds the bytes of the
small arrays that an announcement carries along (an ``Entry``'s ``_data``), in entry
order. ``decode`` checks the code, the number of fields and that the data adds up, so a
malformed message fails as a ``ValueError`` where it is read.

A collective is described by an ``Entry`` (what a rank submitted) and planned as a
step (``AllReduce``, ``Broadcast``, ``AllGather``, ``ReduceScatter``, ``Reduce``,
``AllToAll``, ``P2P``, ``Barrier``, ``Joined`` or ``Fail``) that every rank taking part
runs in the order of the plan; a step names its ``group`` (world ranks; empty: the world) and
carries ``sid``, the coordinator's number for it, which tags its data frames (ranks
skip the steps of groups they are not in, so no per-rank count could). The coordinator (``negotiation.py``) works on
entries and plain plan items; ``steps`` turns its items into steps, once, on rank 0.

A rank that has joined (``Reducer.join``) announces an entry of kind "join" and then
takes part in the job's all-reduces it never submitted: their steps list it in
``joined`` and carry each tensor's dtype and shape (``zeros``) and the op, so that it
adds zeros. Once every rank has joined, a ``Joined`` step ends every rank's join with
the last rank to join.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import operator
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, NotRequired, TypedDict, Union

import numpy as np

__all__ = [
    "Entry", "PlanItem", "Cause", "AllReduce", "Broadcast", "AllGather", "ReduceScatter", "Reduce", "AllToAll",
    "P2P", "Barrier", "Joined", "Fail", "Step", "step_ranks", "JOIN_NAME",
    "Beat", "Join", "Welcome", "Ready", "Blocked", "Plan", "Departed", "PeerFailure", "Message",
    "steps", "encode", "decode", "encode_split",
]


class Entry(TypedDict):
    """A collective as one rank submitted it (its announcement to rank 0)."""

    name: str
    kind: str           # "allreduce", "broadcast", "allgather", "reducescatter", "reduce", "alltoall",
                        # "send", "recv", "barrier" or "join"
    dtype: str
    shape: list[int]
    op: str
    root: int           # broadcast/reduce: the root; send: the destination; recv: the source (group ranks)
    nbytes: int
    group: NotRequired[list[int]]    # the group's world ranks (absent: the world)
    counts: NotRequired[list[int]]   # reduce-scatter: rows per group rank; all-to-all: this rank's splits
    _data: NotRequired[Any]   # the data itself, sent along (small all-reduces over gRPC)


class PlanItem(TypedDict, total=False):
    """One item of the coordinator's plan; see ``negotiation.Coordinator``."""

    kind: str           # an Entry kind, or "error"
    names: list[str]
    gather: bool        # every rank sent its data along: rank 0 reduces it
    _parts: dict[str, list[Any]]   # rank 0 only: each name's data, in rank order
    counts: list[int]   # all-gather: every rank's first dimension; reduce-scatter: the counts
    group: list[int]    # the group's world ranks (empty: the world)
    sid: int            # the step's number, which tags its data
    root: int           # reduce: the root (group rank)
    splits: list[list[int]]   # all-to-all: every rank's splits, in group-rank order
    src: int            # send/receive: the world ranks of the pair
    dst: int
    joined: list[int]   # all-reduce, barrier: joined ranks that take part without an entry
    zeros: list[list[Any]]   # all-reduce with joined ranks: each name's [dtype, shape]
    op: str             # all-reduce with joined ranks: the op
    last: int           # join: the last rank to join
    etype: str          # error: a Cause value
    ranks: list[int]    # error: the ranks that fail
    error: str


# --------------------------------------------------------------------------- steps
class Cause(str, enum.Enum):
    """Why a planned collective fails (see ``negotiation.py``)."""

    MISMATCH = "mismatch"      # ranks submitted it with different shapes, dtypes or ops
    DEPARTED = "departed"      # a rank that must take part closed its reducer
    UNMATCHED = "unmatched"    # every rank waits for a collective some other rank lacks
    STALL = "stall"            # some ranks never submitted it within the timeout
    JOINED = "joined"          # a rank has joined, and it is not an all-reduce or barrier
    LOST = "lost"              # a rank stopped answering: the job cannot go on


@dataclass(frozen=True, slots=True)
class AllReduce:
    names: list[str]           # one fused bucket, in order
    gather: bool = False       # rank 0 holds every rank's data and sends the result
    parts: dict[str, list[Any]] | None = field(default=None, compare=False)  # rank 0 only; never sent
    group: tuple[int, ...] = ()  # world ranks; empty: the world
    sid: int = 0
    joined: tuple[int, ...] = ()   # ranks that add zeros: they submitted none of ``names``
    zeros: list[list[Any]] = field(default_factory=list)   # each name's [dtype, shape], for them
    op: str = ""                   # the op, for them


@dataclass(frozen=True, slots=True)
class Broadcast:
    names: list[str]
    group: tuple[int, ...] = ()
    sid: int = 0


@dataclass(frozen=True, slots=True)
class AllGather:
    names: list[str]
    counts: list[int]          # every rank's first dimension, in group-rank order
    group: tuple[int, ...] = ()
    sid: int = 0


@dataclass(frozen=True, slots=True)
class ReduceScatter:
    names: list[str]
    counts: list[int]          # rows of the result per group rank
    group: tuple[int, ...] = ()
    sid: int = 0


@dataclass(frozen=True, slots=True)
class Reduce:
    names: list[str]
    root: int                  # a group rank
    group: tuple[int, ...] = ()
    sid: int = 0


@dataclass(frozen=True, slots=True)
class AllToAll:
    names: list[str]
    splits: list[list[int]]    # splits[i][j]: rows group rank i sends to group rank j
    group: tuple[int, ...] = ()
    sid: int = 0


@dataclass(frozen=True, slots=True)
class P2P:
    names: list[str]
    src: int                   # world ranks: the sender and the receiver
    dst: int
    sid: int = 0


@dataclass(frozen=True, slots=True)
class Barrier:
    names: list[str]
    group: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()   # ranks that pass it without having entered it


@dataclass(frozen=True, slots=True)
class Joined:
    """Every rank has joined: their joins return ``last``."""

    names: list[str]
    last: int


@dataclass(frozen=True, slots=True)
class Fail:
    cause: Cause
    names: list[str]
    ranks: list[int]           # the ranks whose collectives fail
    error: str


Step = Union[AllReduce, Broadcast, AllGather, ReduceScatter, Reduce, AllToAll, P2P, Barrier, Joined, Fail]

# The name every rank's join has while it waits.
JOIN_NAME = "__join__"


def step_ranks(step: Step) -> tuple[int, ...] | list[int]:
    """The world ranks that take part in ``step`` (empty: every rank)."""
    if isinstance(step, P2P):
        return (step.src, step.dst)
    if isinstance(step, Fail):
        return step.ranks
    if isinstance(step, Joined):
        return ()
    return step.group


def _g(it: PlanItem) -> dict[str, Any]:
    return {"group": tuple(it.get("group", ())), "sid": it.get("sid", 0)}


_FROM_ITEM: dict[str, Callable[[PlanItem], Step]] = {
    "allreduce": lambda it: AllReduce(it["names"], it.get("gather", False), it.get("_parts"), **_g(it),
                                      joined=tuple(it.get("joined", ())), zeros=it.get("zeros", []),
                                      op=it.get("op", "")),
    "broadcast": lambda it: Broadcast(it["names"], **_g(it)),
    "allgather": lambda it: AllGather(it["names"], it["counts"], **_g(it)),
    "reducescatter": lambda it: ReduceScatter(it["names"], it["counts"], **_g(it)),
    "reduce": lambda it: Reduce(it["names"], it["root"], **_g(it)),
    "alltoall": lambda it: AllToAll(it["names"], it["splits"], **_g(it)),
    "p2p": lambda it: P2P(it["names"], it["src"], it["dst"], it.get("sid", 0)),
    "barrier": lambda it: Barrier(it["names"], tuple(it.get("group", ())), tuple(it.get("joined", ()))),
    "join": lambda it: Joined(it["names"], it["last"]),
    "error": lambda it: Fail(Cause(it["etype"]), it["names"], it["ranks"], it["error"]),
}


def steps(items: list[PlanItem]) -> list[Step]:
    """The coordinator's plan items as steps."""
    return [_FROM_ITEM[it["kind"]](it) for it in items]


# --------------------------------------------------------------------------- messages
@dataclass(frozen=True, slots=True)
class Beat:
    """A heartbeat: the sender is alive."""

    rank: int


@dataclass(frozen=True, slots=True)
class Join:
    """Start-up, to rank 0: this rank's settings (which every rank must share), host and
    process (to tell one host from several, and to record the job's owners)."""

    rank: int
    transport: str
    chunk_bytes: int
    fast_lane: bool
    single_copy: bool
    host: str
    pid: int
    start: int
    data_port: int = 0   # its data listener (``tcp_links.py``); 0: none


@dataclass(frozen=True, slots=True)
class Welcome:
    """Start-up, from rank 0: the job's data path and its entries' token (and on the
    ``tcp`` path every rank's data port), or an error."""

    rank: int
    transport: str = ""
    token: str = ""
    error: str = ""
    ports: list[int] = field(default_factory=list)   # every rank's data port, on the ``tcp`` path


@dataclass(frozen=True, slots=True)
class Ready:
    """To rank 0: collectives this rank submitted."""

    rank: int
    entries: list[Entry]


@dataclass(frozen=True, slots=True)
class Blocked:
    """To rank 0: a caller on this rank has waited a while for ``name`` (None: no more)."""

    rank: int
    name: str | None


@dataclass(frozen=True, slots=True)
class Plan:
    """From rank 0: the next steps, which every rank runs in this order."""

    rank: int
    steps: list[Step]


@dataclass(frozen=True, slots=True)
class Departed:
    """From rank 0 through the pipes, after every plan it sent: it closed its reducer."""

    rank: int


@dataclass(frozen=True, slots=True)
class PeerFailure:
    """Over gRPC: the sender failed (or aborts the job) because of ``why``; ``failed``
    lists the ranks known to have failed, so that a rank that stops in turn does not
    spend its farewell on them."""

    rank: int
    why: str
    failed: list[int]


Message = Union[Beat, Join, Welcome, Ready, Blocked, Plan, Departed, PeerFailure]

_MESSAGES: tuple[type, ...] = (Beat, Join, Welcome, Ready, Blocked, Plan, Departed, PeerFailure)
_STEPS: tuple[type, ...] = (AllReduce, Broadcast, AllGather, Barrier, Fail, ReduceScatter, Reduce, AllToAll, P2P,
                           Joined)
_CODE = {cls: i + 1 for i, cls in enumerate(_MESSAGES)}
_STEP_CODE = {cls: i + 1 for i, cls in enumerate(_STEPS)}
_PREFIX = struct.Struct("<BI")
_HEAD = _PREFIX.size


def _getter(cls: type) -> Callable[[Any], tuple]:
    """The fields that travel (all but those marked ``compare=False``), as a tuple."""
    names = [f.name for f in dataclasses.fields(cls) if f.compare]
    get = operator.attrgetter(*names)
    return get if len(names) > 1 else (lambda obj: (get(obj),))


_FIELDS = {cls: _getter(cls) for cls in _MESSAGES + _STEPS}
_STEP_NAMES = {cls: [f.name for f in dataclasses.fields(cls) if f.compare] for cls in _STEPS}
_ARITY = {cls: sum(1 for f in dataclasses.fields(cls) if f.compare) for cls in _MESSAGES}


def _entries_head(entries: list[Entry], blobs: list[memoryview]) -> list[dict]:
    out = []
    for e in entries:
        if "_data" in e:
            head = {k: v for k, v in e.items() if k != "_data"}
            head["inline"] = True
            blobs.append(memoryview(np.ascontiguousarray(e["_data"]).reshape(-1).view(np.uint8)))
            out.append(head)
        else:
            out.append(e)
    return out


def encode(msg: Message) -> bytes:
    """``msg`` on the wire (see the module docstring)."""
    blobs: list[memoryview] = []
    if isinstance(msg, Plan):
        head: Any = (msg.rank, [(_STEP_CODE[type(s)], *_FIELDS[type(s)](s)) for s in msg.steps])
    elif isinstance(msg, Ready):
        head = (msg.rank, _entries_head(msg.entries, blobs))
    else:
        head = _FIELDS[type(msg)](msg)
    text = json.dumps(head).encode()
    prefix = _PREFIX.pack(_CODE[type(msg)], len(text))
    return b"".join([prefix, text, *blobs]) if blobs else prefix + text


def decode(payload: bytes | memoryview) -> Message:
    """The message in ``payload``; an inline entry's ``_data`` is a view into it."""
    if len(payload) < _HEAD:
        raise ValueError(f"control message of {len(payload)} bytes is too short")
    code, n = _PREFIX.unpack_from(payload)
    if not 1 <= code <= len(_MESSAGES):
        raise ValueError(f"unknown control message code {code}")
    cls = _MESSAGES[code - 1]
    head = json.loads(bytes(payload[_HEAD:_HEAD + n]))
    if not isinstance(head, list) or len(head) != _ARITY[cls]:
        raise ValueError(f"malformed {cls.__name__} message")
    end = _HEAD + n
    if cls is Plan:
        head[1] = [_step(s) for s in head[1]]
    elif cls is Ready:
        view = memoryview(payload)
        for e in head[1]:
            if e.pop("inline", False):
                e["_data"] = view[end:end + int(e["nbytes"])]
                end += int(e["nbytes"])
    if end != len(payload):
        raise ValueError(f"{cls.__name__} message of {len(payload)} bytes does not match its header")
    return cls(*head)


def _step(head: list[Any]) -> Step:
    if not 1 <= head[0] <= len(_STEPS):
        raise ValueError(f"unknown plan step code {head[0]}")
    cls = _STEPS[head[0] - 1]
    if len(head) != len(_STEP_NAMES[cls]) + 1:
        raise ValueError(f"malformed {cls.__name__} step")
    if cls is Fail:
        return Fail(Cause(head[1]), *head[2:])
    fields = dict(zip(_STEP_NAMES[cls], head[1:]))
    for tupled in ("group", "joined"):
        if tupled in fields:
            fields[tupled] = tuple(fields[tupled])   # as the plan's steps hold it
    return cls(**fields)


def encode_split(msg: Ready, limit: int) -> list[bytes]:
    """``msg`` as one or more messages of at most ``limit`` bytes each (for a pipe with
    several writers, where only short writes are atomic). Entries are never split."""
    payload = encode(msg)
    if len(payload) <= limit or len(msg.entries) <= 1:
        return [payload]
    half = len(msg.entries) // 2
    return (encode_split(Ready(msg.rank, msg.entries[:half]), limit)
            + encode_split(Ready(msg.rank, msg.entries[half:]), limit))
