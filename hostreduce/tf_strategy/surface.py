"""The ``tf.distribute.Strategy`` methods of hostreduce's strategies (a mixin of
``MultiWorkerStrategy``, ``HorovodStrategy`` and ``SingleProcessStrategy``), each a
thin call on the TensorFlow strategy that stands for the hostreduce one
(``strategy.py``, built on first use). Importing this module does not import TensorFlow.
"""
from __future__ import annotations

from typing import Any

__all__ = ["DistributeSurface"]


class DistributeSurface:
    """The ``tf.distribute.Strategy`` methods TensorFlow's multi-worker tutorials and
    Keras call, on this strategy's engine (``hostreduce/tf_strategy``): a script written
    for ``tf.distribute.MultiWorkerMirroredStrategy()`` runs with that line changed.
    Each worker is one replica. The TensorFlow object behind them (built on first use)
    is :attr:`tf_strategy`; ``tf.distribute.get_strategy()`` returns it in ``scope()``."""

    _tf_strategy: Any = None
    _cluster_resolver: Any = None
    #: Keras 3 SGD and Adam made in ``scope()`` update with TensorFlow's fused CPU kernels
    #: (one pass over each variable, as the Horovod-style wrapper and the Estimator's host
    #: apply do); False keeps Keras's own update ops, whose rounding one process on the
    #: global batch reproduces to 1e-5 (the fused Adam differs by rounding, which Adam's
    #: normalized step can grow to a few 1e-5 over a few steps).
    fused_apply: bool = True

    @property
    def tf_strategy(self) -> Any:
        """The ``tf.distribute.Strategy`` that stands for this strategy."""
        if self._tf_strategy is None:
            from . import tf_strategy_for

            self._tf_strategy = tf_strategy_for(self)
        return self._tf_strategy

    @property
    def cluster_resolver(self) -> Any:
        """The resolver given, else one that describes this job as
        ``tf.distribute.cluster_resolver`` does (``task_type``, ``task_id``,
        ``cluster_spec()``): from ``TF_CONFIG`` where the job has one."""
        if self._cluster_resolver is None:
            self._cluster_resolver = _resolver_for(self.cluster)  # type: ignore[attr-defined]
        return self._cluster_resolver

    @cluster_resolver.setter
    def cluster_resolver(self, value: Any) -> None:
        self._cluster_resolver = value

    @property
    def extended(self) -> Any:
        return self.tf_strategy.extended

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of workers (one replica each)."""
        return int(self.size)  # type: ignore[attr-defined]

    def scope(self) -> Any:
        """Variables built in this block (a Keras model, its optimizer) live on the
        host with ``variables_on_host`` and start from rank 0's values; Keras's
        ``fit``, ``evaluate`` and ``predict`` and the optimizers' gradient aggregation
        reduce over the job."""
        return self.tf_strategy.scope()

    def run(self, fn: Any, args: Any = (), kwargs: Any = None, options: Any = None) -> Any:
        """``fn(*args, **kwargs)`` as this worker's replica (its values are plain tensors)."""
        return self.tf_strategy.run(fn, args=args, kwargs=kwargs, options=options)

    def reduce(self, reduce_op: Any, value: Any, axis: Any) -> Any:
        """``value`` (each worker's) reduced over the job by ``reduce_op`` (``SUM`` or
        ``MEAN``), after a reduction over ``axis`` where given."""
        return self.tf_strategy.reduce(reduce_op, value, axis)

    def gather(self, value: Any, axis: int) -> Any:
        """Every worker's ``value`` concatenated along ``axis`` in rank order."""
        return self.tf_strategy.gather(value, axis)

    def experimental_local_results(self, value: Any) -> Any:
        return self.tf_strategy.experimental_local_results(value)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """``dataset`` yields global batches; each worker iterates its slice of every batch."""
        return self.tf_strategy.experimental_distribute_dataset(dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Any, options: Any = None) -> Any:
        """``dataset_fn(input_context)`` on each worker, with this worker's
        ``tf.distribute.InputContext``; its batches are this worker's."""
        return self.tf_strategy.distribute_datasets_from_function(dataset_fn, options)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    def experimental_distribute_values_from_function(self, value_fn: Any) -> Any:
        return self.tf_strategy.experimental_distribute_values_from_function(value_fn)


def _resolver_for(cluster: Any) -> Any:
    import tensorflow as tf

    if cluster.source == "TF_CONFIG":
        return tf.distribute.cluster_resolver.TFConfigClusterResolver()
    jobs = {"worker": list(cluster.addresses)} if cluster.addresses else {}
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(jobs), task_type="worker", task_id=cluster.rank, rpc_layer="grpc")
