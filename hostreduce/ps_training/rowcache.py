"""A worker's stand-in for an embedding table the parameter servers shard by rows: a
variable that holds only the rows of the current batch, never the whole table.

A worker of a ps job looks up a handful of rows of a table that may not fit in its
memory. :class:`RowCache` is the ``tf.Variable`` ``model_fn`` receives for such a
table: its value is the batch's distinct rows (plus one spare row), and ``keys`` their
global ids, sorted. A lookup (``tf.gather``, ``tf.nn.embedding_lookup``, tf_keras's
``Embedding``: all end in ``sparse_read``; Keras 3's ``Embedding`` through
:func:`keras_take`) maps global ids to cache slots with ``searchsorted`` and gathers
there, so its gradient is an ``IndexedSlices`` over cache slots that
:meth:`RowCache.to_global` turns back into global row ids for the ps.

The spare last row has the key ``int64`` max: every id then finds a slot inside the
cache, also when a trace runs before the first fill (the lookup-ids function is traced
and may run on a stale cache; its gathered values are never used).

Each lookup records its global ids while ``model_fn`` is traced (:attr:`looked_up`),
which is how the worker learns the rows a batch needs before it runs the step. Where
the step cannot be known before it runs (Keras ``fit``), :attr:`step_fill` is set: each
lookup then first runs a host op that pulls its rows into the cache.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator

import numpy as np

from ..errors import SpecError
from ..host.patch import routed
from ..host.variables import LOCAL_COLLECTIONS, Deferred, VariableStore, requested_shape
from ..ps.placement import is_sharded
from .initial_rows import initial_value_in_rows

__all__ = ["shard_tables", "row_caches", "RowCacheFactory", "row_cache", "row_cache_type", "is_row_cache", "keras_take", "deferred_keras_init"]

_SPARE = np.iinfo(np.int64).max


def _row_cache_class() -> type:
    import tensorflow as tf
    from tensorflow.python.ops import resource_variable_ops

    class RowCache(resource_variable_ops.ResourceVariable):
        """The rows of the current batch of a table of ``full_shape`` (global ids in ``keys``)."""

        def _init_cache(self, full_shape: tuple[int, ...], initial: Any, keys: Any) -> None:
            self.full_shape = full_shape
            self.initial = initial      # the table's initial value (callable or array) until the ps hold it
            self.keys = keys            # sorted global ids of the cached rows, then the spare key
            self.looked_up: list[Any] = []
            self.keys_numpy = np.array([_SPARE], np.int64)
            self.step_fill: Callable[[Any], Any] | None = None  # ids -> rows pulled into the cache

        def sparse_read(self, indices: Any, name: Any = None) -> Any:
            ids = tf.cast(indices, tf.int64)
            self.looked_up.append(ids)
            with contextlib.ExitStack() as stack:
                if self.step_fill is not None:
                    fill = self.step_fill
                    filled = tf.py_function(lambda i: fill(i.numpy()), [tf.reshape(ids, [-1])], tf.int64,
                                            name="hostreduce_fill_rows")
                    stack.enter_context(tf.control_dependencies([filled]))
                slots = tf.searchsorted(self.keys.read_value(), tf.reshape(ids, [-1]), out_type=tf.int64)
                return super().sparse_read(tf.reshape(slots, tf.shape(ids)), name=name)

        def fill(self, ids: np.ndarray, rows: np.ndarray) -> None:
            """Cache ``rows``, the table's rows at the sorted distinct ``ids``."""
            spare = np.zeros((1,) + tuple(self.full_shape[1:]), rows.dtype)
            self.keys_numpy = np.concatenate([np.asarray(ids, np.int64), [_SPARE]])
            self.keys.assign(self.keys_numpy)
            self.assign(np.concatenate([rows, spare]))

        def to_global(self, slots: np.ndarray) -> np.ndarray:
            """The global row ids of cache ``slots`` (a gradient's indices)."""
            return self.keys_numpy[np.asarray(slots, np.int64)]

        def initial_value_numpy(self) -> np.ndarray:
            """The table's initial value, computed now if it was deferred (a transient
            full copy in numpy, on the chief only, while it registers the table on the
            ps; TensorFlow computes it by blocks of rows, see ``initial_rows.py``)."""
            if callable(self.initial):
                return initial_value_in_rows(self.initial, self.full_shape, self.dtype, self.name)
            value = self.initial
            return np.asarray(value.numpy() if hasattr(value, "numpy") else value).reshape(self.full_shape)

    return RowCache


_CLASS: list[type] = []


def row_cache_type() -> type:
    """The ``RowCache`` class (defined on first use: it subclasses a TensorFlow class)."""
    if not _CLASS:
        _CLASS.append(_row_cache_class())
    return _CLASS[0]


def is_row_cache(variable: Any) -> bool:
    return bool(_CLASS) and isinstance(getattr(variable, "_value", variable), _CLASS[0])


def row_cache(full_shape: tuple[int, ...], dtype: Any, initial: Any, name: str) -> Any:
    """A :class:`RowCache` for a table of ``full_shape`` (created eagerly, on the host)."""
    import tensorflow as tf
    from tensorflow.python.ops import resource_variable_ops

    # Built directly, not through tf.Variable: no variable creator (the store's,
    # tf.function's) sees these, and they live outside any trace.
    with tf.init_scope(), tf.device("/CPU:0"):
        keys = resource_variable_ops.ResourceVariable(np.array([_SPARE], np.int64), shape=tf.TensorShape([None]),
                                                      trainable=False, name=f"{name}_rows")
        cache = row_cache_type()(initial_value=tf.zeros((1,) + tuple(full_shape[1:]), dtype),
                         shape=tf.TensorShape([None] + list(full_shape[1:])), trainable=True, name=name)
    cache._init_cache(tuple(int(d) for d in full_shape), initial, keys)
    return cache


def keras_take(original: Any, x: Any, indices: Any, axis: Any = None) -> Any:
    """Keras 3's ``ops.take`` (TensorFlow backend): a row lookup on a :class:`RowCache`
    goes to its ``sparse_read`` (Keras would read the variable whole first)."""
    import tensorflow as tf

    value = getattr(x, "_value", x)
    if not is_row_cache(value):
        return original(x, indices, axis=axis)
    if axis != 0 or isinstance(indices, (tf.SparseTensor, tf.RaggedTensor)):
        raise SpecError(f"A table the parameter servers split by rows ({value.name!r}, shape {list(value.full_shape)}) "
                        "can be read on a worker only by rows: `ops.take(table, dense_ids, axis=0)`, as Embedding "
                        f"does. Received: axis={axis!r}, indices of type {type(indices).__name__}")
    return value.sparse_read(indices)


def _deferred_init(original: Any, variable: Any, initializer: Any) -> None:
    shape, dtype = variable._shape, variable._dtype
    variable._initialize(Deferred(lambda: initializer(shape, dtype=dtype), shape, dtype))


@contextlib.contextmanager
def deferred_keras_init() -> Iterator[None]:
    """Inside this block Keras 3 variables hand ``tf.Variable`` a :class:`Deferred`
    initial value (shape and dtype readable before anything is computed), and
    ``ops.take`` on a :class:`RowCache` reads only its rows."""
    with contextlib.ExitStack() as stack:
        try:
            from keras.src.backend.tensorflow import core, numpy as knp
        except ImportError:  # no Keras 3, or another backend
            yield
            return
        stack.enter_context(routed(core.Variable, "_initialize_with_initializer", _deferred_init))
        stack.enter_context(routed(knp, "take", keras_take))
        yield


class RowCacheFactory:
    """Creates every new trained float variable the ps would shard over ``num_ps``
    (``shard_bytes``, see ``hostreduce.ps.placement``) as a row cache (a
    :class:`~hostreduce.host.variables.VariableFactory`)."""

    def __init__(self, num_ps: int, shard_bytes: int, fill: Callable[[Any, Any], Any] | None = None) -> None:
        self.num_ps, self.shard_bytes, self.fill = num_ps, shard_bytes, fill

    def scope(self) -> ContextManager[None]:
        return deferred_keras_init()

    def create(self, key: str, kwargs: dict[str, Any]) -> tuple[Any, list[Any]] | None:
        import tensorflow as tf

        # Only trained variables are on the ps; a frozen table stays whole on the worker.
        if kwargs.get("trainable") is False or set(kwargs.get("collections") or ()) & LOCAL_COLLECTIONS:
            return None
        shape = requested_shape(kwargs)
        value = kwargs.get("initial_value")
        dtype = kwargs.get("dtype") or getattr(value, "dtype", None)
        if shape is None or not shape.is_fully_defined() or dtype is None:
            return None
        dtype = tf.as_dtype(dtype)
        if not dtype.is_floating or not is_sharded(shape.as_list(), dtype.size, self.num_ps, self.shard_bytes):
            return None
        # A callable initial value (Keras's Deferred, tf_keras's and tf.compat.v1's
        # initializers) is computed later, on the chief only.
        cache = row_cache(tuple(shape.as_list()), dtype.base_dtype, value, key.replace("/", "_"))
        if self.fill is not None:
            fill = self.fill
            cache.step_fill = lambda ids: fill(cache, ids)
        return cache, [cache.keys]


def shard_tables(store: VariableStore, num_ps: int, shard_bytes: int,
                 fill: Callable[[Any, Any], Any] | None = None) -> None:
    """Make ``store`` create the tables the ps shard by rows as row caches; ``fill(cache,
    ids)``, where given, becomes each cache's ``step_fill``."""
    store.set_factory(RowCacheFactory(num_ps, shard_bytes, fill))


def row_caches(store: VariableStore) -> dict[str, Any]:
    """The row caches of ``store`` by key (tables the ps hold; this process has only some rows)."""
    return store.made_by_factory()
