"""Rank code for ``tests/test_horovod_accumulation.py``: gradient aggregation over
``backward_passes_per_step`` passes (Keras wrapper in ``tf.function`` and eagerly, TF1
optimizer eagerly and in a Session graph), local layers (``PartialDistributedGradientTape``,
``PartialDistributedOptimizer``), ``SyncBatchNormalization`` and the callback's local
variables, in the shapes of Horovod's own tests. Each check returns plain values for the
test to compare."""
from __future__ import annotations

import os
from typing import Any

import numpy as np

PASSES = 4
STEPS = 10


def _testing_optimizer(keras: Any) -> Any:
    class TestingOptimizer(keras.optimizers.Optimizer):
        """Adds the gradient to the variable (Horovod's test optimizer)."""

        def __init__(self, learning_rate: float = 0.1, name: str = "test", **kwargs: Any) -> None:
            super().__init__(learning_rate=learning_rate, name=name, **kwargs)

        def update_step(self, gradient: Any, variable: Any, learning_rate: Any = None) -> None:
            variable.assign_add(gradient)

    return TestingOptimizer()


def keras_aggregation(average: bool, traced: bool) -> dict:
    """Horovod's test_gradient_aggregation: x - y[0], 10 passes of 4."""
    import keras
    import tensorflow as tf

    import hostreduce.horovod.keras as hvd

    opt = hvd.DistributedOptimizer(_testing_optimizer(keras), backward_passes_per_step=PASSES,
                                   average_aggregated_gradients=average, sparse_as_dense=True)
    x, y = tf.Variable([0.0]), tf.Variable([1.0, 2.0])

    def loss() -> Any:
        return x - tf.gather(y, [0])  # an IndexedSlices gradient for y

    def step() -> None:
        opt.apply_gradients(opt._compute_gradients(loss, var_list=[x, y]))

    run = tf.function(step) if traced else step
    values, iterations = [], []
    for _ in range(STEPS):
        run()
        values.append([float(x.numpy()[0]), *map(float, y.numpy())])
        iterations.append(int(opt.iterations.numpy()))
    return {"values": values, "iterations": iterations, "counter": int(opt._agg_helper.counter.numpy())}


def keras_fit_aggregation(rank: int) -> dict:
    """fit() with backward_passes_per_step=2 on rank-dependent data: every rank ends with
    the same weights, updated once per two batches."""
    import keras
    import tensorflow as tf

    import hostreduce.horovod.keras as hvd

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    model.compile(optimizer=opt, loss="mse")
    data = np.random.default_rng(rank).random((8, 3)).astype(np.float32)
    model.fit(data, data[:, :1], batch_size=2, epochs=1, verbose=0, shuffle=False)
    return {"kernel": model.layers[0].kernel.numpy().ravel().tolist(), "iterations": int(opt.iterations.numpy()),
            "counter": int(opt._agg_helper.counter.numpy())}


def partial(rank: int, size: int) -> dict:
    """Horovod's test_partial_distributed_gradient_tape / _optimizer with 0, 1, 2 local layers."""
    import tensorflow as tf

    import hostreduce.horovod as hvd
    import hostreduce.horovod.keras as hvd_keras

    out = {}
    for local in range(3):
        init = tf.keras.initializers.Constant(rank)
        model = tf.keras.Sequential([tf.keras.Input((3,)),
                                     tf.keras.layers.Dense(2, kernel_initializer=init, bias_initializer=init),
                                     tf.keras.layers.RepeatVector(3),
                                     tf.keras.layers.TimeDistributed(tf.keras.layers.Dense(
                                         3, kernel_initializer=init, bias_initializer=init))])
        x = np.full((1, 3), 0.5, np.float32)
        target = np.full((1, 3, 3), 0.25, np.float32)
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - target))
        plain = tape.gradient(loss, model.trainable_weights)
        layers = model.layers[:local]
        local_vars = [v for layer in layers for v in layer.trainable_weights]
        partial_tape = hvd.PartialDistributedGradientTape(tape, local_layers=layers)
        reduced = partial_tape.gradient(loss, model.trainable_weights)
        local_pairs, global_pairs = partial_tape.get_local_and_global_gradients(loss, model.trainable_weights)
        opt = hvd_keras.PartialDistributedOptimizer(tf.keras.optimizers.Adam(), sparse_as_dense=True,
                                                    local_layers=layers)
        from_opt = [g for g, _ in opt._compute_gradients(loss, model.trainable_weights, tape=tape)]
        expected = [p / size if any(v is w for w in local_vars) else hvd.allreduce(p)
                    for v, p in zip(model.trainable_weights, plain)]
        out[local] = {
            "tape": all(np.allclose(g, e) for g, e in zip(reduced, expected)),
            "optimizer": all(np.allclose(g, e) for g, e in zip(from_opt, expected)),
            "split": (len(local_pairs), len(global_pairs)),
            "split_locals": all(any(s is v for v in local_vars) for s, _ in local_pairs),
        }
    return out


def sync_batch_norm(rank: int, size: int) -> dict:
    """Horovod's test_horovod_syncbn_cpu: a rank's slice through SyncBatchNormalization
    equals its rows of BatchNormalization on every rank's rows; eagerly and traced."""
    import tensorflow as tf

    import hostreduce.horovod as hvd

    out = {}
    for traced in (False, True):
        rows = np.stack([np.array([[r, r + 1], [r * 2, r * 2 + 1], [r * 3, r * 3 + 1], [r * 4, r * 4 + 1]],
                                  np.float32) for r in range(size)])
        bn = tf.keras.layers.BatchNormalization(axis=1)
        sync_bn = hvd.SyncBatchNormalization(axis=1, fused=False)
        full = bn(rows, training=True).numpy()
        call = tf.function(lambda t: sync_bn(t, training=True)) if traced else (lambda t: sync_bn(t, training=True))
        mine = call(tf.expand_dims(rows[rank], 0)).numpy()
        out[traced] = {"outputs": bool(np.allclose(mine, full[rank:rank + 1], atol=1e-4)),
                       "moving_mean": bool(np.allclose(sync_bn.moving_mean.numpy(), bn.moving_mean.numpy())),
                       "moving_variance": bool(np.allclose(sync_bn.moving_variance.numpy(),
                                                           bn.moving_variance.numpy(), atol=1e-4))}
    return out


def tf1_eager(rank: int) -> list[float]:
    import tensorflow as tf

    import hostreduce.horovod as hvd

    v = tf.Variable([1.0])
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0))
    opt.minimize(lambda: tf.reduce_sum(v * float(rank + 1)), var_list=[v])
    return v.numpy().tolist()


def tf1_graph(rank: int) -> Any:
    """minimize() in a TF1 graph run by a Session, 2 passes per step, averaged: the value
    after each run and the global step."""
    import tensorflow as tf

    import hostreduce.horovod as hvd

    graph = tf.Graph()
    with graph.as_default():
        v = tf.compat.v1.get_variable("v", initializer=tf.constant([1.0, 2.0]))
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                                       backward_passes_per_step=2, average_aggregated_gradients=True)
        train = opt.minimize(tf.reduce_sum(v * float(rank + 1)), global_step=step)
        values = []
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            for _ in range(4):
                session.run(train)
                values.append((session.run(v).tolist(), int(session.run(step))))
        return values


def callback_local_variables(rank: int, size: int) -> bool:
    """Horovod's test_broadcast_global_variables_callback_with_local_vars."""
    import tensorflow as tf

    import hostreduce.horovod.keras as hvd

    root = size - 1
    init = tf.keras.initializers.Constant(rank)
    model = tf.keras.Sequential([tf.keras.Input((3,))] + [
        tf.keras.layers.Dense(3, kernel_initializer=init, bias_initializer=init, trainable=False) for _ in range(3)])
    model.compile(loss="mse", optimizer="sgd")
    local = list(model.layers[0].variables)
    model.fit(np.ones((1, 3)), np.ones((1, 3)), verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank=root, local_variables=local)])
    return all(np.allclose(v.numpy(), rank if any(v is w for w in local) else root) for v in model.variables)


def elastic_state(rank: int) -> dict[str, bool]:
    """Horovod's ``test_elastic_state`` shapes (``test_tensorflow2_keras.py``'s KerasState and
    ``test_tensorflow.py``'s TensorFlowState) in a fixed job: sync takes rank 0's values,
    restore undoes what came after the last commit, commit keeps it."""
    import tensorflow as tf

    import hostreduce.horovod as hvd
    import hostreduce.horovod.keras as hvd_keras

    v = 1.0 if rank == 0 else 2.0
    model1 = tf.keras.Sequential([tf.keras.layers.Dense(2, activation="softmax")])
    model1.build((2, 2))
    model1.set_weights([np.array([[v, v], [v, v]], np.float32), np.array([v, v], np.float32)])
    other = [np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), np.array([0.0, 0.0], np.float32)]
    state = hvd_keras.elastic.KerasState(model1, tf.optimizers.Adam(0.001), batch=20 + rank, epoch=10 + rank)
    state.sync()
    synced = model1.get_weights()
    out = {"keras_sync": all(np.allclose(w, 1.0) for w in synced) and (state.batch, state.epoch) == (20, 10)}
    model1.set_weights(other)
    state.batch, state.epoch = 21, 11
    state.restore()
    out["keras_restore"] = (all(np.allclose(a, b) for a, b in zip(model1.get_weights(), synced))
                            and (state.batch, state.epoch) == (20, 10))
    model1.set_weights(other)
    state.batch, state.epoch = 21, 11
    state.commit()
    state.restore()
    out["keras_commit"] = (all(np.allclose(a, b) for a, b in zip(model1.get_weights(), other))
                           and (state.batch, state.epoch) == (21, 11))
    variables = [tf.Variable(np.full((2, 2), v)), tf.Variable(np.full((2,), v))]
    tstate = hvd.elastic.TensorFlowState(variables, batch=20 + rank, epoch=10 + rank)
    tstate.sync()
    out["tf_sync"] = all(np.allclose(x.numpy(), 1.0) for x in variables) and tstate.batch == 20
    variables[0].assign(other[0])
    tstate.batch = 21
    tstate.commit()
    variables[0].assign(np.zeros((2, 2)))
    tstate.restore()
    out["tf_commit"] = np.allclose(variables[0].numpy(), other[0]) and tstate.batch == 21
    return out


def rank_main(rank: int, size: int) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import hostreduce.horovod as hvd

    hvd.init()
    return {
        "keras_aggregation": {(avg, traced): keras_aggregation(avg, traced)
                              for avg in (False, True) for traced in (True, False)},
        "fit": keras_fit_aggregation(rank),
        "partial": partial(rank, size),
        "sync_bn": sync_batch_norm(rank, size),
        "tf1_eager": tf1_eager(rank),
        "tf1_graph": tf1_graph(rank),
        "callback": callback_local_variables(rank, size),
        "elastic": elastic_state(rank),
    }
