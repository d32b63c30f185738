"""Where each variable lives among M parameter servers, and where each of its rows is.

Small variables are held whole by one ps; a variable of at least ``shard_bytes`` bytes
(with at least M rows) is split by rows across every ps. Rows are dealt round-robin
(row ``g`` on ps ``g % M`` at local row ``g // M``, TensorFlow's ``mod`` partition
strategy): vocabularies are usually sorted by frequency, and dealing spreads the hot
rows over every ps where contiguous ranges would put them all on the first. Whole
variables are then placed greedily, largest first, on the ps with the fewest bytes so
far (the row shards counted), ties to the lowest index.

The result depends only on the set of variables, ``M`` and the threshold, never on the
order the variables were listed in, so every process computes the same placement
without talking to the others, and a checkpoint re-shards onto a different M by
computing both placements (:func:`locate`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from ..errors import ConfigError

__all__ = ["VarSpec", "VarPlacement", "Placement", "place", "locate", "is_sharded", "DEFAULT_SHARD_BYTES"]

# Variables of this many bytes or more are split by rows (TensorFlow's
# min_max_variable_partitioner default is 256 KiB per shard; larger whole variables
# keep a ps from being the bottleneck of every pull).
DEFAULT_SHARD_BYTES = 4 << 20

_DTYPES = ("float16", "float32", "float64")


@dataclass(frozen=True)
class VarSpec:
    """A variable's name, shape and dtype (a numpy dtype name)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"`name` must be a non-empty string. Received: name={self.name!r}")
        shape = tuple(self.shape)
        if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ConfigError(f"`shape` of {self.name!r} must be non-negative integers. Received: shape={self.shape!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        try:
            dtype = np.dtype(self.dtype).name
        except TypeError:
            dtype = repr(self.dtype)
        if dtype not in _DTYPES:
            raise ConfigError(f"`dtype` of {self.name!r} must be one of {_DTYPES}. Received: dtype={self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    def to_json(self) -> list:
        return [self.name, list(self.shape), self.dtype]

    @staticmethod
    def from_json(item: Sequence) -> "VarSpec":
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise ConfigError(f"a variable spec must be [name, shape, dtype]. Received: {item!r}"[:200])
        return VarSpec(item[0], tuple(item[1]), item[2])


@dataclass(frozen=True)
class VarPlacement:
    """One variable's place: ``ps`` (whole) or ``None`` (rows dealt over ``num_ps``)."""

    spec: VarSpec
    ps: int | None
    num_ps: int

    @property
    def sharded(self) -> bool:
        return self.ps is None

    def holders(self) -> range | tuple[int]:
        return range(self.num_ps) if self.ps is None else (self.ps,)

    def local_rows(self, m: int) -> int:
        """How many rows ps ``m`` holds (0 if none)."""
        if self.ps is not None:
            return self.spec.rows if m == self.ps else 0
        return len(range(m, self.spec.rows, self.num_ps))

    def local_shape(self, m: int) -> tuple[int, ...]:
        if self.ps is not None:
            return self.spec.shape if m == self.ps else (0,)
        return (self.local_rows(m),) + self.spec.shape[1:]

    def global_rows(self, m: int) -> np.ndarray:
        """The global row ids ps ``m`` holds, in its local order."""
        if self.ps is not None:
            return np.arange(self.spec.rows if m == self.ps else 0, dtype=np.int64)
        return np.arange(m, self.spec.rows, self.num_ps, dtype=np.int64)

    def route(self, ids: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """For each ps, ``(positions in ids, local row ids)`` of the rows it holds."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.ps is not None:
            empty = np.zeros(0, np.int64)
            return [(np.arange(len(ids)), ids) if m == self.ps else (empty, empty) for m in range(self.num_ps)]
        owner = ids % self.num_ps
        out = []
        for m in range(self.num_ps):
            pos = np.flatnonzero(owner == m)
            out.append((pos, ids[pos] // self.num_ps))
        return out

    def split(self, value: np.ndarray) -> list[np.ndarray]:
        """The part of a full ``value`` that each ps holds."""
        if self.ps is not None:
            return [value if m == self.ps else value[:0] for m in range(self.num_ps)]
        return [value[m::self.num_ps] for m in range(self.num_ps)]

    def merge(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        """The full value from every holder's part (inverse of :meth:`split`)."""
        if self.ps is not None:
            return parts[self.ps]
        out = np.empty(self.spec.shape, dtype=parts[0].dtype)
        for m, part in enumerate(parts):
            out[m::self.num_ps] = part
        return out


@dataclass(frozen=True)
class Placement:
    """Every variable's place over ``num_ps`` parameter servers."""

    num_ps: int
    shard_bytes: int
    entries: Mapping[str, VarPlacement] = field(default_factory=dict)

    def __getitem__(self, name: str) -> VarPlacement:
        try:
            return self.entries[name]
        except KeyError:
            raise ConfigError(f"no variable named {name!r} is placed on the parameter servers") from None

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    @property
    def specs(self) -> list[VarSpec]:
        return [p.spec for p in self.entries.values()]

    def on(self, m: int) -> list[str]:
        """Names of the variables ps ``m`` holds (whole or some rows), in a fixed order."""
        return [n for n, p in self.entries.items() if p.local_rows(m) > 0 or (p.ps == m)]

    def bytes_per_ps(self) -> list[int]:
        out = [0] * self.num_ps
        for p in self.entries.values():
            row_bytes = p.spec.nbytes // max(1, p.spec.rows)
            for m in p.holders():
                out[m] += p.spec.nbytes if p.ps is not None else p.local_rows(m) * row_bytes
        return out

    def to_json(self) -> dict:
        return {"num_ps": self.num_ps, "shard_bytes": self.shard_bytes, "specs": [s.to_json() for s in self.specs]}

    @staticmethod
    def from_json(obj: Mapping) -> "Placement":
        return place([VarSpec.from_json(s) for s in obj["specs"]], int(obj["num_ps"]), shard_bytes=int(obj["shard_bytes"]))


def is_sharded(shape: Sequence[int], itemsize: int, num_ps: int, shard_bytes: int) -> bool:
    """Whether a variable of ``shape`` is split by rows over ``num_ps`` ps (else held whole)."""
    return num_ps > 1 and len(shape) >= 1 and math.prod(shape) * itemsize >= shard_bytes and shape[0] >= num_ps


def place(specs: Iterable[VarSpec], num_ps: int, *, shard_bytes: int = DEFAULT_SHARD_BYTES) -> Placement:
    """The placement of ``specs`` over ``num_ps`` parameter servers (see the module's docstring)."""
    if isinstance(num_ps, bool) or not isinstance(num_ps, int) or num_ps < 1:
        raise ConfigError(f"`num_ps` must be an integer >= 1. Received: num_ps={num_ps!r}")
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise ConfigError(f"`shard_bytes` must be an integer >= 1. Received: shard_bytes={shard_bytes!r}")
    specs = list(specs)
    by_name: dict[str, VarSpec] = {}
    for s in specs:
        if not isinstance(s, VarSpec):
            raise ConfigError(f"`specs` must hold VarSpec values. Received: {s!r}")
        if s.name in by_name and by_name[s.name] != s:
            raise ConfigError(f"variable {s.name!r} is listed twice with different shapes or dtypes: "
                              f"{by_name[s.name]} and {s}")
        by_name[s.name] = s
    names = sorted(by_name)
    load = [0] * num_ps
    out: dict[str, VarPlacement] = {}
    for name in names:
        s = by_name[name]
        if is_sharded(s.shape, np.dtype(s.dtype).itemsize, num_ps, shard_bytes):
            p = VarPlacement(s, None, num_ps)
            row_bytes = s.nbytes // s.rows
            for m in range(num_ps):
                load[m] += p.local_rows(m) * row_bytes
            out[name] = p
    for name in sorted((n for n in names if n not in out), key=lambda n: (-by_name[n].nbytes, n)):
        m = min(range(num_ps), key=lambda k: (load[k], k))
        load[m] += by_name[name].nbytes
        out[name] = VarPlacement(by_name[name], m, num_ps)
    return Placement(num_ps, shard_bytes, {n: out[n] for n in names})


def locate(placement: Placement, name: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For global row ids ``rows`` of ``name``: the ps holding each, and its local row id there."""
    p = placement[name]
    rows = np.asarray(rows, dtype=np.int64)
    if p.ps is not None:
        return np.full(rows.shape, p.ps, dtype=np.int64), rows
    return rows % p.num_ps, rows // p.num_ps
