"""Rank functions for tests/test_horovod_api.py: every ``hostreduce.horovod`` op, eagerly
and in ``tf.function``, against numpy references; ``DistributedGradientTape`` training
of a small Keras model with an Embedding; the streaming timeline; errors.

The same checks run under the spawn harness (ring, ``TF_CONFIG``) and as a script under
``mpirun`` (``python hvd_api.py OUT_DIR``): each rank then writes its results to
``OUT_DIR/rank{r}.npz``.
"""
from __future__ import annotations

import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

GLOBAL_BATCH = 16
STEPS = 3
# (optimizer, sparse_as_dense) of the training runs.
TRAININGS = (("sgd", False), ("adam", False), ("adam", True))
# At 4 workers and under mpirun: the IndexedSlices path with Adam (the suite's time is
# bounded).
TRAININGS_SHORT = (("adam", False),)


def _base(rank: int) -> np.ndarray:
    return (np.arange(12, dtype=np.float32).reshape(3, 4) + 1.0) * (rank + 1)


def _close(actual, expected, what: str, rtol: float = 1e-6) -> None:
    actual = actual.numpy() if hasattr(actual, "numpy") else np.asarray(actual)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=0, err_msg=what)
    assert actual.dtype == np.asarray(expected).dtype, f"{what}: dtype {actual.dtype}"


def check_ops(rank: int, size: int) -> int:
    """Every op, eagerly and in a tf.function; returns the number of checks."""
    import tensorflow as tf

    import hostreduce.horovod as hvd

    x = tf.constant(_base(rank))
    one = _base(0)
    total = one * (size * (size + 1) / 2)
    sparse = tf.IndexedSlices(tf.constant(_base(rank)[:2]), tf.constant([rank % 3, 2], tf.int64),
                              dense_shape=tf.constant([3, 4], tf.int64))
    dense_sparse = sum(_dense(r) for r in range(size)) / size
    variable = tf.Variable(x)

    def ops():
        return {
            "mean": hvd.allreduce(x),
            "sum": hvd.allreduce(x, op=hvd.Sum),
            "min": hvd.allreduce(x, op=hvd.Min),
            "max": hvd.allreduce(x, op=hvd.Max),
            "average_false": hvd.allreduce(x, average=False),
            "scaled": hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25),
            "fp16": hvd.allreduce(x, compression=hvd.Compression.fp16),
            "int": hvd.allreduce(tf.constant([rank, 1], tf.int32), op=hvd.Sum),
            "named": hvd.allreduce(x, name="named_allreduce"),
            "grouped": hvd.grouped_allreduce([x, 2.0 * x], op=hvd.Sum),
            "gather": hvd.allgather(tf.fill([rank + 1, 2], float(rank))),
            "gather_scalar": hvd.allgather(tf.constant(rank, tf.int64)),
            "bcast": hvd.broadcast(x, root_rank=size - 1),
            "sparse": hvd.allreduce(sparse),
        }

    def check(out, mode: str) -> None:
        _close(out["mean"], total / size, f"{mode} mean")
        _close(out["sum"], total, f"{mode} sum")
        _close(out["min"], one, f"{mode} min")
        _close(out["max"], one * size, f"{mode} max")
        _close(out["average_false"], total, f"{mode} average=False")
        _close(out["scaled"], total * 0.5, f"{mode} pre/postscale")
        _close(out["fp16"], total / size, f"{mode} fp16", rtol=2e-3)
        _close(out["int"], np.array([size * (size - 1) // 2, size], np.int32), f"{mode} int32 sum")
        _close(out["named"], total / size, f"{mode} named")
        _close(out["grouped"][0], total, f"{mode} grouped 0")
        _close(out["grouped"][1], 2 * total, f"{mode} grouped 1")
        gathered = np.concatenate([np.full((r + 1, 2), float(r), np.float32) for r in range(size)])
        _close(out["gather"], gathered, f"{mode} allgather")
        _close(out["gather_scalar"], np.arange(size, dtype=np.int64), f"{mode} allgather scalar")
        _close(out["bcast"], _base(size - 1), f"{mode} broadcast")
        assert isinstance(out["sparse"], tf.IndexedSlices), f"{mode} sparse: {type(out['sparse'])}"
        _close(tf.convert_to_tensor(out["sparse"]), dense_sparse.astype(np.float32), f"{mode} IndexedSlices")

    check(ops(), "eager")
    check(tf.function(ops)(), "tf.function")
    hvd.broadcast_variables([variable], root_rank=size - 1)
    _close(variable, _base(size - 1), "eager broadcast_variables")
    variable.assign(x)

    @tf.function
    def broadcast_in_graph():
        hvd.broadcast_variables([variable], root_rank=size - 1)

    broadcast_in_graph()
    _close(variable, _base(size - 1), "tf.function broadcast_variables")
    return 2 * 15 + 2


def _dense(rank: int) -> np.ndarray:
    out = np.zeros((3, 4), np.float32)
    out[rank % 3] += _base(rank)[0]
    out[2] += _base(rank)[1]
    return out


def _global_batch(step: int):
    rng = np.random.default_rng(100 + step)
    tokens = rng.integers(0, 20, size=(GLOBAL_BATCH, 4)).astype(np.int32)
    features = rng.normal(size=(GLOBAL_BATCH, 6)).astype(np.float32)
    labels = rng.integers(0, 3, size=(GLOBAL_BATCH,)).astype(np.int32)
    return tokens, features, labels


def _model_and_optimizer(optimizer: str):
    import keras

    keras.utils.set_random_seed(1234)
    tokens_in = keras.Input((4,), dtype="int32")
    features_in = keras.Input((6,))
    embedded = keras.layers.Flatten()(keras.layers.Embedding(20, 5)(tokens_in))
    hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([embedded, features_in]))
    model = keras.Model([tokens_in, features_in], keras.layers.Dense(3)(hidden))
    opt = keras.optimizers.SGD(0.1) if optimizer == "sgd" else keras.optimizers.Adam(0.01)
    return model, opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def reference(optimizer: str, sparse_as_dense: bool) -> list[np.ndarray]:
    """One process on the global batch, with a plain tf.GradientTape."""
    import tensorflow as tf

    model, opt, loss_fn = _model_and_optimizer(optimizer)

    @tf.function
    def step(tokens, features, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model([tokens, features], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        if sparse_as_dense:
            grads = [tf.convert_to_tensor(g) for g in grads]
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for s in range(STEPS):
        step(*_global_batch(s))
    return [np.array(v.numpy()) for v in model.trainable_variables]


def train(rank: int, size: int, optimizer: str, sparse_as_dense: bool) -> list[np.ndarray]:
    """A few DistributedGradientTape steps; this rank's shard of each global batch."""
    import tensorflow as tf

    import hostreduce.horovod as hvd

    model, opt, loss_fn = _model_and_optimizer(optimizer)
    hvd.broadcast_variables(model.variables, root_rank=0)

    @tf.function
    def step(tokens, features, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model([tokens, features], training=True))
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
        grads = tape.gradient(loss, model.trainable_variables)
        assert sparse_as_dense or size == 1 or isinstance(grads[0], tf.IndexedSlices), type(grads[0])
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    shard = GLOBAL_BATCH // size
    for s in range(STEPS):
        tokens, features, labels = (a[rank * shard:(rank + 1) * shard] for a in _global_batch(s))
        step(tokens, features, labels)
    hvd.broadcast_variables(opt.variables, root_rank=0)  # Keras 3: a property
    return [np.array(v.numpy()) for v in model.trainable_variables]


def streaming(rank: int, size: int, steps: int = 6) -> list[dict]:
    """Train an MLP whose first layer is the most expensive; return the timeline."""
    import keras
    import tensorflow as tf

    import hostreduce.horovod as hvd
    from hostreduce.ops import job as _engine

    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(512, activation="relu", name="first"),
                              keras.layers.Dense(256, activation="relu", name="mid"),
                              keras.layers.Dense(10, name="last")])
    opt = keras.optimizers.SGD(0.01)
    rng = np.random.default_rng(rank)
    x = tf.constant(rng.normal(size=(256, 1024)).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, size=(256,)).astype(np.int32))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with hvd.DistributedGradientTape(tf.GradientTape()) as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for _ in range(steps):
        step(x, y)
    return _engine.job().timeline.events()


def errors(rank: int, size: int) -> dict[str, str]:
    """Mismatched shapes and names, eagerly and in a tf.function; the ring stays usable."""
    import tensorflow as tf

    import hostreduce.horovod as hvd

    out = {}
    try:
        hvd.allreduce(tf.zeros([rank + 2]), name="shape_mismatch")
        out["eager_shape"] = "no error"
    except Exception as e:  # the test inspects the type
        out["eager_shape"] = f"{type(e).__name__}: {e}"
    try:
        tf.function(lambda: hvd.allreduce(tf.zeros([rank + 2]), name="graph_shape_mismatch"))()
        out["graph_shape"] = "no error"
    except Exception as e:  # the test inspects the type
        out["graph_shape"] = f"{type(e).__name__}: {e}"
    try:
        hvd.allreduce(tf.zeros([2]), name=f"only_rank_{rank}")
        out["eager_name"] = "no error"
    except Exception as e:  # the test inspects the type
        out["eager_name"] = f"{type(e).__name__}: {e}"
    out["after"] = str(float(hvd.allreduce(tf.ones([2]), op=hvd.Sum)[0]))
    return out


def rank_main(rank: int, size: int, with_streaming: bool = False, with_errors: bool = False,
              trainings: tuple = TRAININGS) -> dict:
    """What the spawned ranks (ring) run."""
    import hostreduce.horovod as hvd

    hvd.init()
    assert (hvd.rank(), hvd.size()) == (rank, size), (hvd.rank(), hvd.size())
    result: dict = {"checks": check_ops(rank, size)}
    for optimizer, sparse_as_dense in trainings:
        result[(optimizer, sparse_as_dense)] = train(rank, size, optimizer, sparse_as_dense)
    if with_streaming:
        result["timeline"] = streaming(rank, size)
    if with_errors:
        result["errors"] = errors(rank, size)
    hvd.shutdown()
    return result


def main(out_dir: str) -> None:
    """Under mpirun: the ops and the trainings; results to OUT_DIR/rank{r}.npz."""
    import hostreduce.horovod as hvd
    from hostreduce.ops import job as _job

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    check_ops(rank, size)
    arrays = {}
    for optimizer, sparse_as_dense in TRAININGS_SHORT:
        for i, w in enumerate(train(rank, size, optimizer, sparse_as_dense)):
            arrays[f"{optimizer}_{int(sparse_as_dense)}_{i}"] = w
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **arrays)
    print(f"RESULT rank {rank}/{size}: engine={_job.job().strategy.reducer_name} ok", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
