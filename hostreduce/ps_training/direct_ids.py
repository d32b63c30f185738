"""The lookup ids of a training step read straight from the batch, when the model looks
up a feature as it is (``Embedding(...)(features["ids"])``, the usual case).

Before each step a worker needs the global ids the step will look up (the rows to
pull). The general way is a second traced function that runs ``model_fn`` up to its
lookups (``PSTrainProgram.ids_function``): about 2 ms a step on the benchmark's
workers, mostly reading every variable and gathering rows that are not needed, as a
``tf.function`` runs every stateful op it holds. When each of its outputs is only
features passed through ``Identity``, ``Reshape``, ``ExpandDims``, ``Squeeze``,
``ConcatV2``, integer widening ``Cast`` and a few elementwise integer ops with scalar
constants (Keras's ``take`` wraps negative ids: ``where(ids < 0, ids + n, ids)``), the
worker computes the ids from the batch with numpy (the same integer arithmetic, so the
same values; their order and shape do not matter, as the worker keeps the distinct ids
only). Any other op on the way (slicing, hashing, float math) keeps the traced function.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["feature_sources", "read_ids"]

_THROUGH = {"Identity", "Reshape", "ExpandDims", "Squeeze"}
_WIDENING = {("int32", "int32"), ("int32", "int64"), ("int64", "int64")}
_ELEMENTWISE = {"AddV2": np.add, "Sub": np.subtract, "Less": np.less, "GreaterEqual": np.greater_equal,
                "SelectV2": np.where, "Select": np.where}
_INTS = ("int32", "int64", "bool")

# A node of the plan: (fn(flat) -> array, the placeholder it is aligned with or None
# for a scalar constant, whether it is that placeholder's elements in their order).
_Node = tuple[Any, Any, bool]


def feature_sources(function: Any, names: list[str]) -> dict[str, Any] | None:
    """For each output ``names`` of the traced ``function``, how to compute it from the
    flattened ``(features, labels)`` with numpy; None unless every output is features
    passed through the ops above (elementwise ops only on one feature's elements and
    scalar constants, as Keras's negative-index wrap of a lookup)."""
    import tensorflow as tf

    concrete = function.get_concrete_function()
    specs = tf.nest.flatten(concrete.structured_input_signature)
    if not all(isinstance(s, tf.TensorSpec) for s in specs):
        return None
    position = {t.name: i for i, t in enumerate(concrete.graph.inputs[:len(specs)])}

    def fold(t: Any, depth: int = 0) -> Any:
        """``t``'s value if it is a constant (TF's folding, plus ``StridedSlice`` and
        ``Cast`` of constants, as Keras takes a table's row count from its shape)."""
        value = tf.get_static_value(t)
        if value is not None or depth > 8 or t.op.type not in ("StridedSlice", "Cast"):
            return value
        args = [fold(x, depth + 1) for x in t.op.inputs]
        if any(a is None for a in args):
            return None
        op = t.op
        if op.type == "Cast":
            return np.asarray(tf.cast(args[0], t.dtype).numpy())
        masks = {k: op.get_attr(k) for k in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
                                              "shrink_axis_mask")}
        return np.asarray(tf.raw_ops.StridedSlice(input=args[0], begin=args[1], end=args[2], strides=args[3],
                                                  **masks).numpy())

    def node(t: Any, depth: int = 0) -> _Node | None:
        op, dtype = t.op, t.dtype.name
        if depth > 32 or dtype not in _INTS:
            return None
        static = fold(t)
        if static is not None and op.type != "Placeholder":
            value = np.asarray(static, dtype=t.dtype.as_numpy_dtype)
            return ((lambda flat, v=value: v), None, True) if value.ndim == 0 else None
        if op.type == "Placeholder":
            p = position.get(t.name)
            return None if p is None or dtype == "bool" else ((lambda flat: np.asarray(flat[p]).reshape(-1)), p, True)
        if op.type in _THROUGH:
            return node(op.inputs[0], depth + 1)
        if op.type == "Cast":
            inner = node(op.inputs[0], depth + 1)
            if inner is None or (op.get_attr("SrcT").name, op.get_attr("DstT").name) not in _WIDENING:
                return None
            np_type = t.dtype.as_numpy_dtype
            return (lambda flat, f=inner[0]: f(flat).astype(np_type, copy=False)), inner[1], inner[2]
        if op.type == "ConcatV2":
            parts = [node(x, depth + 1) for x in op.inputs[:-1]]
            if any(p is None or p[1] is None for p in parts):
                return None
            fns = [p[0] for p in parts]
            return (lambda flat: np.concatenate([f(flat) for f in fns])), parts[0][1], False
        if op.type in _ELEMENTWISE:
            args = [node(x, depth + 1) for x in op.inputs]
            if any(a is None for a in args):
                return None
            sources = {a[1] for a in args if a[1] is not None}
            if len(sources) != 1 or not all(a[2] for a in args):  # one feature's elements, in order
                return None
            fns, ufunc = [a[0] for a in args], _ELEMENTWISE[op.type]
            return (lambda flat: ufunc(*[f(flat) for f in fns])), sources.pop(), True
        return None

    out = {}
    outputs = concrete.structured_outputs
    for name in names:
        found = node(outputs[name]) if name in outputs else None
        if found is None or found[1] is None or outputs[name].dtype.name not in ("int32", "int64"):
            return None
        out[name] = found[0]
    return out


def read_ids(plan: dict[str, Any], flat: list[Any]) -> dict[str, np.ndarray]:
    """The ids of each output, from the flattened batch ``flat`` (int64, flat)."""
    return {name: np.asarray(fn(flat)).reshape(-1).astype(np.int64, copy=False) for name, fn in plan.items()}
