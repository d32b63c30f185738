"""One ps task's part of the model: its variables (whole or its rows), their optimizer
slots beside them, and the applies, each variable under its own lock so that pulls and
pushes of different variables run at once (numpy releases the GIL in the kernels).

A push is checked whole (:meth:`ShardStore.check_push`) before any of it is applied
(:meth:`ShardStore.apply`): a worker's message is trusted only as far as its sender
authenticated, and a bad part found halfway through an apply would leave the shard
half-updated. After the check nothing in an apply can fail on the push's content.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ..errors import ConfigError, NonFiniteGradientError, TensorMismatchError
from .optimizers import HostOptimizer, from_config
from .placement import Placement
from .rows import check_ids, sum_duplicates

__all__ = ["ShardStore", "ITERATIONS", "Contribution"]

# name -> dense gradient, and name -> (row ids, gradient rows): one push, or a sync step's sum
Contribution = tuple[dict[str, np.ndarray], dict[str, tuple[np.ndarray, np.ndarray]]]

ITERATIONS = "@iterations"  # a variable's apply count, saved beside its slots


@dataclass
class _Var:
    value: np.ndarray
    slots: dict[str, np.ndarray]
    iterations: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class ShardStore:
    def __init__(self, ps_index: int) -> None:
        self.index = ps_index
        self.placement: Placement | None = None
        self.optimizer: HostOptimizer | None = None
        self.optimizer_config: dict = {}
        self.vars: dict[str, _Var] = {}
        self.step = 0                      # the last step applied (sync mode)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ set-up
    def register(self, placement: Placement, optimizer_config: dict, values: Mapping[str, np.ndarray]) -> bool:
        """Hold this ps's part of ``placement``; False (and nothing changes) if it already
        does with the same variables and optimizer, as when a restarted chief registers again."""
        with self._lock:
            if self.placement is not None:
                if placement.to_json() != self.placement.to_json() or optimizer_config != self.optimizer_config:
                    raise TensorMismatchError(
                        f"ps task {self.index}: variables or optimizer differ from those registered first "
                        f"(registered {len(self.placement.specs)} variables, optimizer {self.optimizer_config}; "
                        f"received {len(placement.specs)} variables, optimizer {optimizer_config})")
                return False
            optimizer = from_config(optimizer_config)
            out = {}
            for name in placement.on(self.index):
                p = placement[name]
                shape = p.local_shape(self.index)
                if name not in values:
                    raise ConfigError(f"ps task {self.index}: no initial value for {name!r}")
                value = np.array(values[name], dtype=p.spec.dtype)  # a copy: the message is read-only
                if value.shape != shape:
                    raise TensorMismatchError(f"ps task {self.index}: initial value of {name!r} must have shape "
                                              f"{shape}. Received: shape={value.shape}")
                out[name] = _Var(value, optimizer.init_slots(value))
            self.placement, self.optimizer, self.optimizer_config, self.vars = placement, optimizer, dict(optimizer_config), out
            return True

    def _var(self, name: str) -> _Var:
        var = self.vars.get(name)
        if var is None:
            held = "nothing is registered yet" if self.placement is None else f"it holds {sorted(self.vars)[:8]}"
            raise ConfigError(f"ps task {self.index} holds no variable {name!r} ({held})")
        return var

    # ------------------------------------------------------------------ pulls
    def pull(self, names: Sequence[str]) -> list[np.ndarray]:
        out = []
        for name in names:
            var = self._var(name)
            with var.lock:
                out.append(var.value.copy())
        return out

    def pull_rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        var = self._var(name)
        rows = check_ids(name, rows, var.value.shape[0])
        with var.lock:
            return np.take(var.value, rows, axis=0)  # a copy, several times faster than value[rows]

    # ------------------------------------------------------------------ applies
    def check_push(self, dense: Mapping[str, np.ndarray], rows: Mapping[str, tuple[np.ndarray, np.ndarray]], *,
                   finite: bool = False) -> Contribution:
        """The push, checked whole: every name held here, each dense gradient of exactly
        its variable's shape and dtype (no broadcasting, no cast), row ids a 1-D integer
        array in range with one gradient row of the variable's row shape and dtype each,
        and (``finite``) no NaN or Inf. Raises before anything changed; returns the push
        with its ids as int64."""
        for name, grad in dense.items():
            value = self._var(name).value
            if grad.shape != value.shape or grad.dtype != value.dtype:
                raise TensorMismatchError(
                    f"gradient of {name!r} must have shape {value.shape} and dtype {value.dtype.name} on ps task "
                    f"{self.index}. Received: shape={grad.shape}, dtype={grad.dtype.name}")
        out_rows = {}
        for name, (ids, grads) in rows.items():
            value = self._var(name).value
            if value.ndim == 0:
                raise TensorMismatchError(f"gradient rows of {name!r}: the variable is a scalar, it has no rows")
            ids = check_ids(name, ids, value.shape[0])
            if grads.shape != ids.shape + value.shape[1:] or grads.dtype != value.dtype:
                raise TensorMismatchError(
                    f"gradient rows of {name!r} must have shape ({len(ids)},) + {value.shape[1:]} (one row per id) and "
                    f"dtype {value.dtype.name} on ps task {self.index}. Received: shape={grads.shape}, "
                    f"dtype={grads.dtype.name}")
            out_rows[name] = (ids, grads)
        if finite:
            for name, grad in list(dense.items()) + [(n, g) for n, (_, g) in out_rows.items()]:
                if not np.isfinite(grad).all():
                    raise NonFiniteGradientError(
                        f"the gradient of {name!r} pushed to ps task {self.index} holds NaN or Inf, and this ps "
                        "refuses them (nonfinite='refuse'). Received: "
                        f"{int(np.isnan(grad).sum())} NaN, {int(np.isinf(grad).sum())} Inf")
        return dict(dense), out_rows

    def apply(self, part: Contribution) -> None:
        """Apply a push (or a sync step's sum) that :meth:`check_push` accepted."""
        dense, rows = part
        optimizer = self.optimizer
        for name, grad in dense.items():
            var = self.vars[name]
            with var.lock:
                var.iterations += 1
                optimizer.apply_dense(var.value, var.slots, grad, var.iterations)  # type: ignore[union-attr]
        for name, (ids, grads) in rows.items():
            var = self.vars[name]
            ids, grads = sum_duplicates(ids, grads)
            with var.lock:
                var.iterations += 1
                optimizer.apply_rows(var.value, var.slots, ids, grads, var.iterations)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ checkpoints
    def snapshot(self) -> dict[str, np.ndarray]:
        """Every array of this shard, taken with every variable locked at once (one moment)."""
        locks = [v.lock for v in self.vars.values()]
        for lock in locks:
            lock.acquire()
        try:
            out: dict[str, np.ndarray] = {}
            for name, var in self.vars.items():
                out[name] = var.value.copy()
                out.update({f"{name}/{s}": a.copy() for s, a in var.slots.items()})
                out[f"{name}/{ITERATIONS}"] = np.array(var.iterations, dtype=np.int64)
            return out
        finally:
            for lock in locks:
                lock.release()

    def load(self, arrays: Mapping[str, np.ndarray], step: int) -> None:
        """Replace every value, slot and count with ``arrays`` (this shard's part of a checkpoint)."""
        with self._lock:
            for name, var in self.vars.items():
                with var.lock:
                    var.value[...] = arrays[name]
                    for s in var.slots:
                        var.slots[s][...] = arrays[f"{name}/{s}"]
                    var.iterations = int(arrays[f"{name}/{ITERATIONS}"])
            self.step = step
