"""The world-size-1 reducer: every collective is the identity, with the same checks
and result semantics (copies, ``out=``, integer mean, the one-rank group) as the
multi-process engines."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError
from .base import Group, Handle, ReduceOp, Reducer
from .registry import register_reducer


@register_reducer("local")
class LocalReducer(Reducer):
    def __init__(self, cluster: Any = None, config: Any = None) -> None:
        super().__init__(compression=getattr(config, "compression", "none"))
        if cluster is not None and getattr(cluster, "size", 1) != 1:
            raise ConfigError(
                f"The 'local' reducer runs a single process. Received: cluster size={cluster.size}"
            )

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    def _done(self, name: str, value: Any) -> Handle:
        handle = Handle(name)
        handle.set_result(value)
        return handle

    def _allreduce_async(self, name: str, arr: np.ndarray, op: ReduceOp, out: np.ndarray | None,
                         group: Group) -> Handle:
        if out is None:
            return self._done(name, arr.copy())
        if out is not arr:
            np.copyto(out, arr)
        return self._done(name, out)

    def _broadcast_async(self, name: str, arr: np.ndarray, root: int, group: Group) -> Handle:
        return self._done(name, arr.copy())

    def _allgather_async(self, name: str, arr: np.ndarray, group: Group) -> Handle:
        return self._done(name, arr.copy())

    def _reduce_scatter_async(self, name: str, arr: np.ndarray, op: ReduceOp, counts: list[int],
                              group: Group) -> Handle:
        return self._done(name, arr.copy())

    def _reduce_async(self, name: str, arr: np.ndarray, op: ReduceOp, root: int, group: Group) -> Handle:
        return self._done(name, arr.copy())

    def _alltoall_async(self, name: str, arr: np.ndarray, splits: list[int], group: Group) -> Handle:
        return self._done(name, (arr.copy(), np.array(splits, np.int32)))

    def _barrier(self, timeout: float | None, group: Group) -> None:
        pass

    def _close(self) -> None:
        pass
