"""Keras 3 ``fit`` (and custom loops calling ``apply_gradients``) with the variables and
the optimizer's state on parameter servers: ``ParameterServerStrategy.keras_optimizer``.

The optimizer it returns is of the user's class (a subclass made once per class, with
the same name and module) with no state of its own on the worker: its ``build``
connects the job instead of creating slots (the chief registers the model's trainable
variables and this optimizer's configuration on the ps, every worker starts from the
ps's values), and its ``apply`` puts one host op into the traced train step that pushes
the step's gradients (an embedding's as rows) and pulls back every variable as the ps
hold them after applying; the variables take those values. Sync mode: the ps average
the workers' gradients of the step and apply once, as for the Estimator, so the model
trains as one process would on the global batch.

Every variable travels whole each step, as TensorFlow's own ``ParameterServerStrategy``
reads its dense variables: the Estimator's row caches, which pull only a batch's rows of
a large table, need the batch before the step and are not used here.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

from ..errors import ClusterError, ConfigError

__all__ = ["keras_optimizer"]


class _Exchange:
    """One worker's tie between a wrapped optimizer and the parameter servers."""

    def __init__(self, strategy: Any, config: dict[str, Any]) -> None:
        self.strategy, self.config = strategy, config
        self.keys: list[str] = []
        self.step = 0

    def connect(self, variables: Sequence[Any]) -> None:
        """Register ``variables`` (the chief) and give them the ps's values (all)."""
        strategy = self.strategy
        self.keys = [f"{i}:{getattr(v, 'path', None) or v.name}" for i, v in enumerate(variables)]
        client = strategy.job.client
        if strategy.is_chief:
            client.register({k: np.asarray(v.numpy()) for k, v in zip(self.keys, variables)}, self.config,
                            shard_bytes=strategy.shard_bytes, step=0)
        client.wait_ready()
        self.step = int(client.info()["step"])
        values = client.pull(self.keys)
        for key, variable in zip(self.keys, variables):
            variable.assign(values[key])

    def exchange(self, kinds: list[str | None], tensors: Sequence[Any]) -> list[np.ndarray]:
        """Push one step's gradients (``kinds[i]``: "dense", "rows" or None for none),
        return every variable's value after the ps applied them."""
        client = self.strategy.job.client
        dense, rows, it = {}, {}, iter(tensors)
        for key, kind in zip(self.keys, kinds):
            if kind == "dense":
                dense[key] = next(it).numpy()
            elif kind == "rows":
                ids = next(it).numpy()
                rows[key] = (ids, next(it).numpy())
        if self.strategy.sync:
            client.push(dense, rows, step=self.step + 1)
            self.step += 1
        else:
            client.push(dense, rows)
        values = client.pull(self.keys)
        return [values[key] for key in self.keys]


class _PSUpdate:
    """Methods of the subclass made for a Keras 3 optimizer class."""

    def build(self, variables: Any) -> None:
        import keras
        import tensorflow as tf

        variables = list(variables)
        with tf.init_scope():  # eagerly, also when Keras builds it while tracing the step
            keras.optimizers.Optimizer.build(self, variables)  # bookkeeping only: no slots here
            self._hostreduce_exchange.connect(variables)
        self.built = True

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        import tensorflow as tf

        from ..horovod._optimizer import _check_not_xla

        grads = list(grads)
        variables = list(trainable_variables) if trainable_variables is not None else list(self._trainable_variables)
        if not self.built:
            self.build(variables)
        _check_not_xla()
        kinds: list[str | None] = []
        flat: list[Any] = []
        for g in grads:
            if g is None:
                kinds.append(None)
            elif isinstance(g, tf.IndexedSlices):
                kinds.append("rows")
                flat += [g.indices, g.values]
            else:
                kinds.append("dense")
                flat.append(g)
        exchange = self._hostreduce_exchange
        new = tf.py_function(lambda *t: exchange.exchange(kinds, t), flat,
                             Tout=[tf.as_dtype(v.dtype) for v in variables], name="hostreduce_ps_exchange")
        assigns = [v.assign(tf.ensure_shape(n, v.shape)) for v, n in zip(variables, new)]
        with tf.control_dependencies([a for a in assigns if a is not None]):
            return self.iterations.assign_add(1)


_subclasses: dict[type, type] = {}
_lock = threading.Lock()


def _subclass(base: type) -> type:
    with _lock:
        cls = _subclasses.get(base)
        if cls is None:
            namespace = {k: v for k, v in vars(_PSUpdate).items() if callable(v)}
            namespace.update(__module__=base.__module__, __qualname__=base.__qualname__, __doc__=base.__doc__)
            cls = _subclasses[base] = type(base.__name__, (base,), namespace)
        return cls


def keras_optimizer(strategy: Any, optimizer: Any) -> Any:
    """``optimizer`` (a Keras 3 SGD, Adam or Adagrad, constant learning rate, not used
    yet) with its variables and slots on ``strategy``'s parameter servers; on a ``ps``
    task this serves until the chief ends the job, then exits 0."""
    from ..host._keras import keras_of
    from ..host.capture import host_optimizer_config

    role = strategy.role
    if role == "ps":
        from ..estimator.roles import serve_and_exit

        serve_and_exit(strategy)
    if role != "worker":
        raise ClusterError(f"A Keras job on parameter servers has ps and training tasks only. Received: task.type="
                           f"{strategy.cluster.task_type!r}")
    package = keras_of(optimizer)
    if package is None or package.__name__ != "keras" or not isinstance(optimizer, package.optimizers.Optimizer):
        raise ConfigError(f"`optimizer` must be a Keras 3 optimizer (SGD, Adam or Adagrad). Received: "
                          f"optimizer={optimizer!r}")
    if getattr(optimizer, "built", False):
        raise ConfigError("`optimizer` must not have been used yet: wrap it before training (its state would be "
                          f"lost). Received: an optimizer at iteration {int(optimizer.iterations.numpy())}")
    config = host_optimizer_config([optimizer], strategy.sparse)  # refuses what the ps cannot apply
    wrapped = _subclass(type(optimizer)).from_config(optimizer.get_config())
    wrapped._hostreduce_exchange = _Exchange(strategy, config)
    return wrapped
