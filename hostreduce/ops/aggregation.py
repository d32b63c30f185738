"""Gradient reduction shared by ``DistributedGradientTape`` and the ``DistributedOptimizer``
wrappers (Keras and TensorFlow 1): sources kept local to a worker, process sets, and
local aggregation over ``backward_passes_per_step`` backward passes, as Horovod has them.

:func:`reduce_some` reduces the gradients of every variable not registered as local
(the gradients of local ones are only divided by the set's size, when
``scale_local_gradients``), over the whole job or over a process set (ranks outside
the set keep their own gradients, as in Horovod).

:class:`LocalAggregation` adds each pass's gradients into a variable per gradient and
reduces the sums once every ``backward_passes_per_step`` passes (divided by that number
with ``average_aggregated_gradients``); the owner applies an update only on those
passes. The reduction sits in a ``tf.cond`` branch; its collectives are named in the
enclosing function, so every rank gives them the same names whatever the branch's
graph is called. Importing this module imports TensorFlow.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import tensorflow as tf

from ..errors import ConfigError
from ..streaming.host_collective import in_order
from . import job as _engine
from .arguments import Average, ReduceOp
from .process_sets import global_process_set
from .tensors import allreduce, reduce_tensors

__all__ = ["ReduceSpec", "SourceKey", "source_key", "label_of", "reduce_some", "LocalAggregation", "check_passes",
           "layers_list"]


class SourceKey:
    """A hashable key for a variable that compares by identity (``v.ref()`` where the
    variable has it; Keras 3 variables do not). It holds the variable, so the key of a
    variable still in use is never another's."""

    __slots__ = ("source",)

    def __init__(self, source: Any) -> None:
        self.source = source

    def __hash__(self) -> int:
        return id(self.source)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SourceKey) and other.source is self.source


def source_key(source: Any) -> Any:
    ref = getattr(source, "ref", None)
    return ref() if callable(ref) else SourceKey(source)


def label_of(source: Any, index: int) -> str:
    return str(getattr(source, "path", None) or getattr(source, "name", None) or f"source{index}")


def layers_list(local_layers: Any) -> list[Any]:
    """``local_layers`` (None, a Keras layer of any loaded Keras, or a list of them) as a list."""
    from ..host.kerases import loaded_kerases

    def is_layer(value: Any) -> bool:
        return any(isinstance(value, k.layers.Layer) for k in loaded_kerases())

    if local_layers is None:
        return []
    if is_layer(local_layers):
        return [local_layers]
    layers = list(local_layers) if isinstance(local_layers, (list, tuple, set)) else None
    if layers is None or not all(is_layer(layer) for layer in layers):
        raise ConfigError("`local_layers` must be a Keras layer or a list of Keras layers. "
                          f"Received: local_layers={local_layers!r}")
    return layers


def check_passes(backward_passes_per_step: Any) -> int:
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ConfigError("`backward_passes_per_step` must be an integer >= 1. "
                          f"Received: backward_passes_per_step={backward_passes_per_step!r}")
    return backward_passes_per_step


@dataclasses.dataclass
class ReduceSpec:
    """How a tape or an optimizer wrapper reduces its gradients."""

    op: ReduceOp = Average
    compression: Any = None
    sparse_as_dense: bool = False
    predivide: float = 1.0
    process_set: Any = global_process_set
    scale_local_gradients: bool = True
    local: set = dataclasses.field(default_factory=set)

    def register_local(self, source: Any) -> None:
        self.local.add(source_key(source))

    def is_local(self, source: Any) -> bool:
        return bool(self.local) and source_key(source) in self.local


def _dense(grad: Any) -> Any:
    return tf.convert_to_tensor(grad) if isinstance(grad, tf.IndexedSlices) else grad


def reduce_some(spec: ReduceSpec, grads: Sequence[Any], sources: Sequence[Any], name: str | None = None) -> list[Any]:
    """``grads`` (one per source; None passes through) with every non-local one reduced
    as ``spec`` says. ``name``: the base of the collectives' names (default: derived
    where this is called)."""
    grads = list(grads)
    if spec.sparse_as_dense:
        grads = [_dense(g) for g in grads]
    todo = [i for i, (s, g) in enumerate(zip(sources, grads)) if g is not None and not spec.is_local(s)]
    out = list(grads)
    process_set = spec.process_set if spec.process_set is not None else global_process_set
    on_set = process_set is not global_process_set
    group_size = process_set.size() if on_set else _engine.size()
    if on_set and not process_set.included():
        return out  # as Horovod: a rank outside the set keeps its own gradients
    pre, post = (1.0 / spec.predivide, spec.predivide) if spec.predivide != 1.0 else (1.0, 1.0)
    if todo and group_size > 1:
        base = name or _engine.collective_name("gradients", None)
        if on_set:
            with in_order():
                for i in todo:
                    out[i] = allreduce(grads[i], compression=spec.compression, op=spec.op, prescale_factor=pre,
                                       postscale_factor=post, name=f"{base}/{i}", process_set=process_set)
        else:
            reduced = reduce_tensors([grads[i] for i in todo], spec.op, [f"{base}/{i}" for i in todo],
                                     labels=[label_of(sources[i], i) for i in todo], compression=spec.compression,
                                     prescale_factor=pre, postscale_factor=post)
            for i, g in zip(todo, reduced):
                out[i] = g
    if spec.scale_local_gradients and spec.local:
        for i, (s, g) in enumerate(zip(sources, out)):
            if g is None or not spec.is_local(s):
                continue
            if isinstance(g, tf.IndexedSlices):
                out[i] = tf.IndexedSlices(g.values / tf.cast(group_size, g.values.dtype), g.indices, g.dense_shape)
            else:
                out[i] = g / tf.cast(group_size, g.dtype)
    return out


class LocalAggregation:
    """Sums gradients over ``backward_passes_per_step`` passes and reduces the sums once
    per that many passes (Horovod's ``LocalGradientAggregationHelper``).

    ``counter`` (a ``tf.Variable``) counts the passes since the last reduction: after
    :meth:`compute_gradients` it is 0 on a pass that reduced, so the owner applies an
    update when it is 0 (:meth:`apply_gradients`). Gradients are summed densely (a
    ``tf.IndexedSlices`` one is made dense first).
    """

    def __init__(self, backward_passes_per_step: int, average_aggregated_gradients: bool, spec: ReduceSpec,
                 name: str = "aggregation") -> None:
        self.backward_passes_per_step = check_passes(backward_passes_per_step)
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        self.spec = spec
        self._name = name
        self._sums: dict[int, Any] = {}
        with tf.init_scope():
            self.counter = self._variable(tf.zeros([], tf.int32), "counter")

    def register_local_var(self, var: Any) -> None:
        self.spec.register_local(var)

    def _variable(self, initial: Any, suffix: str) -> Any:
        # In a TensorFlow 1 graph this is a global variable: global_variables_initializer() sets it.
        return tf.Variable(initial, trainable=False, name=f"{self._name}_{suffix}")

    def _sum_variable(self, index: int, grad: Any, source: Any) -> Any:
        variable = self._sums.get(index)
        if variable is None:
            shape = getattr(source, "shape", None)
            if shape is None or not tf.TensorShape(shape).is_fully_defined():
                shape = grad.shape
            with tf.init_scope():
                variable = self._sums[index] = self._variable(tf.zeros(shape, grad.dtype), f"sum{index}")
        return variable

    def compute_gradients(self, grads: Sequence[Any], sources: Sequence[Any]) -> list[Any]:
        """This pass's gradients added to the sums; on every ``backward_passes_per_step``-th
        pass the sums reduced over the job (and the sums and ``counter`` reset), on the
        others the local sums. None gradients stay None."""
        grads = [_dense(g) for g in grads]
        summed: list[Any] = []
        updates = []
        for i, (g, s) in enumerate(zip(grads, sources)):
            if g is None:
                summed.append(None)
                continue
            variable = self._sum_variable(i, g, s)
            updates.append(variable.assign_add(g, read_value=False))
            summed.append(None)
        with tf.control_dependencies(updates):
            summed = [None if g is None else self._sums[i].read_value() for i, g in enumerate(grads)]
            count = self.counter.assign_add(1)
        # Named here, in the enclosing function: the cond branch's graph name is not
        # the same on every rank.
        name = _engine.collective_name("gradients", None)
        passes = self.backward_passes_per_step

        def reduce_and_reset() -> list[Any]:
            reduced = reduce_some(self.spec, summed, sources, name=name)
            if self.average_aggregated_gradients:
                reduced = [None if g is None else g / tf.cast(passes, g.dtype) for g in reduced]
            reduced = [None if g is None else tf.identity(g) for g in reduced]
            with tf.control_dependencies([g for g in reduced if g is not None]):
                resets = [v.assign(tf.zeros_like(v), read_value=False) for v in self._sums.values()]
                resets.append(self.counter.assign(0, read_value=False))
            with tf.control_dependencies(resets):
                return [None if g is None else tf.identity(g) for g in reduced]

        def keep() -> list[Any]:
            return [None if g is None else tf.identity(g) for g in summed]

        present = [i for i, g in enumerate(summed) if g is not None]
        if not present:
            return list(summed)
        def only_present(branch: Callable[[], list[Any]]) -> Callable[[], list[Any]]:
            def run() -> list[Any]:
                values = branch()  # once: each call makes its own collectives
                return [values[i] for i in present]
            return run

        result = tf.cond(tf.equal(count, passes), only_present(reduce_and_reset), only_present(keep))
        result = tf.nest.flatten(result)
        out: list[Any] = [None] * len(summed)
        for i, g in zip(present, result):
            out[i] = g
        return out

    def apply_gradients(self, apply: Callable[[], Any], skip: Callable[[], Any], after: Sequence[Any] = ()) -> Any:
        """``apply()`` on a pass that reduced (``counter`` is 0), else ``skip()``; both must
        return a tensor or an op of the same structure (or None)."""
        with tf.control_dependencies([a for a in after if a is not None]):
            pred = tf.equal(self.counter.read_value(), 0)

        def run(fn: Callable[[], Any]) -> Callable[[], Any]:
            def branch() -> Any:
                # Returned through a dependency: a TensorFlow 1 cond runs only what its
                # branch returns.
                done = [t for t in tf.nest.flatten(fn()) if isinstance(t, (tf.Tensor, tf.Operation))]
                with tf.control_dependencies(done):
                    return tf.constant(True)
            return branch

        return tf.cond(pred, run(apply), run(skip))
