"""A table the parameter servers shard by rows is a row cache on a worker
(``hostreduce/ps_training/rowcache.py``): every way ``model_fn`` looks rows up (Keras 3 and
tf_keras ``Embedding``, ``tf.gather``, ``tf.nn.embedding_lookup`` on a
``tf.compat.v1.get_variable``) reads the cached rows at their global ids, the gradient
names global rows again, the initial value is the one an ordinary variable gets, and
small variables stay ordinary variables."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.tf

ROWS, DIM = 500, 4   # 8000 bytes: sharded with shard_bytes=4000 over 2 ps


def _layers(api: str):
    """``(build, lookup)`` for one way of writing an embedding lookup."""
    import tensorflow as tf

    if api == "keras3":
        import keras

        def build():
            return keras.layers.Embedding(ROWS, DIM, embeddings_initializer=keras.initializers.RandomUniform(seed=1),
                                          name="emb")
        return build, lambda emb, ids: emb(ids), lambda emb: emb.embeddings
    if api == "tf_keras":
        tf_keras = pytest.importorskip("tf_keras")

        def build():
            return tf_keras.layers.Embedding(ROWS, DIM, embeddings_initializer=tf_keras.initializers.RandomUniform(
                seed=1), name="emb")
        return build, lambda emb, ids: emb(ids), lambda emb: emb.embeddings

    def build():
        with tf.compat.v1.variable_scope(api, reuse=tf.compat.v1.AUTO_REUSE):  # tf.function traces twice
            return tf.compat.v1.get_variable("emb", shape=(ROWS, DIM), initializer=tf.compat.v1.ones_initializer())
    if api == "gather":
        return build, lambda v, ids: tf.gather(v, ids), lambda v: v
    return build, lambda v, ids: tf.nn.embedding_lookup(v, ids), lambda v: v


def _traced(api: str, store):
    import tensorflow as tf

    from hostreduce.host.gradients import sparse_gradients

    build, lookup, variable = _layers(api)
    made = {}

    def step(ids):
        with store.scope(), tf.GradientTape() as tape, sparse_gradients():
            layer = build()
            small = tf.Variable(tf.ones((DIM,)), name="small")
            loss = tf.reduce_sum(lookup(layer, ids) * small * tf.range(1, DIM + 1, dtype=tf.float32))
        made["table"] = variable(layer)
        return tape.gradient(loss, [made["table"], small])

    function = tf.function(step, input_signature=[tf.TensorSpec([None, 3], tf.int64)], autograph=False)
    function.get_concrete_function()
    return function, made["table"]


@pytest.mark.parametrize("api", ["keras3", "tf_keras", "gather", "embedding_lookup"])
def test_lookups_read_the_cached_rows_at_global_ids(api: str) -> None:
    import tensorflow as tf

    from hostreduce.ps_training.rowcache import is_row_cache
    from hostreduce.host.variables import VariableStore
    from hostreduce.ps_training.rowcache import row_caches, shard_tables

    store = VariableStore()
    shard_tables(store, 2, 4000)
    function, _ = _traced(api, store)
    caches = row_caches(store)
    assert list(caches) and all(is_row_cache(v) for v in caches.values()), store.items()
    assert [k for k, v in store.items() if k not in caches] == ["small"]  # small variables stay whole
    cache = next(iter(caches.values()))
    assert tuple(cache.shape) != (ROWS, DIM) and cache.full_shape == (ROWS, DIM)

    table = np.random.default_rng(0).normal(size=(ROWS, DIM)).astype(np.float32)
    ids = np.array([[7, 480, 7], [3, 99, 480]], np.int64)
    uniq = np.unique(ids)
    cache.fill(uniq, table[uniq])
    assert cache.numpy().shape == (len(uniq) + 1, DIM)  # the batch's rows and the spare one

    grad, _ = function(tf.constant(ids))
    assert isinstance(grad, tf.IndexedSlices)
    got_ids = cache.to_global(grad.indices.numpy())
    np.testing.assert_array_equal(np.sort(got_ids), np.sort(ids.reshape(-1)))
    np.testing.assert_allclose(grad.values.numpy(), np.tile(np.arange(1, DIM + 1, dtype=np.float32), (6, 1)))

    # the looked-up values are the table's rows: d(loss)/d(small) sums them
    _, small_grad = function(tf.constant(ids))
    expected = table[ids.reshape(-1)].sum(axis=0) * np.arange(1, DIM + 1)
    np.testing.assert_allclose(small_grad.numpy(), expected, rtol=1e-5)


@pytest.mark.parametrize("api", ["keras3", "tf_keras"])
def test_the_initial_value_is_an_ordinary_variables_and_computed_on_demand(api: str) -> None:
    from hostreduce.host.variables import VariableStore
    from hostreduce.ps_training.rowcache import row_caches, shard_tables

    sharded, whole = VariableStore(), VariableStore()
    shard_tables(sharded, 2, 4000)
    _, cache = _traced(api, sharded)
    _, variable = _traced(api, whole)
    cache = getattr(cache, "_value", cache)
    assert callable(cache.initial)  # nothing computed until the chief registers the table
    np.testing.assert_array_equal(cache.initial_value_numpy(), np.asarray(variable))


def test_only_trained_variables_the_ps_would_split_become_row_caches() -> None:
    import tensorflow as tf

    from hostreduce.host.variables import VariableStore
    from hostreduce.ps_training.rowcache import row_caches, shard_tables

    store = VariableStore()
    shard_tables(store, 2, 4000)
    with store.scope():
        tf.Variable(tf.zeros((ROWS, DIM)), name="table")
        tf.Variable(tf.zeros((ROWS, DIM)), trainable=False, name="frozen")   # not on the ps
        tf.Variable(tf.zeros((1, 2000)), name="wide")                        # fewer rows than ps
        tf.Variable(tf.zeros((ROWS, DIM), tf.int32), name="ids")             # not a float table
    assert list(row_caches(store)) == ["table"]
    assert [k for k, _ in store.items()] == ["table", "frozen", "wide", "ids"]


def test_a_model_reading_a_row_cache_is_not_exported(tmp_path) -> None:
    import tensorflow as tf

    from hostreduce.errors import ConfigError
    from hostreduce.estimator.export import write_saved_model
    from hostreduce.host.variables import VariableStore
    from hostreduce.ps_training.rowcache import row_caches, shard_tables

    store = VariableStore()
    shard_tables(store, 2, 4000)
    with store.scope():
        table = tf.Variable(tf.zeros((ROWS, DIM)), name="table")
    predict = tf.function(lambda ids: tf.gather(table, ids), autograph=False)
    with pytest.raises(ConfigError, match="row-cached tables"):
        write_saved_model(predict, tf.TensorSpec([None], tf.int64), [], str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_keras_take_on_a_row_cache_reads_rows_only() -> None:
    import keras
    import tensorflow as tf

    from hostreduce.errors import SpecError
    from hostreduce.host.variables import VariableStore
    from hostreduce.ps_training.rowcache import row_caches, shard_tables

    store = VariableStore()
    shard_tables(store, 2, 4000)
    with store.scope():
        emb = keras.layers.Embedding(ROWS, DIM, name="emb")
        emb.build()
        cache = emb.embeddings._value
        cache.fill(np.array([5, 9]), np.array([[1.0] * DIM, [2.0] * DIM], np.float32))
        np.testing.assert_array_equal(keras.ops.take(emb.embeddings, tf.constant([9, 5, 9]), axis=0).numpy()[:, 0],
                                      [2.0, 1.0, 2.0])
        with pytest.raises(SpecError, match="only by rows"):
            keras.ops.take(emb.embeddings, tf.constant([1]), axis=1)
