"""Keras ``fit`` (Keras 3 and tf_keras; and custom loops calling ``apply_gradients``)
with the variables and the optimizer's state on parameter servers:
``ParameterServerStrategy.keras_optimizer`` and ``ParameterServerStrategy.scope``.

The optimizer ``keras_optimizer`` returns is of the user's class (a subclass made once
per class, with the same name and module) with no state of its own on the worker: its
``build`` (tf_keras: its first ``apply_gradients``) connects the job instead of creating
slots (the chief registers the model's trainable variables and this optimizer's
configuration on the ps, every worker starts from the ps's values), and its ``apply``
(tf_keras: ``apply_gradients``) puts one host op into the traced train step
that pushes the step's gradients (an embedding's as rows) and pulls back the variables
as the ps hold them after applying; the variables take those values. Sync mode: the ps
average the workers' gradients of the step and apply once, as for the Estimator, so the
model trains as one process would on the global batch.

A model built inside ``strategy.scope()`` gets, for each table the ps split by rows, a
row cache (``hostreduce/ps_training/rowcache.py``) instead of a full variable: its lookup
first runs a host op that pulls the looked-up rows into the cache, the gradient's cache
slots go back to the ps as global row ids, and only the chief ever computes the table's
initial value. Every other variable travels whole each step, as TensorFlow's own
``ParameterServerStrategy`` reads its dense variables. A Keras optimizer made in the
scope becomes such an optimizer in place when the block ends.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import ConfigError, SpecError
from .roles import training_task
from .rowcache import is_row_cache, row_caches, shard_tables

__all__ = ["keras_optimizer", "variable_scope", "pull_variables", "release_lookups"]


class _StrategyState:
    """What the Keras face keeps per strategy: its tie to the ps once the optimizer has
    connected (``exchange``), and the routing of Keras lookups to row caches (``lookups``)."""

    def __init__(self) -> None:
        self.exchange: Any = None
        self.lookups: contextlib.ExitStack | None = None
        # models compiled in the scope, and the routing of Keras's file-writing callbacks
        # for them (the chief alone writes), kept for the life of the process
        self.models: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self.callbacks: contextlib.ExitStack | None = None


_states: "weakref.WeakKeyDictionary[Any, _StrategyState]" = weakref.WeakKeyDictionary()


def _state(strategy: Any) -> _StrategyState:
    state = _states.get(strategy)
    if state is None:
        state = _states[strategy] = _StrategyState()
    return state


def _name(variable: Any) -> str:
    """A variable's Keras 3 path, else its name (tf_keras, TensorFlow)."""
    return getattr(variable, "path", None) or variable.name


def _cache(variable: Any) -> Any:
    value = getattr(variable, "_value", variable)
    return value if is_row_cache(value) else None


class _Exchange:
    """One worker's tie between a wrapped optimizer and the parameter servers."""

    def __init__(self, strategy: Any, config: dict[str, Any]) -> None:
        self.strategy, self.config = strategy, config
        self.keys: list[str] = []
        self.caches: dict[str, Any] = {}  # key -> row cache (a table split by rows)
        self._key_of: dict[int, str] = {}
        self.step = 0

    def connect(self, variables: Sequence[Any]) -> None:
        """Register ``variables`` (the chief) and give them the ps's values (all); a
        row cache is filled by its lookups."""
        strategy = self.strategy
        self.keys = [f"{i}:{_name(v)}" for i, v in enumerate(variables)]
        self.caches = {k: c for k, c in ((k, _cache(v)) for k, v in zip(self.keys, variables)) if c is not None}
        self._key_of = {id(c): k for k, c in self.caches.items()}
        client = strategy.job.client
        if strategy.is_chief:
            values = {k: self.caches[k].initial_value_numpy() if k in self.caches else np.asarray(v.numpy())
                      for k, v in zip(self.keys, variables)}
            client.register(values, self.config, shard_bytes=strategy.shard_bytes, step=0)
            del values
        for cache in self.caches.values():
            cache.initial = None  # the ps hold the table now
        client.wait_ready()
        self.step = int(client.info()["step"])
        values = client.pull(self.dense_keys)
        for key, variable in zip(self.keys, variables):
            if key in values:
                variable.assign(values[key])
        _state(strategy).exchange = self

    @property
    def dense_keys(self) -> list[str]:
        return [k for k in self.keys if k not in self.caches]

    def fill(self, cache: Any, ids: np.ndarray) -> np.int64:
        """Pull the rows at ``ids`` of ``cache``'s table into it (a lookup's host op)."""
        key = self._key_of[id(cache)]
        unique = np.unique(np.asarray(ids, np.int64))
        cache.fill(unique, self.strategy.job.client.pull_rows({key: unique})[key])
        return np.int64(len(unique))

    def exchange(self, kinds: list[str | None], tensors: Sequence[Any]) -> list[np.ndarray]:
        """Push one step's gradients (``kinds[i]``: "dense", "rows" or None for none),
        return the values of the variables but the row caches after the ps applied them."""
        client = self.strategy.job.client
        dense, rows, it = {}, {}, iter(tensors)
        for key, kind in zip(self.keys, kinds):
            if kind == "dense":
                dense[key] = next(it).numpy()
            elif kind == "rows":
                ids = next(it).numpy()
                rows[key] = (self.caches[key].to_global(ids) if key in self.caches else ids, next(it).numpy())
        if self.strategy.sync:
            client.push(dense, rows, step=self.step + 1)
            self.step += 1
        else:
            client.push(dense, rows)
        values = client.pull(self.dense_keys)
        return [values[key] for key in self.dense_keys]


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
        grads = list(grads)
        variables = list(trainable_variables) if trainable_variables is not None else list(self._trainable_variables)
        if not self.built:
            self.build(variables)
        return _exchange_step(self, grads, variables)


class _PSApplyGradients:
    """Methods of the subclass made for a tf_keras optimizer class (legacy ones too):
    ``apply_gradients`` (what ``minimize`` and ``fit`` call) connects the job on its
    first call and then exchanges with the ps; the optimizer makes no slots."""

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        import tensorflow as tf

        pairs = list(grads_and_vars)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        exchange = self._hostreduce_exchange
        if not exchange.keys:
            with tf.init_scope():  # eagerly, also when called while tracing the step
                self.iterations  # noqa: B018 (a legacy optimizer makes it on first use)
                exchange.connect(variables)
        elif len(variables) != len(exchange.keys):
            raise SpecError(f"`grads_and_vars` must name the variables this optimizer trains on the parameter servers "
                            f"since its first step ({len(exchange.keys)} of them). Received: {len(variables)} "
                            "variables")
        return _exchange_step(self, grads, variables)


def _exchange_step(optimizer: Any, grads: list[Any], variables: list[Any]) -> Any:
    """One host op in the traced step that pushes ``grads`` (an embedding's as rows) and
    assigns ``variables`` the values the ps hold after applying them."""
    import tensorflow as tf

    from ..host.kerases import check_not_xla

    check_not_xla()
    _check_one_lookup(variables)
    for g, v in zip(grads, variables):
        cache = _cache(v)
        if cache is not None and g is not None and not isinstance(g, tf.IndexedSlices):
            raise SpecError(
                f"Variable {_name(v)!r} of shape {list(cache.full_shape)} is split by rows over the parameter "
                f"servers (it has at least shard_bytes={optimizer._hostreduce_exchange.strategy.shard_bytes} bytes), "
                "so a worker holds only the rows it looks up (Embedding layers, ops.take); it is read whole "
                "here. Raise `shard_bytes` of ParameterServerStrategy to keep it whole, or build it outside "
                "`strategy.scope()`")
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
    exchange = optimizer._hostreduce_exchange
    dense = [v for v in variables if _cache(v) is None]
    new = tf.py_function(lambda *t: exchange.exchange(kinds, t), flat,
                         Tout=[tf.as_dtype(v.dtype) for v in dense], name="hostreduce_ps_exchange")
    assigns = [v.assign(tf.ensure_shape(n, v.shape)) for v, n in zip(dense, new)]
    with tf.control_dependencies([a for a in assigns if a is not None] or new):
        return optimizer.iterations.assign_add(1)


def _check_one_lookup(variables: Sequence[Any]) -> None:
    """A row cache holds the rows of one lookup per step: the gradient of a second
    lookup in the same step would name slots of rows no longer cached."""
    import tensorflow as tf

    graph = tf.compat.v1.get_default_graph()
    for variable in variables:
        cache = _cache(variable)
        if cache is None:
            continue
        here = [t for t in cache.looked_up if getattr(t, "graph", None) is graph]
        cache.looked_up = [t for t in cache.looked_up if getattr(t, "graph", None) is not graph]
        if len(here) > 1:
            raise SpecError(f"The table {_name(variable)!r} (shape {list(cache.full_shape)}) is split by rows over the "
                            f"parameter servers and is looked up {len(here)} times in one training step; with Keras "
                            "`fit` it may be looked up once per step: look up all its ids in one call (concatenate "
                            "them), or build the model outside `strategy.scope()` to pull the table whole each step")


def keras_optimizer(strategy: Any, optimizer: Any) -> Any:
    """``optimizer`` (a Keras 3 or tf_keras SGD, Adam, Adagrad or RMSprop, constant
    learning rate, not used yet) with its variables and slots on ``strategy``'s parameter
    servers; on a ``ps`` task this serves until the chief ends the job, then exits 0."""
    training_task(strategy, "an optimizer")
    config, methods = _checked(strategy, optimizer)
    wrapped = _ps_class(optimizer, methods).from_config(optimizer.get_config())
    wrapped._hostreduce_exchange = _Exchange(strategy, config)
    return wrapped


def _ps_class(optimizer: Any, methods: type) -> type:
    from ..host.kerases import optimizer_subclass

    return optimizer_subclass(type(optimizer), methods)


def _checked(strategy: Any, optimizer: Any) -> tuple[dict[str, Any], type]:
    """The ps's configuration for ``optimizer``, a Keras optimizer not used yet, and the
    methods its class gets (a ``ConfigError`` naming what the ps cannot apply otherwise)."""
    from ..host.kerases import keras_of, optimizer_bases
    from .capture import host_optimizer_config

    package = keras_of(optimizer)
    if package is None or not isinstance(optimizer, optimizer_bases(package)):
        raise ConfigError(f"`optimizer` must be a Keras optimizer (SGD, Adam, Adagrad or RMSprop of Keras 3 or "
                          f"tf_keras). Received: optimizer={optimizer!r}")
    if getattr(optimizer, "built", False) or getattr(optimizer, "_built", False) or getattr(optimizer, "_slots", None):
        raise ConfigError("`optimizer` must not have been used yet: wrap it before training (its state would be "
                          f"lost). Received: an optimizer at iteration {int(optimizer.iterations.numpy())}")
    return host_optimizer_config([optimizer], strategy.sparse), _PSUpdate if package.__name__ == "keras" else \
        _PSApplyGradients


def _adopt(strategy: Any, optimizer: Any) -> None:
    """Turn ``optimizer`` (made in ``strategy.scope()``) into one whose variables and
    slots live on the ps, in place: the object the script holds is the one that trains."""
    config, methods = _checked(strategy, optimizer)
    optimizer.__class__ = _ps_class(optimizer, methods)
    optimizer._hostreduce_exchange = _Exchange(strategy, config)


@contextlib.contextmanager
def variable_scope(strategy: Any) -> Iterator[None]:
    """Variables created in this block (a Keras model) as the ps will hold them: each
    table the ps split by rows as a row cache of the batch's rows (never whole on a
    worker, its initial value computed only by the chief)."""
    from ..host.variables import VariableStore

    store = VariableStore(on_host=True)
    building = [True]

    def fill(cache: Any, ids: Any) -> Any:
        # Lookups traced in the block too (``fit`` inside it) pull their rows first; one
        # run in the block before any optimizer connected the job (a model called on a
        # sample batch to build it) has nothing to pull yet and reads the spare row.
        if building[0] and _state(strategy).exchange is None:
            return np.int64(0)
        return _connected(strategy).fill(cache, ids)

    shard_tables(store, len(strategy.cluster.ps_addresses), strategy.shard_bytes, fill=fill)
    made: list[Any] = []  # Keras optimizers made in the block
    try:
        with store.scope(), _optimizers_made(made), _compiled_for(strategy, made), _take_rows():
            yield
    finally:
        building[0] = False
    made = [o for i, o in enumerate(made) if not hasattr(o, "_hostreduce_exchange")
            and not any(p is o for p in made[:i])]
    if made:  # a custom loop's optimizer: it applies on the ps (a ps task serves here)
        training_task(strategy, "an optimizer made in strategy.scope()")
        for optimizer in made:
            _adopt(strategy, optimizer)
    caches = row_caches(store)
    state = _state(strategy)
    if caches and state.lookups is None:
        # Lookups in the train step, traced later, must read the caches' rows (Keras 3's
        # take reads a variable whole): kept for the life of the process, on this thread.
        state.lookups = contextlib.ExitStack()
        state.lookups.enter_context(_take_rows())


_LEGACY = ("SGD", "Adam", "Adagrad", "RMSprop")


@contextlib.contextmanager
def _optimizers_made(made: list[Any]) -> Iterator[None]:
    """Collect in ``made`` the Keras optimizers constructed in this block (Keras 3's, and
    tf_keras's where it is used); there Keras 3's ``tf.keras.optimizers.legacy.SGD``,
    ``Adam``, ``Adagrad`` and ``RMSprop`` (which it refuses to construct) make its own
    classes, as TensorFlow's parameter-server tutorial writes them."""
    from ..host.keras_files import tf_keras_wanted
    from ..host.patch import routed

    def init(original: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        original(optimizer, *args, **kwargs)
        made.append(optimizer)

    with contextlib.ExitStack() as stack:
        try:
            import keras
        except ImportError:
            keras = None
        if keras is not None:
            stack.enter_context(routed(keras.optimizers.Optimizer, "__init__", init))
            legacy = getattr(keras.optimizers, "legacy", None)
            for name in _LEGACY if legacy is not None else ():
                if isinstance(getattr(legacy, name, None), type):
                    made_by = (lambda name: lambda original, *a, **k: getattr(keras.optimizers, name)(*a, **k))(name)
                    stack.enter_context(routed(legacy, name, made_by))
        if tf_keras_wanted():
            from ..host.kerases import optimizer_bases

            try:
                import tf_keras
            except ImportError:
                tf_keras = None
            for base in optimizer_bases(tf_keras) if tf_keras is not None else ():
                stack.enter_context(routed(base, "__init__", init))
        yield


@contextlib.contextmanager
def _compiled_for(strategy: Any, made: list[Any]) -> Iterator[None]:
    """``model.compile(optimizer, ...)`` in the block (Keras 3 or tf_keras), as
    TensorFlow's ``ParameterServerStrategy`` scripts write it: the optimizer becomes
    ``strategy.keras_optimizer(optimizer)``, or, made in the block, trains on the ps
    itself (on a ps task: serve until the chief ends the job); Keras 3's
    ``jit_compile="auto"`` becomes False (the step's host op is not XLA's)."""
    import importlib

    from ..host.keras_files import model_classes
    from ..host.patch import routed

    def compile_of(package: str) -> Any:  # the Keras whose Model class is routed
        def compile(original: Any, model: Any, optimizer: Any = "rmsprop", *args: Any, **kwargs: Any) -> Any:
            if not hasattr(optimizer, "_hostreduce_exchange"):
                optimizer = importlib.import_module(package).optimizers.get(optimizer)
                if any(o is optimizer for o in made):  # made in the scope: it trains in place
                    training_task(strategy, "model.compile")
                    _adopt(strategy, optimizer)
                else:
                    optimizer = keras_optimizer(strategy, optimizer)
            if package == "keras" and kwargs.get("jit_compile", "auto") == "auto" and len(args) < 7:
                kwargs["jit_compile"] = False
            _files_from_the_chief(strategy, model)
            return original(model, optimizer, *args, **kwargs)

        return compile

    with contextlib.ExitStack() as stack:
        for owner in model_classes():  # Kerases imported inside the block too
            package = "tf_keras" if owner.__module__.split(".", 1)[0] == "tf_keras" else "keras"
            stack.enter_context(routed(owner, "compile", compile_of(package)))
        yield


def _files_from_the_chief(strategy: Any, model: Any) -> None:
    """Keras's ``BackupAndRestore`` and ``ModelCheckpoint`` of ``model`` write from the
    chief alone (every worker holds the ps's values): ``hostreduce/host/keras_files.py``."""
    from ..host import keras_files

    state = _state(strategy)
    state.models.add(model)
    if state.callbacks is None:
        def barrier() -> None:
            if strategy.sync and strategy.size > 1:  # sync jobs' training tasks form a ring
                strategy.reducer.barrier(strategy.timeout_s)

        state.callbacks = keras_files.install(lambda m: m in state.models, lambda: bool(strategy.is_chief), barrier,
                                              tf_keras_chief_only=True)


@contextlib.contextmanager
def _take_rows() -> Iterator[None]:
    from ..host.patch import routed
    from .rowcache import keras_take

    try:
        from keras.src.backend.tensorflow import numpy as knp
    except ImportError:
        yield
        return
    with routed(knp, "take", keras_take):
        yield


def release_lookups(strategy: Any) -> None:
    """Stop routing Keras lookups to ``strategy``'s row caches (a process keeps the route
    for its life once a model was built in the strategy's scope)."""
    state = _states.get(strategy)
    if state is not None and state.lookups is not None:
        state.lookups.close()
        state.lookups = None


def _connected(strategy: Any) -> _Exchange:
    exchange = _state(strategy).exchange
    if exchange is None:
        raise ConfigError("A model built in `ParameterServerStrategy.scope()` reads its tables from the parameter "
                          "servers: compile it with `strategy.keras_optimizer(...)` and train it first")
    return exchange


def pull_variables(strategy: Any) -> dict[str, np.ndarray]:
    """Every variable of the model trained through ``strategy.keras_optimizer``, as the
    ps hold it, by its Keras path; tables split by rows whole (a full copy each)."""
    exchange = _connected(strategy)
    values = exchange.strategy.job.client.pull(exchange.keys)
    return {key.split(":", 1)[1]: value for key, value in values.items()}
