"""Rank functions for ``tests/test_tf_strategy_surface.py`` (run by ``run_ranks``)."""
from __future__ import annotations

from typing import Any

import numpy as np


def surface_rank(rank: int, world_size: int) -> dict[str, Any]:
    """Every piece of the ``tf.distribute`` surface once, on this rank; returns what it saw."""
    import tensorflow as tf

    import hostreduce
    from hostreduce.errors import ConfigError

    strategy = hostreduce.MultiWorkerStrategy()
    out: dict[str, Any] = {"replicas": strategy.num_replicas_in_sync,
                           "task": (strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id),
                           "should_checkpoint": strategy.extended.should_checkpoint}
    value = tf.constant([[1.0, 2.0, 3.0]]) * (rank + 1)  # rank r: (r + 1) * [1, 2, 3]
    out["sum"] = strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None).numpy()
    out["mean_axis0"] = strategy.reduce("MEAN", tf.repeat(value, rank + 1, axis=0), axis=0).numpy()
    out["gather0"] = strategy.gather(value, axis=0).numpy()
    out["gather1"] = strategy.gather(value, axis=1).numpy()

    with strategy.scope():
        out["in_scope"] = tf.distribute.get_strategy() is strategy.tf_strategy
        tf.random.set_seed(rank)  # different initial values on each rank: the scope gives rank 0's
        variable = tf.Variable(tf.random.uniform((4,)))
        flag = tf.Variable(rank == 1)
    out["variable"] = variable.numpy()
    out["variable_device"] = variable.device
    out["flag"] = bool(flag.numpy())

    @tf.function
    def step(x: Any) -> Any:
        def replica(x: Any) -> Any:
            return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, x * 2.0)

        return strategy.run(replica, args=(x,))

    out["all_reduce_in_function"] = step(tf.constant(float(rank + 1))).numpy()
    out["values_fn"] = strategy.experimental_distribute_values_from_function(
        lambda ctx: (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync))

    rows = np.arange(10, dtype=np.float32)
    dataset = tf.data.Dataset.from_tensor_slices(rows).batch(4)  # batches of 4, 4, 2
    out["sliced"] = [np.asarray(b.values[0] if hasattr(b, "values") else b).tolist()
                     for b in strategy.experimental_distribute_dataset(dataset)]
    once = strategy.experimental_distribute_dataset(dataset)
    out["twice"] = [np.asarray(b).tolist() for b in strategy.experimental_distribute_dataset(once)]
    contexts = []

    def dataset_fn(context: Any) -> Any:
        contexts.append((context.num_input_pipelines, context.input_pipeline_id, context.num_replicas_in_sync,
                         context.get_per_replica_batch_size(8)))
        return tf.data.Dataset.from_tensor_slices(rows).shard(context.num_input_pipelines,
                                                              context.input_pipeline_id).batch(4)

    out["from_function"] = [np.asarray(b.values[0] if hasattr(b, "values") else b).tolist()
                            for b in strategy.distribute_datasets_from_function(dataset_fn)]
    out["contexts"] = contexts
    try:
        strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(rows))
    except ConfigError as exc:
        out["unbatched_error"] = str(exc)
    return out
