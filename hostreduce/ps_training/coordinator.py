"""The ``tf.distribute`` surface of ``hostreduce.ParameterServerStrategy`` that custom
training loops written for TensorFlow's ``ParameterServerStrategy`` call: ``run``,
``reduce``, ``distribute_datasets_from_function`` and a ``ClusterCoordinator``.

TensorFlow's model has one client process that schedules functions onto remote workers;
hostreduce's has every task run the script (the ps tasks serve until the chief ends the
job). So the coordinator of each training task runs each scheduled function at once, on
this worker, on its own data, and every worker schedules the same functions: a script's
``schedule``/``join`` loop trains the same number of steps on every worker, and in sync
mode (the default) each step applies the mean of the workers' gradients once, the step
of the global batch. What differs from TensorFlow's coordinator: a function's error is
raised by ``schedule`` itself, not by a later ``join``; ``strategy.reduce`` and a
metric reduce over this worker's replica; no function moves to another worker when one
is lost (in sync mode the step fails on every worker, naming the lost one).

``tf.distribute.coordinator.ClusterCoordinator(strategy)`` (the tutorials' line) returns
this strategy's coordinator: TensorFlow's constructor returns the object the strategy
keeps as its ``_cluster_coordinator``, and runs its own set-up only for its own class.
Making it does nothing else (reading that attribute serves nobody); a ps task serves at
its first ``schedule`` or ``create_per_worker_dataset``.
Importing this module does not import TensorFlow.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

__all__ = ["ClusterCoordinator", "RemoteValue", "PerWorkerDataset", "ParameterServerSurface"]


class RemoteValue:
    """What ``ClusterCoordinator.schedule`` returns: the function's result on this worker."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def fetch(self) -> Any:
        """The result, as numpy values (tensors converted; other values as they are)."""
        import tensorflow as tf

        return tf.nest.map_structure(lambda v: v.numpy() if hasattr(v, "numpy") else v, self._value)

    def get(self) -> Any:
        """The result, as the function returned it (tensors stay tensors)."""
        return self._value


class PerWorkerDataset:
    """This worker's dataset, made by ``create_per_worker_dataset``: ``iter()`` gives the
    ``tf.data`` iterator a scheduled ``tf.function`` takes (``next(iterator)`` in it)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dataset)

    def build(self) -> "PerWorkerDataset":
        return self


class ClusterCoordinator:
    """``tf.distribute.coordinator.ClusterCoordinator`` for
    ``hostreduce.ParameterServerStrategy``: each training task runs what it schedules,
    at once, on its own data (see the module's docstring for how that maps onto
    TensorFlow's single-client model). On a ``ps`` task, its first ``schedule`` or
    ``create_per_worker_dataset`` serves until the chief ends the job, then ends the
    process (status 0)."""

    def __init__(self, strategy: Any) -> None:
        from ..errors import ConfigError

        if not getattr(strategy, "parameter_servers", False):
            raise ConfigError("`strategy` must be a hostreduce.ParameterServerStrategy. Received: "
                              f"strategy={strategy!r}")
        self._strategy = strategy
        self._checked = False

    def _on_a_training_task(self, what: str) -> None:
        if not self._checked:
            from .roles import training_task

            training_task(self._strategy, what)
            self._checked = True

    @property
    def strategy(self) -> Any:
        return self._strategy

    def schedule(self, fn: Callable[..., Any], args: Any = None, kwargs: Any = None) -> RemoteValue:
        """Run ``fn(*args, **kwargs)`` on this worker now; its error is raised here."""
        self._on_a_training_task("ClusterCoordinator.schedule")
        if not callable(fn):
            from ..errors import ConfigError

            raise ConfigError(f"`fn` must be a callable (a tf.function). Received: fn={fn!r}")
        return RemoteValue(fn(*(args or ()), **(kwargs or {})))

    def join(self) -> None:
        """Every scheduled function has run (``schedule`` runs each at once)."""

    def done(self) -> bool:
        """True: every scheduled function has run."""
        return True

    def fetch(self, val: Any) -> Any:
        """``val``'s ``RemoteValue``s (a structure of them) fetched as numpy values."""
        import tensorflow as tf

        return tf.nest.map_structure(lambda v: v.fetch() if isinstance(v, RemoteValue) else v, val)

    def create_per_worker_dataset(self, dataset_fn: Any) -> PerWorkerDataset:
        """This worker's dataset: ``dataset_fn()`` (a function, a ``tf.function`` such as
        one returning ``strategy.distribute_datasets_from_function(...)``) or a dataset
        given as is."""
        import tensorflow as tf

        self._on_a_training_task("ClusterCoordinator.create_per_worker_dataset")
        if isinstance(dataset_fn, tf.data.Dataset):
            return PerWorkerDataset(dataset_fn)
        if not callable(dataset_fn):
            from ..errors import ConfigError

            raise ConfigError("`dataset_fn` must be a function returning a tf.data.Dataset, or a dataset. "
                              f"Received: dataset_fn={dataset_fn!r}")
        dataset = dataset_fn()
        if not isinstance(dataset, tf.data.Dataset):
            from ..errors import ConfigError

            raise ConfigError(f"`dataset_fn` must return a tf.data.Dataset. Received: dataset_fn={dataset_fn!r}, "
                              f"which returned a {type(dataset).__name__}")
        return PerWorkerDataset(dataset)


class ParameterServerSurface:
    """The ``tf.distribute.Strategy`` methods a ``ParameterServerStrategy`` script calls
    in its scheduled functions; this worker is one replica (as a TensorFlow worker with
    one device is)."""

    _coordinator: Any = None

    @property
    def _cluster_coordinator(self) -> Any:
        # Read by TensorFlow's ClusterCoordinator(strategy), which returns this object.
        if self._coordinator is None:
            self._coordinator = ClusterCoordinator(self)
        return self._coordinator

    @_cluster_coordinator.setter
    def _cluster_coordinator(self, value: Any) -> None:
        self._coordinator = value

    @property
    def num_replicas_in_sync(self) -> int:
        """1: each worker is one replica, and what ``run`` and ``reduce`` see is its own."""
        return 1

    def run(self, fn: Callable[..., Any], args: Any = (), kwargs: Any = None, options: Any = None) -> Any:
        """``fn(*args, **kwargs)`` as this worker's replica."""
        return fn(*(args or ()), **(kwargs or {}))

    def reduce(self, reduce_op: Any, value: Any, axis: Any) -> Any:
        """``value`` reduced over this worker's replica (itself), and over ``axis`` where
        given, by ``reduce_op`` (``SUM`` or ``MEAN``)."""
        import tensorflow as tf

        from ..errors import ConfigError

        op = getattr(reduce_op, "value", reduce_op)
        if str(op).upper() not in ("SUM", "MEAN"):
            raise ConfigError(f"`reduce_op` must be tf.distribute.ReduceOp.SUM or MEAN. Received: "
                              f"reduce_op={reduce_op!r}")
        if axis is None:
            return value
        reduce = tf.reduce_sum if str(op).upper() == "SUM" else tf.reduce_mean
        return tf.nest.map_structure(lambda v: reduce(v, axis=axis), value)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        return (value,)

    def distribute_datasets_from_function(self, dataset_fn: Callable[..., Any], options: Any = None) -> Any:
        """``dataset_fn(input_context)``, this worker's dataset; the context names this
        worker's input pipeline (``input_pipeline_id`` its rank of
        ``num_input_pipelines`` workers), so ``input_context.shard`` shards by worker."""
        import tensorflow as tf

        context = tf.distribute.InputContext(num_input_pipelines=int(self.size),  # type: ignore[attr-defined]
                                             input_pipeline_id=int(self.rank),  # type: ignore[attr-defined]
                                             num_replicas_in_sync=1)
        return dataset_fn(context)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """``dataset`` as is: each worker iterates its own copy (shuffle it)."""
        return dataset
