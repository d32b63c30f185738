"""Horovod's process sets on hostreduce's process groups.

``hvd.ProcessSet(ranks)`` names some ranks of the job; ``hvd.init(process_sets=[...])``
or ``hvd.add_process_set(ranks)`` registers it (every rank of the job calls it, as in
Horovod), after which collectives take ``process_set=``. A registered set is a group of
the job's engine (``Reducer.create_group``): its collectives run among its members,
concurrently with those of disjoint sets. ``hvd.remove_process_set`` releases it.
``hvd.global_process_set`` is the whole job.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

from ..errors import ConfigError
from . import job as _engine

__all__ = ["init", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "group_of", "find",
           "register_initial"]


class ProcessSet:
    """Some ranks of the job. ``process_set_id`` is None until it is registered."""

    def __init__(self, ranks: Sequence[int]) -> None:
        try:
            values = sorted(int(r) for r in ranks if not isinstance(r, bool))
            ok = len(values) == len(list(ranks)) and len(set(values)) == len(values) and bool(values)
        except (TypeError, ValueError):
            ok, values = False, []
        if not ok:
            raise ConfigError(f"`ranks` must be a non-empty list of distinct integers. Received: ranks={ranks!r}")
        self.ranks: list[int] | None = values
        self.process_set_id: int | None = None
        self._group: Any = None

    def size(self) -> int | None:
        return None if self.process_set_id is None else len(self.ranks or ())

    def rank(self) -> int | None:
        """This process's rank within the set (None when not registered or not a member)."""
        if self.process_set_id is None or not self.included():
            return None
        return (self.ranks or []).index(_engine.rank())

    def included(self) -> bool | None:
        return None if self.process_set_id is None else _engine.rank() in (self.ranks or ())

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    """The whole job (``hvd.global_process_set``)."""

    def __init__(self) -> None:
        self.process_set_id = 0
        self._group = None

    @property
    def ranks(self) -> list[int]:  # type: ignore[override]
        return list(range(_engine.size()))

    def size(self) -> int:
        return _engine.size()

    def rank(self) -> int:
        return _engine.rank()

    def included(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "global_process_set"


global_process_set = _GlobalProcessSet()
_lock = threading.Lock()
_next_id = 1
_registered: dict[int, ProcessSet] = {}


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register ``process_set`` (or a list of ranks) and return it; every rank of the
    job calls this with the same ranks."""
    global _next_id
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    world = _engine.size()
    if not all(0 <= r < world for r in ps.ranks or ()):
        raise ConfigError(f"`process_set` ranks must be in [0, {world}). Received: ranks={ps.ranks}")
    with _lock:
        if ps.process_set_id is not None:
            raise ConfigError(f"`process_set` is registered already. Received: {ps!r}")
        if any(p.ranks == ps.ranks for p in _registered.values()):
            raise ConfigError(f"A process set with ranks {ps.ranks} exists already (Horovod refuses duplicates). "
                              f"Received: {ps!r}")
        ps._group = _engine.job().reducer().create_group(ps.ranks)
        ps.process_set_id = _next_id
        _registered[_next_id] = ps
        _next_id += 1
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Release a registered set; False for the global set or a set not registered."""
    with _lock:
        if not isinstance(process_set, ProcessSet) or process_set.process_set_id in (None, 0):
            return False
        if _registered.pop(process_set.process_set_id, None) is None:
            return False
        group, process_set._group = process_set._group, None
        process_set.process_set_id = None
    if group is not None and group.size != _engine.size():
        _engine.job().reducer().destroy_group(group)
    return True


def register_initial(process_sets: Any) -> None:
    """``hvd.init(process_sets=...)``: a list of ProcessSet (or rank lists) to register."""
    if process_sets == "dynamic":  # Horovod's flag for dynamic registration: always on here
        return
    for ps in process_sets:
        add_process_set(ps)


def group_of(process_set: Any) -> Any:
    """The engine group of ``process_set`` (None: the whole job)."""
    if process_set is None or process_set is global_process_set:
        return None
    if not isinstance(process_set, ProcessSet):
        raise ConfigError(f"`process_set` must be hvd.global_process_set or a ProcessSet. "
                          f"Received: process_set={process_set!r}")
    if process_set.process_set_id is None or process_set._group is None:
        raise ConfigError(f"`process_set` is not registered: pass it to hvd.init(process_sets=...) or "
                          f"hvd.add_process_set() first. Received: process_set={process_set!r}")
    if not process_set.included():
        raise ConfigError(f"`process_set` must include this rank ({_engine.rank()}): only its members run its "
                          f"collectives. Received: process_set={process_set!r}")
    return process_set._group


def forget_all() -> None:
    """At shutdown: registered sets end with the job."""
    with _lock:
        for ps in _registered.values():
            ps.process_set_id, ps._group = None, None
        _registered.clear()


def find(process_set_id: int) -> ProcessSet | None:
    """The registered set with ``process_set_id`` (0: the whole job), or None."""
    if process_set_id == 0:
        return global_process_set
    with _lock:
        return _registered.get(process_set_id)


def init(comm: Any = None, process_sets: Any = None) -> None:
    """``hvd.init``: find this process's place in the job (:func:`job.init`) and register
    ``process_sets`` (ProcessSets or lists of ranks) at once, as ``add_process_set``
    does; ``"dynamic"`` (Horovod's flag for sets added later) is accepted, sets can
    always be added later here."""
    _engine.init(comm)
    if process_sets is not None:
        register_initial(process_sets)
