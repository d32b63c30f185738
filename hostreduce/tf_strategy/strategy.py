"""A ``tf.distribute.Strategy`` with one replica per worker, whose cross-worker
reductions run on a hostreduce engine.

Why one replica per worker, on ``OneDeviceStrategy``'s machinery: values inside
``run`` are plain tensors, never ``PerReplica`` ones (which Keras 3's trainer cannot
take under ``MultiWorkerMirroredStrategy``, keras#20585), variables are plain
``tf.Variable``s placed where hostreduce keeps them, and what makes the job
multi-worker is confined to a few hooks:

* ``num_replicas_in_sync`` is the number of workers (Keras divides each worker's loss
  by it, so the summed gradients are the global batch's mean);
* ``reduce_to`` / ``batch_reduce_to`` (what ``ReplicaContext.all_reduce``,
  ``Strategy.reduce`` and the optimizers' gradient aggregation call) all-reduce over
  the engine, one hand-off op per tensor in a traced step, so each gradient's
  reduction starts when the backward pass produces it;
* variables are created on the host (``variables_on_host``) with rank 0's initial
  value, and updated where they live;
* datasets given to ``experimental_distribute_dataset`` are global batches: each
  worker takes its slice of every batch (TensorFlow's ``AutoShardPolicy.DATA``, the
  policy for in-memory data), so every worker has as many steps as the others and the
  workers' slices of a step make up its global batch; the result, like
  ``distribute_datasets_from_function``'s, is a plain ``tf.data.Dataset`` of this
  worker's batches.
"""
from __future__ import annotations

import atexit
import contextlib
import threading
from typing import Any, Iterator

import tensorflow as tf
from tensorflow.python.distribute import distribute_lib, one_device_strategy

from ..errors import ConfigError
from ..host import keras_files
from ..streaming import Channel, Collective, exchange
from ..streaming.names import CollectiveNames
from ..timeline import Timeline, timeline_dir_from_env

__all__ = ["HostStrategy"]

_MEAN = tf.distribute.ReduceOp.MEAN


class _HostExtended(one_device_strategy.OneDeviceExtended):
    def __init__(self, container: Any, host: Any) -> None:
        compute = "/GPU:0" if tf.config.list_logical_devices("GPU") else "/CPU:0"
        super().__init__(container, compute)
        self._host = host
        self._variable_device = "/CPU:0" if host.variables_on_host else self._device
        self._names = CollectiveNames("tfs")
        self._channel: Channel | None = None
        # HOSTREDUCE_TIMELINE=DIR: each worker's hand-offs and reductions, written at exit
        self.timeline = Timeline(timeline_dir_from_env(), rank=int(host.rank))
        if self.timeline.enabled:
            atexit.register(self.timeline.flush)

    # -- the job -------------------------------------------------------------------
    @property
    def _workers(self) -> int:
        return int(self._host.size)

    def _get_channel(self) -> Channel:
        if self._channel is None:
            from ..config import Config

            host = self._host
            # The engine fails a collective after timeout_s naming the cause; the
            # hand-off's own limit is a backstop behind it.
            timeout = (host.config or Config.from_env()).timeout_s * 2 + 30.0
            self._channel = Channel(lambda: host.reducer, host.ordered_submission, self.timeline,
                                    timeout_s=timeout)
            host.reducer  # start the engine here, on the tracing (or eager) thread
        return self._channel

    def _exchange(self, values: list[Any], kind: str, op: str = "sum", root: int = 0) -> list[Any]:
        channel = self._get_channel()
        collectives = [Collective(kind, self._names.next(kind), op=op, root=root) for _ in values]
        with tf.device("/CPU:0"):
            return exchange(channel, values, collectives)

    def barrier(self) -> None:
        """Wait until every worker got here (no-op on one worker)."""
        if self._workers > 1:
            self._get_channel()
            self._host.reducer.barrier(self._channel.timeout_s)  # type: ignore[union-attr]

    # -- variables -----------------------------------------------------------------
    def _create_variable(self, next_creator: Any, **kwargs: Any) -> Any:
        colocate_with = kwargs.pop("colocate_with", None)
        if colocate_with is not None:
            with tf.device(colocate_with.device):  # an optimizer's slot: beside its variable
                return next_creator(**kwargs)
        if self._workers > 1 and kwargs.get("synchronization") != tf.VariableSynchronization.ON_READ:
            kwargs["initial_value"] = self._from_rank0(kwargs.get("initial_value"), kwargs.get("dtype"))
        with tf.device(self._variable_device):
            return next_creator(**kwargs)

    def _from_rank0(self, initial_value: Any, dtype: Any) -> Any:
        """``initial_value`` as rank 0 made it, on every rank (as the multi-worker
        strategies do), so that every worker starts from the same weights."""
        def initial() -> Any:
            with tf.init_scope():  # variables are created eagerly, also from inside a tf.function
                value = initial_value() if callable(initial_value) else initial_value
                value = tf.convert_to_tensor(value, dtype=dtype)
                if value.dtype == tf.bool:
                    return tf.cast(self._exchange([tf.cast(value, tf.int32)], "broadcast")[0], tf.bool)
                return self._exchange([value], "broadcast")[0]

        return initial

    def _update(self, var: Any, fn: Any, args: Any, kwargs: Any, group: bool) -> Any:
        # Updates run where the variable lives (on the host with variables_on_host).
        with tf.device(var.device), distribute_lib.UpdateContext(var.device):
            result = fn(var, *args, **kwargs)
            return result if group else tf.nest.map_structure(self._local_results, result)

    def _call_for_each_replica(self, fn: Any, args: Any, kwargs: Any) -> Any:
        # A one-replica PerReplica value (TensorFlow's own distributed values, made
        # outside this strategy) reaches the replica function as the value itself.
        args, kwargs = tf.nest.map_structure(_unwrap, (args, kwargs or {}))
        return super()._call_for_each_replica(fn, args, kwargs)

    # -- reductions ----------------------------------------------------------------
    def _allreduce(self, reduce_op: Any, values: list[Any]) -> list[Any]:
        values = [self._local(v) for v in values]
        if self._workers == 1 or not values:
            return values
        op = "mean" if reduce_op == _MEAN else "sum"
        return self._exchange(values, "allreduce", op=op)

    @staticmethod
    def _local(value: Any) -> Any:
        """This worker's value as a dense tensor."""
        value = _unwrap(value)
        if isinstance(value, tf.IndexedSlices) or not tf.is_tensor(value):
            value = tf.convert_to_tensor(value)
        return value

    def _reduce_to(self, reduce_op: Any, value: Any, destinations: Any, options: Any) -> Any:
        flat = tf.nest.flatten(value, expand_composites=False)
        return tf.nest.pack_sequence_as(value, self._allreduce(reduce_op, flat))

    def _batch_reduce_to(self, reduce_op: Any, value_destination_pairs: Any, options: Any) -> list[Any]:
        return self._allreduce(reduce_op, [value for value, _ in value_destination_pairs])

    def _gather_to_implementation(self, value: Any, destinations: Any, axis: int, options: Any) -> Any:
        value = tf.convert_to_tensor(value)
        if self._workers == 1:
            return value
        if axis == 0:
            return self._exchange([value], "allgather")[0]
        perm = [axis] + [i for i in range(value.shape.rank) if i != axis]
        gathered = self._exchange([tf.transpose(value, perm)], "allgather")[0]
        return tf.transpose(gathered, [perm.index(i) for i in range(len(perm))])

    # -- input ---------------------------------------------------------------------
    # One replica per worker: a worker's "distributed" dataset is a plain tf.data.Dataset
    # of its own batches (TensorFlow's input_lib wrapping, PerReplica values and their
    # per-step cost buy nothing with one replica). It is marked, so that handing it on to
    # fit (which distributes what it is given) does not slice it a second time.
    _WORKER_DATASET = "_hostreduce_worker_dataset"

    def _experimental_distribute_dataset(self, dataset: Any, options: Any) -> Any:
        if getattr(dataset, self._WORKER_DATASET, False) or getattr(_local, "whole", False):
            return dataset
        return self._mark(self._slice_batches(dataset))

    def _mark(self, dataset: Any) -> Any:
        if not isinstance(dataset, tf.data.Dataset):
            raise ConfigError("The dataset function must return a tf.data.Dataset. Received: "
                              f"{type(dataset).__name__} {dataset!r:.80}")
        setattr(dataset, self._WORKER_DATASET, True)
        return dataset

    def _slice_batches(self, dataset: Any) -> Any:
        workers, rank = self._workers, int(self._host.rank)
        if workers == 1:
            return dataset
        for spec in tf.nest.flatten(dataset.element_spec):
            shape = getattr(spec, "shape", None)
            if shape is None or shape.rank == 0:
                raise ConfigError(
                    "experimental_distribute_dataset() splits each global batch between the workers, so every "
                    "element of `dataset` must be a batch (call dataset.batch(global_batch_size)). Received: "
                    f"a dataset with element_spec={dataset.element_spec}")

        def piece(*batch: Any) -> Any:
            flat = tf.nest.flatten(batch)
            n = tf.shape(flat[0], out_type=tf.int64)[0]
            begin, end = n * rank // workers, n * (rank + 1) // workers
            return tf.nest.map_structure(lambda t: t[begin:end], batch if len(batch) > 1 else batch[0])

        return dataset.map(piece, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def _distribute_datasets_from_function(self, dataset_fn: Any, options: Any) -> Any:
        return self._mark(dataset_fn(self._input_context()))

    def _input_context(self) -> Any:
        workers = self._workers
        return distribute_lib.InputContext(num_input_pipelines=workers, input_pipeline_id=int(self._host.rank),
                                           num_replicas_in_sync=workers)

    def _experimental_distribute_values_from_function(self, value_fn: Any) -> Any:
        return value_fn(distribute_lib.ValueContext(replica_id_in_sync_group=int(self._host.rank),
                                                    num_replicas_in_sync=self._workers))

    # -- what the job looks like ------------------------------------------------------
    @property
    def _num_replicas_in_sync(self) -> int:
        return self._workers

    def _in_multi_worker_mode(self) -> bool:
        return self._workers > 1

    # What Keras reads of MultiWorkerMirroredStrategy's extended (temporary paths of the
    # workers that do not checkpoint).
    @property
    def _cluster_resolver(self) -> Any:
        return self._host.cluster_resolver

    @property
    def _task_type(self) -> str:
        return str(self._host.cluster_resolver.task_type or "worker")

    @property
    def _task_id(self) -> int:
        return int(self._host.cluster_resolver.task_id or 0)

    @property
    def should_checkpoint(self) -> bool:
        return bool(self._host.is_chief)

    @property
    def should_save_summary(self) -> bool:
        return bool(self._host.is_chief)

    @property
    def experimental_between_graph(self) -> bool:
        return True

    @property
    def _global_batch_size(self) -> bool:
        return True


_local = threading.local()


@contextlib.contextmanager
def _whole_data_for_evaluate_and_predict(tf_strategy: Any) -> Iterator[None]:
    """``evaluate`` and ``predict`` of a model built in the scope run on the whole input
    on every worker (no collective; each worker's compute is the whole input's), so that
    they return what one process returns: the metrics of all the data, every prediction
    in order, on every worker. (``MultiWorkerMirroredStrategy`` splits the work and
    gathers; sliced here, each worker would see only its part.)"""
    from ..host.patch import routed

    def whole(original: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        if tf_strategy._owns(model) and not getattr(_local, "whole", False):
            _local.whole = True
            try:
                return original(model, *args, **kwargs)
            finally:
                _local.whole = False
        return original(model, *args, **kwargs)

    with contextlib.ExitStack() as stack:
        for owner in keras_files.model_classes():
            for name in ("evaluate", "predict"):
                stack.enter_context(routed(owner, name, whole))
        yield


@contextlib.contextmanager
def _fused_keras_updates(tf_strategy: Any) -> Iterator[None]:
    """Keras 3 SGD and Adam made in ``tf_strategy``'s scope update with TensorFlow's fused
    CPU kernels (``hostreduce/host/apply.py``: one pass over each variable where Keras's
    own update makes several), after the gradients' all-reduce, as the Horovod-style
    wrapper does; other optimizers and settings, and ``fused_apply=False``, keep Keras's
    own update."""
    from ..host.apply import fused_apply_supported, fused_updates
    from ..host.patch import routed

    try:
        from keras.src.backend.tensorflow.optimizer import TFOptimizer
    except ImportError:  # no Keras 3
        yield
        return

    def update_step(original: Any, optimizer: Any, grads: Any, variables: Any, learning_rate: Any) -> Any:
        if (getattr(optimizer, "_distribution_strategy", None) is not tf_strategy
                or not tf_strategy.host_strategy.fused_apply or not fused_apply_supported(optimizer, variables)):
            return original(optimizer, grads, variables, learning_rate)
        pairs = optimizer._all_reduce_sum_gradients(list(zip(grads, [getattr(v, "value", v) for v in variables])))
        with tf.device(tf_strategy.extended._variable_device):
            fused_updates(optimizer, [(g, v) for g, v in pairs if g is not None], tf.convert_to_tensor(learning_rate))

    with routed(TFOptimizer, "_backend_update_step", update_step):
        yield


def _unwrap(value: Any) -> Any:
    """A one-replica ``PerReplica`` value's own value (anything else as it is)."""
    if isinstance(value, tf.distribute.DistributedValues):
        return value.values[0]
    return value


class HostStrategy(tf.distribute.OneDeviceStrategy):
    """The ``tf.distribute.Strategy`` of a hostreduce strategy (``host``): see the module."""

    def __init__(self, host: Any) -> None:
        # OneDeviceStrategy's own __init__ builds its extended; this one builds ours.
        distribute_lib.Strategy.__init__(self, _HostExtended(self, host))
        self.host_strategy = host
        self._keras_routes = keras_files.install(self._owns, lambda: bool(host.is_chief), self.extended.barrier,
                                                 tf_keras_strategy=type(self))
        self._keras_routes.enter_context(_fused_keras_updates(self))
        self._keras_routes.enter_context(_whole_data_for_evaluate_and_predict(self))

    def _owns(self, model: Any) -> bool:
        strategy = getattr(model, "_distribute_strategy", None) or getattr(model, "_distribution_strategy", None)
        return strategy is self

    @property
    def cluster_resolver(self) -> Any:
        return self.host_strategy.cluster_resolver

    def __deepcopy__(self, memo: Any) -> "HostStrategy":
        return self  # one per hostreduce strategy (Keras copies models' configs, not strategies)

    def __repr__(self) -> str:
        return f"HostStrategy({self.host_strategy!r})"
