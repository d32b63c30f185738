"""Process groups: a subset of the job's ranks that runs collectives of its own.

A :class:`Group` is a value: the sorted world ranks of its members, and this process's
rank among them (``-1`` when it is not a member). ``Reducer.create_group(ranks)`` makes
one (engines that need a communicator per group build it there) and every collective
takes ``group=``; ``root``, ``dst``, ``src`` and split lists are counted in group ranks,
as MPI and HCCL count them. Collectives of disjoint groups run concurrently; a
collective that its members submit with different groups fails with
``TensorMismatchError`` naming it, on engines that compare (the ring).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..errors import ConfigError

__all__ = ["Group", "make_group"]


@dataclass(frozen=True)
class Group:
    """``ranks``: the members' world ranks, ascending; ``rank``: this process's rank in
    the group (its index in ``ranks``), or -1 when it is not a member."""

    ranks: tuple[int, ...]
    rank: int
    # The engine's own state for the group (a communicator, a process set); not compared.
    handle: Any = field(default=None, compare=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_member(self) -> bool:
        return self.rank >= 0

    @property
    def key(self) -> str:
        """A short text naming the group on the wire, equal on every rank."""
        return ",".join(map(str, self.ranks))

    def world_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def __str__(self) -> str:
        return f"group{list(self.ranks)}"


def make_group(ranks: Iterable[Any], world_rank: int, world_size: int) -> Group:
    """Validate ``ranks`` (distinct integers in [0, world_size)) and make the group."""
    try:
        values = list(ranks)
    except TypeError:
        values = None
    if (not values or any(isinstance(r, bool) or not isinstance(r, numbers.Integral) for r in values)
            or len(set(values)) != len(values) or not all(0 <= r < world_size for r in values)):
        raise ConfigError(f"`ranks` must be a non-empty list of distinct integers in [0, {world_size}). "
                          f"Received: ranks={ranks!r}")
    members = tuple(sorted(int(r) for r in values))
    return Group(members, members.index(world_rank) if world_rank in members else -1)
