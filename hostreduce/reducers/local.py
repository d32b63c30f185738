"""The world-size-1 reducer: every collective is the identity, with the same checks
and result semantics (copies, ``out=``, integer mean) as the multi-process engines."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError
from .base import Handle, ReduceOp, Reducer, register_reducer


@register_reducer("local")
class LocalReducer(Reducer):
    def __init__(self, cluster: Any = None, config: Any = None) -> None:
        super().__init__()
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

    def _done(self, name: str, value: np.ndarray) -> Handle:
        handle = Handle(name)
        handle.set_result(value)
        return handle

    def _allreduce_async(self, name: str, arr: np.ndarray, op: ReduceOp, out: np.ndarray | None) -> Handle:
        if out is None:
            return self._done(name, arr.copy())
        if out is not arr:
            np.copyto(out, arr)
        return self._done(name, out)

    def _broadcast_async(self, name: str, arr: np.ndarray, root: int) -> Handle:
        return self._done(name, arr.copy())

    def _allgather_async(self, name: str, arr: np.ndarray) -> Handle:
        return self._done(name, arr.copy())

    def _barrier(self, timeout: float | None) -> None:
        pass

    def _close(self) -> None:
        pass
