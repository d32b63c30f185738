"""Horovod's collectives (``allreduce``, ``grouped_allreduce``, ``allgather``,
``broadcast``, ``broadcast_variables``) mapped onto :func:`hostreduce.streaming.exchange`.

This module maps names and arguments: reduction constants to engine ops, compression
and scaling to TensorFlow ops around the hand-off, ``tf.IndexedSlices`` to two
all-gathers (values and indices) as Horovod does. Every collective runs on the host
through the job's engine, eagerly or inside ``tf.function``.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..errors import ConfigError, UnsupportedCallError
from ..streaming import Collective, exchange
from ..streaming.autograph import not_converted
from ..streaming.host_collective import in_order
from . import job as _engine
from .gradients import differentiable, differentiable_group
from .tf_errors import checked, tf_errors
from .arguments import (Adasum, Average, Max, Min, Product, ReduceOp, Sum, check_compression, kind_of, on_set, resolve_op,
                        scale, tf_tensor)
from .collectives import group_allgather, group_allreduce, group_broadcast
from .compression import Compression, engine_wire
from .process_sets import ProcessSet, global_process_set

__all__ = ["ReduceOp", "Average", "Sum", "Min", "Max", "Adasum", "Product", "ProcessSet", "global_process_set",
           "allreduce", "grouped_allreduce", "allgather", "broadcast", "broadcast_variables", "reduce_tensors",
           "reduce_gradients"]


@not_converted
def reduce_tensors(tensors: Sequence[Any], op: ReduceOp, names: Sequence[str], *, labels: Sequence[str] | None = None,
                   compression: Any = Compression.none, prescale_factor: Any = 1.0, postscale_factor: Any = 1.0,
                   chained: bool = False, typed: bool = False) -> list[Any]:
    """All-reduce ``tensors`` (dense or ``tf.IndexedSlices``; None passes through) as one
    group: each is handed to the engine as soon as it exists. What the tape and
    ``grouped_allreduce`` share."""
    import tensorflow as tf

    channel = _engine.channel()
    world = _engine.size()
    labels = list(labels) if labels is not None else list(names)
    flat: list[Any] = []
    collectives: list[Collective] = []
    plan: list[tuple[str, Any]] = []
    for tensor, name, label in zip(tensors, names, labels):
        if tensor is None:
            plan.append(("none", None))
        elif isinstance(tensor, tf.IndexedSlices):
            if op is not Average and op is not Sum:
                raise UnsupportedCallError(f"Only Sum and Average are supported with tf.IndexedSlices. Received: op={op!r}")
            if prescale_factor != 1.0 or postscale_factor != 1.0:
                raise UnsupportedCallError("`prescale_factor` and `postscale_factor` are not supported with tf.IndexedSlices. "
                                  f"Received: prescale_factor={prescale_factor!r}, "
                                  f"postscale_factor={postscale_factor!r}")
            plan.append(("sparse", (len(flat), tensor.dense_shape)))
            flat += [tensor.values, tensor.indices]
            collectives += [Collective("allgather", f"{name}.values", label=f"{label} values"),
                            Collective("allgather", f"{name}.indices", label=f"{label} indices")]
        else:
            tensor = tf.convert_to_tensor(tensor)
            scaled = scale(tensor, prescale_factor, "prescale_factor")
            # bf16 off a GPU: the engine casts on the host; the hand-off moves float32.
            on_host = engine_wire(compression, scaled)
            wire, ctx = (scaled, None) if on_host else compression.compress(scaled)
            plan.append(("dense", (len(flat), ctx, on_host)))
            flat.append(wire)
            collectives.append(Collective("allreduce", name, op.engine_op, label=label,  # type: ignore[arg-type]
                                          compression=on_host))
    # A face's collective (typed): ranks that disagree raise tf.errors.FailedPreconditionError in a graph too.
    results = (_typed_exchange(channel, flat, collectives, chained=chained) if typed
               else exchange(channel, flat, collectives, chained=chained))
    out: list[Any] = []
    for kind, info in plan:
        if kind == "none":
            out.append(None)
        elif kind == "sparse":
            at, dense_shape = info
            values, indices = results[at], results[at + 1]
            if op is Average:
                values = values / tf.cast(world, values.dtype)
            out.append(tf.IndexedSlices(values, indices, dense_shape=dense_shape))
        else:
            at, ctx, on_host = info
            done = results[at] if on_host else compression.decompress(results[at], ctx)
            out.append(scale(done, postscale_factor, "postscale_factor"))
    return out


@not_converted
def reduce_gradients(gradients: Sequence[Any], labels: Sequence[str], *, op: ReduceOp, compression: Any,
                     sparse_as_dense: bool, predivide: float = 1.0) -> list[Any]:
    """Gradients reduced over the job, as one group (None passes through): what
    ``DistributedGradientTape`` and the Keras optimizer wrappers share.

    ``sparse_as_dense`` turns ``tf.IndexedSlices`` into dense tensors first (also with
    one worker, as Horovod does); ``predivide`` (with Average) scales by ``1 / predivide``
    before the sum and ``predivide / size()`` after it. With one worker nothing is sent.
    """
    import tensorflow as tf

    grads = list(gradients)
    if sparse_as_dense:
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    if _engine.size() == 1:
        return grads
    pre, post = (1.0 / predivide, predivide) if predivide != 1.0 else (1.0, 1.0)
    base = _engine.collective_name("gradients", None)
    return reduce_tensors(grads, op, [f"{base}/{i}" for i in range(len(grads))], labels=labels,
                          compression=compression, prescale_factor=pre, postscale_factor=post)


@not_converted
def _typed_exchange(channel: Any, tensors: list[Any], collectives: list[Collective], chained: bool = True
                    ) -> list[Any]:
    """:func:`exchange` for a face's collectives: in a graph, ranks that disagree raise
    ``tf.errors.FailedPreconditionError`` (``tf_errors.checked``)."""
    results, statuses = exchange(channel, tensors, collectives, chained=chained, statuses=True)
    if statuses is None:
        return results
    return [checked([r], st, c.display)[0] for r, st, c in zip(results, statuses, collectives)]


def _check_sparse_op(tensor: Any, op: Any) -> None:
    """Horovod reduces a ``tf.IndexedSlices`` by Sum or Average only (also Adasum is
    refused for it as not implemented, before the op itself is checked)."""
    import tensorflow as tf

    if isinstance(tensor, tf.IndexedSlices) and op is not None and op is not Average and op is not Sum:
        raise UnsupportedCallError(f"Only Sum and Average are supported with tf.IndexedSlices. Received: op={op!r}")


@tf_errors
def allreduce(tensor: Any, average: Any = None, device_dense: str = "", device_sparse: str = "",
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None, process_set: Any = global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """All-reduce a ``tf.Tensor``, ``tf.Variable`` or ``tf.IndexedSlices`` over the job.

    Args:
        tensor: the value; its shape and dtype must be equal on every rank. A
            ``tf.IndexedSlices`` is all-gathered (values and indices) instead, as
            Horovod does; ``op`` must then be Average or Sum.
        average: deprecated in Horovod: True is ``op=Average``, False ``op=Sum``.
        device_dense, device_sparse: accepted; hostreduce always reduces in host memory.
        compression: ``Compression.none``, ``Compression.fp16`` or ``Compression.bf16``
            (16 bits on the wire; bf16 cast on the host by the engine, see ``_compression.py``).
        op: ``Average`` (default), ``Sum``, ``Min`` or ``Max``.
        prescale_factor, postscale_factor: multiply before / after the reduction.
        name: the collective's name, equal on every rank; default: derived from the
            position of the call in the traced function (or in eager order).
        process_set: ``hvd.global_process_set`` (the job) or a registered ProcessSet.
        ignore_name_scope: accepted; names never include TensorFlow name scopes.

    Returns:
        A tensor of the input's shape and dtype (a ``tf.IndexedSlices`` for one).
    """
    _engine.job()
    check_compression(compression)
    _check_sparse_op(tensor, op)
    rop = resolve_op(op, average)
    full_name = _engine.collective_name(kind_of("allreduce", process_set), name)

    def forward(x: Any) -> Any:
        if on_set(process_set):
            wire, ctx = compression.compress(scale(tf_tensor(x), prescale_factor, "prescale_factor"))
            return scale(compression.decompress(group_allreduce(wire, rop, full_name, process_set), ctx),
                         postscale_factor, "postscale_factor")
        return reduce_tensors([x], rop, [full_name], compression=compression, prescale_factor=prescale_factor,
                              postscale_factor=postscale_factor, chained=True, typed=True)[0]

    def backward(x: Any, upstream: Any) -> Any:
        return allreduce(upstream, op=rop, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                         process_set=process_set)

    return differentiable(tensor, forward, backward)


@tf_errors
def grouped_allreduce(tensors: Sequence[Any], average: Any = None, device_dense: str = "", device_sparse: str = "",
                      compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = global_process_set,
                      ignore_name_scope: bool = False, name: str | None = None) -> list[Any]:
    """All-reduce several tensors as one group; arguments as :func:`allreduce`.

    Each tensor is handed to the engine as soon as it exists; in a ``tf.function`` the
    results are waited for once every tensor of the group has been handed off.
    """
    _engine.job()
    check_compression(compression)
    if not tensors:
        return list(tensors)
    for tensor in tensors:
        _check_sparse_op(tensor, op)
    rop = resolve_op(op, average)
    base = _engine.collective_name(kind_of("grouped_allreduce", process_set), name)
    if on_set(process_set):
        with in_order():
            return [allreduce(t, compression=compression, op=rop, prescale_factor=prescale_factor,
                              postscale_factor=postscale_factor, name=f"{base}/{i}", process_set=process_set)
                    for i, t in enumerate(tensors)]

    def forward(xs: list[Any]) -> list[Any]:
        return reduce_tensors(xs, rop, [f"{base}/{i}" for i in range(len(xs))], compression=compression,
                              prescale_factor=prescale_factor, postscale_factor=postscale_factor, typed=True)

    def backward(upstreams: list[Any]) -> list[Any]:
        return grouped_allreduce(upstreams, op=rop, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, process_set=process_set)

    return differentiable_group(list(tensors), forward, backward)


@tf_errors
def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: Any = global_process_set) -> Any:
    """Concatenate every rank's ``tensor`` along axis 0, in rank order.

    Ranks may differ in the first dimension; the other dimensions and the dtype must
    be equal. A scalar is gathered as a vector of one element per rank.
    """
    channel = _engine.channel()
    full_name = _engine.collective_name(kind_of("allgather", process_set), name)

    def forward(x: Any) -> Any:
        if on_set(process_set):
            return group_allgather(x, full_name, process_set)
        return _typed_exchange(channel, [x], [Collective("allgather", full_name)])[0]

    members = process_set.ranks if on_set(process_set) else list(range(_engine.size()))
    mine = members.index(_engine.rank())

    def backward(x: Any, upstream: Any) -> Any:
        import tensorflow as tf

        averaged = allreduce(upstream, op=Average, process_set=process_set)
        rows = allgather(tf.reshape(tf.shape(x)[0], [1]), process_set=process_set)
        return tf.split(averaged, rows, axis=0, num=len(members))[mine]

    return differentiable(tensor, forward, backward)


def _check_root(root_rank: Any, process_set: Any = None) -> int:
    """``root_rank`` (a rank of the job, as Horovod counts it also for process sets)
    checked; with a set other than the job, its rank within the set."""
    world = _engine.size()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < world:
        raise ConfigError(f"`root_rank` must be an integer in [0, {world}). Received: root_rank={root_rank!r}")
    if process_set is not None and process_set is not global_process_set:
        if root_rank not in process_set.ranks:
            raise ConfigError(f"`root_rank` must be a member of {process_set!r}. Received: root_rank={root_rank}")
        return process_set.ranks.index(root_rank)
    return root_rank


@tf_errors
def broadcast(tensor: Any, root_rank: int, name: str | None = None, ignore_name_scope: bool = False,
              process_set: Any = global_process_set) -> Any:
    """``root_rank``'s ``tensor`` on every rank (shape and dtype equal everywhere)."""
    channel = _engine.channel()
    subset = on_set(process_set)
    root = _check_root(root_rank, process_set)
    full_name = _engine.collective_name(kind_of("broadcast", process_set), name)

    def forward(x: Any) -> Any:
        if subset:
            return group_broadcast(x, root, full_name, process_set)
        return _typed_exchange(channel, [x], [Collective("broadcast", full_name, root=root)])[0]

    is_root = _engine.rank() == root_rank

    def backward(x: Any, upstream: Any) -> Any:
        averaged = allreduce(upstream, op=Average, process_set=process_set)
        return averaged if is_root else averaged * 0

    return differentiable(tensor, forward, backward)


def _label(variable: Any, index: int) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", None) or f"variable{index}")


@tf_errors
def broadcast_variables(variables: Any, root_rank: int, process_set: Any = global_process_set,
                        inplace: bool = False) -> Any:
    """Assign ``root_rank``'s value to each variable on every rank.

    ``variables``: ``tf.Variable`` or Keras variables, e.g. ``model.variables`` and
    (Keras 3) ``optimizer.variables``. Eagerly the assignment is done on return; in a
    ``tf.function`` the returned op performs it (as Horovod). ``inplace`` is accepted.
    """
    channel = _engine.channel()
    subset = on_set(process_set)
    root = _check_root(root_rank, process_set)
    variables = list(variables)
    import tensorflow as tf

    base = _engine.collective_name(kind_of("broadcast_variables", process_set), None)
    if subset:

        with in_order():
            values = [group_broadcast(v, root, f"{base}/{i}", process_set) for i, v in enumerate(variables)]
        assigns = [v.assign(value) for v, value in zip(variables, values)]
        return None if tf.executing_eagerly() else tf.group(*[a for a in assigns if a is not None])
    collectives = [Collective("broadcast", f"{base}/{i}", root=root, label=_label(v, i))
                   for i, v in enumerate(variables)]
    values = _typed_exchange(channel, [tf.convert_to_tensor(v) for v in variables], collectives, chained=False)
    assigns = [v.assign(value) for v, value in zip(variables, values)]
    if tf.executing_eagerly():
        return None
    return tf.group(*[a for a in assigns if a is not None])
