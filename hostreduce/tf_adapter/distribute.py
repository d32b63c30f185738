"""TF Adapter's ``npu.distribute`` calls on hostreduce's engines: a script that wrote
``import npu_device as npu`` runs with that line changed to ``import hostreduce as npu``
(``npu.distribute`` is this module), or with ``import hostreduce.distribute as distribute``.

A script ported to Ascend with TF Adapter uses four calls: ``broadcast`` (start every
worker from the same variables), ``all_reduce`` (in a custom ``tf.function`` step),
``shard_and_rebatch_dataset`` and ``npu_distributed_keras_optimizer_wrapper`` (also
named ``keras_optimizer_wrapper``). They keep their names, arguments, order and
defaults; so do TF Adapter's TF1 names ``npu_allreduce`` and
``npu_distributed_optimizer_wrapper`` (a ``tf.compat.v1.train.Optimizer`` or a Keras
optimizer) and its weight-update grouping (``grouping_gradients_apply``,
``grouping_broadcast``: every worker applies every update, which gives the same
weights). The job and the engine are those of :mod:`hostreduce.horovod` (the ring under
``TF_CONFIG``/``hostreduce run``, MPI under ``mpirun``), found at the first call. With
one worker every call leaves its input as it is.

``fusion``, ``fusion_id``: accepted; every tensor is handed to the engine on its own
as soon as it is produced. ``group``: ``"hccl_world_group"`` (the whole job) or a group
made by ``create_group``.

HCCL's ops and group management (:mod:`hostreduce.hccl`: ``create_group``,
``get_rank_size``, ``get_rank_id``, ``allreduce``, ``allgather``, ``broadcast``,
``reduce``, ``reduce_scatter``, ``send``, ``receive``, ``all_to_all_v_dynamic``, ...) are
re-exported here.
"""
from __future__ import annotations

from typing import Any

from ..errors import ConfigError, UnsupportedCallError
from . import hccl
from .hccl import (WORLD_GROUP, all_to_all_v, all_to_all_v_c, all_to_all_v_dynamic, allgather, allreduce, check_fusion,
                   create_group, destroy_group, gather_all_to_all_v, get_group_rank_from_world_rank, get_local_rank_id,
                   get_local_rank_size, get_rank_id, get_rank_size, get_world_rank_from_group_rank, receive, reduce,
                   reduce_scatter, remote_read, remote_ref_read, remote_scatter_write, remote_write, send,
                   set_split_strategy_by_idx, set_split_strategy_by_size)
from ..ops import job as _engine
from ..ops.compression import Compression
from ..ops.tensors import Average, Max, Min, Sum, broadcast_variables, reduce_tensors

__all__ = ["broadcast", "all_reduce", "shard_and_rebatch_dataset", "npu_distributed_keras_optimizer_wrapper",
           "keras_optimizer_wrapper", "npu_distributed_optimizer_wrapper", "npu_allreduce", "grouping_gradients_apply",
           "grouping_broadcast", "npu_callbacks_append", *[n for n in hccl.__all__[1:] if n != "broadcast"]]

# ``from npu_device.distribute import hccl_ops`` -> ``from hostreduce.distribute import hccl_ops``.
hccl_ops = hccl

_REDUCTIONS = {"mean": Average, "sum": Sum, "max": Max, "min": Min}


def _job_size(group: Any, fusion: Any, fusion_id: Any, groups: bool = False) -> int:
    if group != WORLD_GROUP and not groups:
        raise ConfigError(f"`group` must be {WORLD_GROUP!r} here (the whole job). Received: group={group!r}")
    check_fusion(fusion, fusion_id)
    if not _engine.is_initialized():
        _engine.init()
    return _engine.size() if group == WORLD_GROUP else hccl.get_rank_size(group)


def _reduction(reduction: Any, argument: str) -> Any:
    op = _REDUCTIONS.get(reduction) if isinstance(reduction, str) else None
    if op is None:
        raise ConfigError(f"`{argument}` must be one of {sorted(_REDUCTIONS)} ('prod' is not supported). "
                          f"Received: {argument}={reduction!r}")
    return op


def broadcast(values: Any, root_rank: int = 0, fusion: int = 2, fusion_id: int = 0,
              group: str = WORLD_GROUP) -> Any:
    """Assign ``root_rank``'s value to each variable in ``values`` (a variable or a nest
    of them, e.g. ``model.trainable_variables``) on every worker.

    Returns None eagerly, as TF Adapter; inside a ``tf.function`` an op that performs
    the assignments.
    """
    import tensorflow as tf

    size = _job_size(group, fusion, fusion_id, groups=True)
    if size == 1:
        return None
    if group != WORLD_GROUP:
        variables = tf.nest.flatten(values)
        assigns = [v.assign(hccl.broadcast(tf.convert_to_tensor(v), root_rank, group=group)) for v in variables]
        return None if tf.executing_eagerly() else tf.group(*[a for a in assigns if a is not None])
    return broadcast_variables(tf.nest.flatten(values), root_rank)


def all_reduce(values: Any, reduction: str = "mean", fusion: int = 1, fusion_id: int = -1,
               group: str = WORLD_GROUP) -> Any:
    """``values`` (a tensor, or a list or nest of tensors; None entries are kept) reduced
    over the workers.

    Usable eagerly and inside ``tf.function``, where each tensor is handed to the engine
    as soon as it is computed. ``reduction``: ``"mean"``, ``"sum"``, ``"max"`` or
    ``"min"``. ``tf.IndexedSlices`` (with ``"mean"`` or ``"sum"``) are all-gathered.

    Returns:
        The same structure with every tensor reduced (dtype and shape kept).
    """
    import tensorflow as tf

    op = _reduction(reduction, "reduction")
    size = _job_size(group, fusion, fusion_id, groups=True)
    if size == 1:
        return values
    flat = tf.nest.flatten(values, expand_composites=False)
    if group != WORLD_GROUP:
        sums = [None if t is None else hccl.allreduce(t, "sum" if reduction == "mean" else reduction, group=group)
                for t in flat]
        if reduction == "mean":
            sums = [s if s is None else s / tf.cast(size, s.dtype) if s.dtype.is_floating else s // size
                    for s in sums]
        return tf.nest.pack_sequence_as(values, sums)
    base = _engine.collective_name("all_reduce", None)
    reduced = reduce_tensors(flat, op, [f"{base}/{i}" for i in range(len(flat))])
    return tf.nest.pack_sequence_as(values, reduced)


def shard_and_rebatch_dataset(dataset: Any, global_bs: int) -> tuple[Any, int]:
    """This worker's shard of ``dataset`` (every ``size()``-th element, from its rank)
    and the batch size per worker, ``global_bs // size()``.

    Batch the returned dataset with the returned size.
    """
    if isinstance(global_bs, bool) or not isinstance(global_bs, int) or global_bs < 1:
        raise ConfigError(f"`global_bs` must be a positive integer. Received: global_bs={global_bs!r}")
    size = _job_size(WORLD_GROUP, 0, 0)
    if size == 1:
        return dataset, global_bs
    if global_bs % size:
        raise ConfigError(f"`global_bs` must be a multiple of the number of workers ({size}). "
                          f"Received: global_bs={global_bs}")
    return dataset.shard(size, _engine.rank()), global_bs // size


def npu_distributed_keras_optimizer_wrapper(optimizer: Any, reduce_reduction: str = "mean", fusion: int = 1,
                                            fusion_id: int = -1, group: str = WORLD_GROUP,
                                            variables_on_host: bool = False) -> Any:
    """An optimizer like ``optimizer`` (Keras 3 or tf_keras, not used yet; or a name such
    as ``"adam"``) whose updates use the gradients reduced over the workers; for
    ``model.compile`` or ``apply_gradients`` in a custom step. Use the returned optimizer
    (TF Adapter changes ``optimizer`` in place and returns it).

    ``variables_on_host``: every optimizer variable on ``/CPU:0``, updates applied there
    with TensorFlow's fused CPU kernels (the model must be built in host memory). With
    one worker and ``variables_on_host=False`` the optimizer is returned as it is.
    """
    from ..ops.optimizer import WrapperConfig, wrap_optimizer

    if isinstance(optimizer, str):
        import tensorflow as tf

        optimizer = tf.keras.optimizers.get(optimizer)
    op = _reduction(reduce_reduction, "reduce_reduction")
    size = _job_size(group, fusion, fusion_id)
    if size == 1 and not variables_on_host:
        return optimizer
    return wrap_optimizer(optimizer, WrapperConfig(op, Compression.none, variables_on_host=bool(variables_on_host)))


keras_optimizer_wrapper = npu_distributed_keras_optimizer_wrapper


def npu_allreduce(values: Any, reduction: str = "mean", fusion: int = 1, fusion_id: int = -1,
                  group: str = WORLD_GROUP) -> Any:
    """TF Adapter's TF1 name of :func:`all_reduce`: a list or tuple of tensors (None kept)
    gives a list, one tensor gives one tensor."""
    if isinstance(values, (list, tuple)):
        return list(all_reduce(list(values), reduction, fusion, fusion_id, group))
    return all_reduce(values, reduction, fusion, fusion_id, group)


def npu_distributed_optimizer_wrapper(tf_optimizer: Any) -> Any:
    """The optimizer with its gradients averaged over the workers.

    A ``tf.compat.v1.train.Optimizer`` is returned itself, its ``compute_gradients``
    (which ``minimize`` calls) now averaging each gradient over the whole job. A Keras
    optimizer (or its name) is wrapped as :func:`npu_distributed_keras_optimizer_wrapper`
    wraps it: use the returned optimizer.
    """
    import tensorflow as tf

    if not isinstance(tf_optimizer, tf.compat.v1.train.Optimizer):
        return npu_distributed_keras_optimizer_wrapper(tf_optimizer)
    if _job_size(WORLD_GROUP, 1, -1) == 1:
        return tf_optimizer
    compute_gradients = tf_optimizer.compute_gradients

    def averaged(*args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        pairs = list(compute_gradients(*args, **kwargs))
        grads = npu_allreduce([g for g, _ in pairs], "mean")
        return list(zip(grads, [v for _, v in pairs]))

    tf_optimizer.compute_gradients = averaged
    return tf_optimizer


def grouping_gradients_apply(apply_func: Any, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
    """``apply_func(grads_and_vars, *args, **kwargs)`` on every worker.

    TF Adapter's weight-update grouping has each worker update its share of the
    variables and broadcast them; with gradients already reduced (``all_reduce``),
    every worker applying every update ends with the same weights.
    """
    return apply_func(grads_and_vars, *args, **kwargs)


def grouping_broadcast(vars: Any) -> Any:  # noqa: A002 (TF Adapter's name)
    """Every worker's ``vars`` set to rank 0's (TF Adapter takes each from the worker
    that updates it; either way every worker ends with the same values)."""
    broadcast(vars, root_rank=0)
    return vars


def npu_callbacks_append(callbacks_list: Any = ()) -> Any:
    raise UnsupportedCallError(
        "hostreduce.distribute.npu_callbacks_append is not supported. For model.fit, append "
        "hostreduce.horovod.keras.callbacks.BroadcastGlobalVariablesCallback(0) to the callbacks, or call "
        "hostreduce.distribute.broadcast(model.trainable_variables, root_rank=0) once the model is built. "
        f"Received: callbacks_list={callbacks_list!r}")
