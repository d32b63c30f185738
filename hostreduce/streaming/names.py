"""Names of the collectives a script did not name, equal on every rank.

The ring matches collectives by name, and ordered engines take them in one order, so a
collective the script did not name gets one that every rank derives alike: every rank
runs the same program, so the n-th unnamed collective of a kind created while tracing
function F (or the n-th one run eagerly) is the same collective everywhere. Counting per
traced graph, not per process, keeps names equal when one rank retraces a function that
another did not; counting per kind keeps them equal when ranks run different collectives
on different groups (which name their group in the kind).
"""
from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

__all__ = ["CollectiveNames"]


class CollectiveNames:
    """``next(kind)``: ``<prefix>.eager.<kind>.<n>`` eagerly, ``<prefix>.<graph>.<kind>.<n>``
    in a graph (a traced function by its name, a TF1 graph by the order this process first
    named a collective in it, which every rank shares)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self._eager: dict[str, int] = {}
        self._graphs: "weakref.WeakKeyDictionary[Any, dict[str, int]]" = weakref.WeakKeyDictionary()
        self._numbers: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
        self._counter = itertools.count(1)

    def next(self, kind: str) -> str:
        import tensorflow as tf

        with self._lock:
            if tf.executing_eagerly():
                count = self._eager[kind] = self._eager.get(kind, 0) + 1
                return f"{self.prefix}.eager.{kind}.{count}"
            graph = tf.compat.v1.get_default_graph()
            counts = self._graphs.setdefault(graph, {})
            count = counts[kind] = counts.get(kind, 0) + 1
            return f"{self.prefix}.{self._graph_name(graph)}.{kind}.{count}"

    def eager_counts(self) -> dict[str, int]:
        """How many unnamed collectives of each kind ran eagerly."""
        with self._lock:
            return dict(self._eager)

    def advance_eager_counts(self, counts: dict[str, int]) -> None:
        """Raise each kind's eager count to at least ``counts``'s (after a join, where the
        ranks that had not joined ran collectives that the joined ones did not)."""
        with self._lock:
            for kind, count in counts.items():
                self._eager[kind] = max(self._eager.get(kind, 0), int(count))

    def reset_eager_counts(self) -> None:
        """Start eager counting again (a new job: after ``shutdown()`` every rank of the
        next job, new ones included, counts from zero)."""
        with self._lock:
            self._eager.clear()

    def _graph_name(self, graph: Any) -> str:
        name = getattr(graph, "name", None)
        if isinstance(name, str) and name:
            return name
        number = self._numbers.get(graph)
        if number is None:
            number = self._numbers[graph] = next(self._counter)
        return f"graph{number}"
