"""Horovod's ``reducescatter`` and ``alltoall``, and the collectives of a process set
other than the whole job, as host ops (:func:`hostreduce.streaming.host_collective`).

Each runs one engine collective on the host when its input exists, eagerly or inside
``tf.function``; outputs whose first dimension depends on the other ranks have an
unknown first dimension in the graph.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError
from ..streaming.host_collective import host_collective, in_order
from . import job as _engine
from .gradients import differentiable
from .tf_errors import checked, tf_errors
from .compression import Compression
from .arguments import check_compression, kind_of, resolve_op, scale
from .process_sets import global_process_set, group_of

__all__ = ["on_host", "reducescatter", "grouped_reducescatter", "alltoall", "group_allreduce", "group_allgather",
           "group_broadcast"]


def on_host(label: str, run: Any, inputs: list[Any], dtypes: list[Any], shapes: list[Any]) -> list[Any]:
    """``run(reducer, arrays) -> arrays`` as one host op on the job's engine (every
    face's collectives that are not gradient reductions go through here)."""
    outs, status = host_collective(_engine.channel(), label, run, inputs, dtypes, shapes, statuses=True)
    return checked(outs, status, label)


def _size_of(group: Any) -> int:
    return _engine.size() if group is None else group.size


@tf_errors
def reducescatter(tensor: Any, device_dense: str = "", compression: Any = Compression.none, op: Any = None,
                  name: str | None = None, process_set: Any = global_process_set, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
    """Reduce ``tensor`` over the set and give each rank its part of axis 0 (the first
    ranks one row more when it does not divide), as Horovod's ``reducescatter``.
    ``op``: Average (default), Sum, Min, Max or Product."""
    import tensorflow as tf


    group = group_of(process_set)
    check_compression(compression)
    rop = resolve_op(op)
    full = _engine.collective_name(kind_of("reducescatter", process_set), name)
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        raise ConfigError(f"`tensor` must have at least one dimension to be scattered. Received: shape={tensor.shape}")

    def forward(x: Any) -> Any:
        wire, ctx = compression.compress(scale(x, prescale_factor, "prescale_factor"))
        out = on_host(f"reducescatter {full}",
                      lambda r, a: [r.reduce_scatter(full, a[0], rop.engine_op, group=group).copy()
                                    .reshape((-1,) + a[0].shape[1:])],
                      [wire], [wire.dtype], [tf.TensorShape([None]).concatenate(x.shape[1:])])[0]
        return scale(compression.decompress(out, ctx), postscale_factor, "postscale_factor")

    def backward(x: Any, upstream: Any) -> Any:
        factor = (_size_of(group) if rop.name == "Sum" else 1) * prescale_factor * postscale_factor
        scaled = upstream * tf.cast(factor, upstream.dtype) if factor != 1 else upstream
        return group_allgather(scaled, _engine.collective_name(kind_of("allgather", process_set), None), process_set)

    return differentiable(tensor, forward, backward)


@tf_errors
def grouped_reducescatter(tensors: Any, device_dense: str = "", compression: Any = Compression.none, op: Any = None,
                          process_set: Any = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[Any]:
    """:func:`reducescatter` of each tensor, in order."""
    base = _engine.collective_name(kind_of("grouped_reducescatter", process_set), None)
    with in_order():
        return [reducescatter(t, compression=compression, op=op, name=f"{base}/{i}", process_set=process_set,
                              prescale_factor=prescale_factor, postscale_factor=postscale_factor)
                for i, t in enumerate(tensors)]


@tf_errors
def alltoall(tensor: Any, splits: Any = None, name: str | None = None, ignore_name_scope: bool = False,
             process_set: Any = global_process_set) -> Any:
    """Send rows ``splits[j]`` of ``tensor`` (in order along axis 0) to rank j of the set
    and concatenate what every rank sent here, in rank order. Without ``splits`` the
    first dimension is split equally. Returns the tensor, and with ``splits`` also the
    received splits, as Horovod."""
    import tensorflow as tf

    group = group_of(process_set)
    full = _engine.collective_name(kind_of("alltoall", process_set), name)
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        raise ConfigError(f"`tensor` must have at least one dimension. Received: shape={tensor.shape}")
    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:])
    size = _size_of(group)

    def run(r: Any, a: list[np.ndarray]) -> list[np.ndarray]:
        sent = None if len(a) == 1 else [int(s) for s in a[1].reshape(-1)]
        received, counts = r.alltoall(full, a[0], sent, group=group)
        return [received, np.asarray(counts, np.int32)]

    def exchange_rows(x: Any, sent: Any) -> tuple[Any, Any]:
        inputs = [x] if sent is None else [x, sent]
        out, received = on_host(f"alltoall {full}", run, inputs, [x.dtype, tf.int32], [shape, tf.TensorShape([size])])
        return out, received

    splits_t = None if splits is None else tf.cast(tf.convert_to_tensor(splits), tf.int32)
    received_splits: list[Any] = []

    def forward(x: Any) -> Any:
        out, received = exchange_rows(x, splits_t)
        received_splits.append(received)
        return out

    def backward(x: Any, upstream: Any) -> Any:
        return alltoall(upstream, splits=received_splits[0], process_set=process_set)[0]

    out = differentiable(tensor, forward, backward)
    if splits is None:
        return out
    return out, received_splits[0]


def group_allreduce(tensor: Any, rop: Any, name: str, process_set: Any) -> Any:
    """All-reduce on a process set other than the whole job."""
    import tensorflow as tf

    group = group_of(process_set)
    tensor = tf.convert_to_tensor(tensor)
    return on_host(f"allreduce {name}", lambda r, a: [r.allreduce(name, a[0], rop.engine_op,
                                                                                  group=group)],
                           [tensor], [tensor.dtype], [tensor.shape])[0]


def group_allgather(tensor: Any, name: str, process_set: Any) -> Any:
    import tensorflow as tf

    group = group_of(process_set)
    tensor = tf.convert_to_tensor(tensor)
    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:]) if tensor.shape.rank else tf.TensorShape([None])
    return on_host(f"allgather {name}", lambda r, a: [r.allgather(name, a[0], group=group)],
                           [tensor], [tensor.dtype], [shape])[0]


def group_broadcast(tensor: Any, root_rank: int, name: str, process_set: Any) -> Any:
    """Broadcast within a set; ``root_rank`` is a rank of the set."""
    import tensorflow as tf

    group = group_of(process_set)
    tensor = tf.convert_to_tensor(tensor)
    return on_host(f"broadcast {name}",
                           lambda r, a: [r.broadcast(name, a[0], root=root_rank, group=group)],
                           [tensor], [tensor.dtype], [tensor.shape])[0]
