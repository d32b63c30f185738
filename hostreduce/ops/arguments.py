"""What every face's collectives share: reduction constants (``Average``, ``Sum``, ...)
and their mapping to engine ops, the checks of ``op``/``average``, ``compression`` and
``process_set`` arguments, names of collectives on a process set, and scaling."""
from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .process_sets import ProcessSet, global_process_set, group_of

__all__ = ["ReduceOp", "Average", "Sum", "Min", "Max", "Adasum", "Product", "resolve_op", "check_gradient_args",
           "kind_of", "on_set", "check_compression", "tf_tensor", "scale"]


class ReduceOp:
    """A reduction constant (``hvd.Average``, ``hvd.Sum``, ...)."""

    __slots__ = ("name", "engine_op")

    def __init__(self, name: str, engine_op: str | None) -> None:
        self.name = name
        self.engine_op = engine_op

    def __repr__(self) -> str:
        return self.name


Average = ReduceOp("Average", "mean")
Sum = ReduceOp("Sum", "sum")
Min = ReduceOp("Min", "min")
Max = ReduceOp("Max", "max")
Adasum = ReduceOp("Adasum", None)
Product = ReduceOp("Product", "prod")


def kind_of(kind: str, process_set: Any) -> str:
    """A collective's kind for naming, with its process set's ranks."""
    if process_set is None or process_set is global_process_set or not isinstance(process_set, ProcessSet):
        return kind
    return f"{kind}@{','.join(map(str, process_set.ranks or ()))}"


def on_set(process_set: Any) -> bool:
    """Whether ``process_set`` is a set other than the whole job (checked: registered,
    and this rank a member)."""
    group_of(process_set)
    return process_set is not None and process_set is not global_process_set


def resolve_op(op: Any, average: Any = None) -> ReduceOp:
    """Horovod's ``op``/``average`` pair as a supported :class:`ReduceOp`."""
    if average is not None:
        if op is not None:
            raise ConfigError(f"`average` and `op` cannot both be given. Received: average={average!r}, op={op!r}")
        op = Average if average else Sum
    if op is None:
        op = Average
    if not isinstance(op, ReduceOp):
        raise ConfigError(f"`op` must be one of hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product. "
                          f"Received: op={op!r}")
    if op.engine_op is None:
        raise ConfigError(
            f"`op={op!r}` is not supported by hostreduce.horovod; use Average, Sum, Min, Max or Product. "
            f"Received: op={op!r}"
        )
    return op


def check_compression(compression: Any) -> None:
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise ConfigError(
            "`compression` must be Compression.none, Compression.fp16, Compression.bf16 or an object with "
            f"compress() and decompress(). Received: compression={compression!r}"
        )


def check_gradient_args(op: Any, compression: Any, gradient_predivide_factor: Any, groups: Any,
                        process_set: Any) -> ReduceOp:
    """The checks every gradient-reducing wrapper (tapes, optimizers) makes of the
    arguments they share; returns ``op`` resolved."""
    rop = resolve_op(op)
    check_compression(compression)
    if gradient_predivide_factor != 1.0 and rop is not Average:
        raise ConfigError("`gradient_predivide_factor` needs op=Average. "
                          f"Received: gradient_predivide_factor={gradient_predivide_factor!r}, op={rop!r}")
    if groups is not None and not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ConfigError("`groups` must be a positive integer or a list of lists of variables. "
                          f"Received: groups={groups!r}")
    if process_set is not None and not isinstance(process_set, ProcessSet):
        raise ConfigError(f"`process_set` must be a hvd.ProcessSet. Received: process_set={process_set!r}")
    return rop


def tf_tensor(value: Any) -> Any:
    import tensorflow as tf

    return tf.convert_to_tensor(value)


def scale(tensor: Any, factor: Any, argument: str) -> Any:
    """``tensor * factor``, as Horovod scales: integers in float64 and truncated back,
    16-bit floats in float32 and rounded back, other floats in their own dtype."""
    import tensorflow as tf

    if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor == 1:
        return tensor
    dtype = tensor.dtype
    if dtype == tf.bool or not (dtype.is_floating or dtype.is_integer):
        raise ConfigError(f"`{argument}` needs a numeric tensor. Received: {argument}={factor!r} "
                          f"for a tensor of dtype {dtype.name}")
    wide = tf.float64 if dtype.is_integer else tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype
    if wide == dtype:
        return tensor * tf.cast(factor, dtype)
    return tf.cast(tf.cast(tensor, wide) * tf.cast(factor, wide), dtype)
