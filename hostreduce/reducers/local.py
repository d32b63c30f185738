"""The world-size-1 reducer: every collective is the identity, with the same checks
and result semantics (copies, ``out=``, integer mean) as the multi-process engines."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError
from .base import Handle, ReduceOp, Reducer, check_array, register_reducer


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

    def allreduce_async(self, name: str, array: np.ndarray, op: ReduceOp | str = ReduceOp.SUM,
                        out: np.ndarray | None = None) -> Handle:
        self._check_open()
        arr = check_array(name, array)
        ReduceOp.parse(op)
        if out is None:
            return self._done(name, arr.copy())
        if out.shape != arr.shape or out.dtype != arr.dtype:
            raise ConfigError(
                f"Tensor {name!r}: `out` must have shape {arr.shape} and dtype {arr.dtype}. "
                f"Received: shape={out.shape}, dtype={out.dtype}"
            )
        if out is not arr:
            np.copyto(out, arr)
        return self._done(name, out)

    def broadcast_async(self, name: str, array: np.ndarray, root: int = 0) -> Handle:
        self._check_open()
        self._check_root(root)
        return self._done(name, check_array(name, array).copy())

    def allgather_async(self, name: str, array: np.ndarray) -> Handle:
        self._check_open()
        arr = check_array(name, array)
        return self._done(name, arr.reshape((-1,) + arr.shape[1:]).copy() if arr.ndim else arr.reshape(1).copy())

    def barrier(self, timeout: float | None = None) -> None:
        self._check_open()

    def _close(self) -> None:
        pass
