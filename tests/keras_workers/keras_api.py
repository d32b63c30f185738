"""Rank functions for tests/test_keras_api.py: ``model.fit`` with
``hostreduce.horovod.keras.DistributedOptimizer`` (SGD and Adam, variables on the host
or not, a model with an Embedding), a GradientTape loop with
``hostreduce.distribute.all_reduce``, Horovod's callbacks, and the streaming timeline of
``fit``.

The same trainings run under the spawn harness (ring, ``TF_CONFIG``) and as a script
under ``mpirun`` (``python keras_api.py OUT_DIR``): each rank then writes its weights to
``OUT_DIR/rank{r}.npz``.
"""
from __future__ import annotations

import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

GLOBAL_BATCH = 16
STEPS = 3
# (optimizer, variables_on_host) of the fit runs.
FITS = (("sgd", False), ("adam", False), ("sgd", True), ("adam", True))
# At 4 workers and under mpirun: each optimizer and each placement once (the suite's
# time is bounded).
FITS_SHORT = (("sgd", False), ("adam", True))
TAPES = ("adam",)


def _global_batch(step: int):
    rng = np.random.default_rng(200 + step)
    tokens = rng.integers(0, 20, size=(GLOBAL_BATCH, 4)).astype(np.int32)
    features = rng.normal(size=(GLOBAL_BATCH, 6)).astype(np.float32)
    labels = rng.integers(0, 3, size=(GLOBAL_BATCH,)).astype(np.int32)
    return tokens, features, labels


def _data(rank: int, size: int):
    """Every global batch's rows of this rank, batch after batch."""
    shard = GLOBAL_BATCH // size
    parts = [[a[rank * shard:(rank + 1) * shard] for a in _global_batch(s)] for s in range(STEPS)]
    return [np.concatenate([p[i] for p in parts]) for i in range(3)], shard


def _model(optimizer: str, on_host: bool, seed: int = 1234):
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(seed)
    with tf.device("/CPU:0") if on_host else _nothing():
        tokens_in = keras.Input((4,), dtype="int32")
        features_in = keras.Input((6,))
        embedded = keras.layers.Flatten()(keras.layers.Embedding(20, 5)(tokens_in))
        hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([embedded, features_in]))
        model = keras.Model([tokens_in, features_in], keras.layers.Dense(3)(hidden))
    opt = keras.optimizers.SGD(0.1) if optimizer == "sgd" else keras.optimizers.Adam(0.01)
    return model, opt


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


def _weights(model) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in model.trainable_variables]


def reference_fit(optimizer: str) -> list[np.ndarray]:
    """One process, plain Keras, on the global batch."""
    (tokens, features, labels), _ = _data(0, 1)
    model, opt = _model(optimizer, False)
    model.compile(optimizer=opt, loss=_loss())
    model.fit([tokens, features], labels, batch_size=GLOBAL_BATCH, shuffle=False, epochs=1, verbose=0)
    return _weights(model)


def _loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _host_placement(model, opt) -> list[str]:
    """Names of the variables (model's and optimizer's) that are not in host memory."""
    import tensorflow as tf

    away = []
    for v in list(model.variables) + list(opt.variables):
        device = v.value.device
        if not device or tf.DeviceSpec.from_string(device).device_type != "CPU":
            away.append(f"{v.path}@{device}")
    return away


def fit(rank: int, size: int, optimizer: str, on_host: bool) -> dict:
    import hostreduce.horovod.keras as hvd

    (tokens, features, labels), shard = _data(rank, size)
    model, opt = _model(optimizer, on_host)
    opt = hvd.DistributedOptimizer(opt, variables_on_host=on_host)
    model.compile(optimizer=opt, loss=_loss())
    history = model.fit([tokens, features], labels, batch_size=shard, shuffle=False, epochs=1,
                        verbose=0)
    result = {"weights": _weights(model), "loss": history.history["loss"]}
    if on_host:
        result["away"] = _host_placement(model, opt)
        result["slots"] = len(opt.variables)
    return result


def reference_tape(optimizer: str) -> list[np.ndarray]:
    import tensorflow as tf

    model, opt = _model(optimizer, False)
    loss_fn = _loss()

    @tf.function
    def step(tokens, features, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model([tokens, features], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for s in range(STEPS):
        step(*_global_batch(s))
    return _weights(model)


def tape(rank: int, size: int, optimizer: str) -> list[np.ndarray]:
    """A TF Adapter-style custom loop: broadcast, sharded data, all_reduce in the step."""
    import tensorflow as tf

    import hostreduce.distribute as distribute

    model, opt = _model(optimizer, False, seed=1234 + rank)  # different on every rank ...
    distribute.broadcast(model.trainable_variables, root_rank=0)  # ... until broadcast
    loss_fn = _loss()
    batches = [tf.data.Dataset.from_tensor_slices(_global_batch(s)) for s in range(STEPS)]

    @tf.function
    def step(tokens, features, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model([tokens, features], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        assert size == 1 or isinstance(grads[0], tf.IndexedSlices), type(grads[0])
        grads = distribute.all_reduce(grads, reduction="mean")
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for dataset in batches:
        dataset, per_worker = distribute.shard_and_rebatch_dataset(dataset, GLOBAL_BATCH)
        assert per_worker == GLOBAL_BATCH // size
        for tokens, features, labels in dataset.batch(per_worker):
            step(tokens, features, labels)
    return _weights(model)


def _all_reduce_values(rank: int) -> dict:
    import tensorflow as tf

    import hostreduce.distribute as distribute

    x = tf.constant([1.0, 2.0]) * (rank + 1)
    nest = {"a": x, "b": [tf.constant([rank, 1], tf.int32)]}
    out = {r: distribute.all_reduce(nest, reduction=r) for r in ("mean", "sum", "max", "min")}
    graph = tf.function(lambda: distribute.all_reduce([x, 2.0 * x], reduction="sum"))()
    return {"eager": {r: {"a": v["a"].numpy(), "b": v["b"][0].numpy()} for r, v in out.items()},
            "graph": [g.numpy() for g in graph]}


class _Record:
    """Records logs and learning rates (a Keras callback once ``make`` is called)."""

    @staticmethod
    def make(kind: str, store: list):
        import tensorflow as tf

        class Record(tf.keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if kind == "logs":
                    store.append(dict(logs))

            def on_batch_begin(self, batch, logs=None):
                if kind == "lr":
                    store.append(float(self.model.optimizer.learning_rate.numpy()))

        return Record()


def callbacks(rank: int, size: int) -> dict:
    """Broadcast from different initial weights; metric averages; LR warmup/schedule."""
    import hostreduce.horovod.keras as hvd

    (tokens, features, labels), shard = _data(rank, size)
    model, opt = _model("sgd", False, seed=99 + rank)
    initial = _weights(model)
    model.compile(optimizer=hvd.DistributedOptimizer(opt), loss=_loss())
    local, averaged, warmup, schedule = [], [], [], []
    model.fit([tokens, features], labels, batch_size=shard, shuffle=False, epochs=2, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        _Record.make("logs", local),
        hvd.callbacks.MetricAverageCallback(),
        _Record.make("logs", averaged),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2, verbose=1),
        _Record.make("lr", warmup),
    ])
    model.fit([tokens, features], labels, batch_size=shard, shuffle=False, epochs=3, verbose=0, callbacks=[
        hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.2, multiplier=0.5, start_epoch=1),
        _Record.make("lr", schedule),
    ])
    return {"initial": initial, "weights": _weights(model), "local": local, "averaged": averaged,
            "warmup": warmup, "schedule": schedule}


def streaming(rank: int, size: int, steps: int = 6) -> list[dict]:
    """fit() an MLP whose first layer is the most expensive; return the timeline."""
    import keras

    import hostreduce.horovod.keras as hvd
    from hostreduce.ops import job as _engine

    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(512, activation="relu", name="first"),
                              keras.layers.Dense(256, activation="relu", name="mid"),
                              keras.layers.Dense(10, name="last")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss=_loss())
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(256 * steps, 1024)).astype(np.float32)
    y = rng.integers(0, 10, size=(256 * steps,)).astype(np.int32)
    model.fit(x, y, batch_size=256, shuffle=False, epochs=1, verbose=0)
    return _engine.job().timeline.events()


def rank_main(rank: int, size: int, extras: bool = False, fits: tuple = FITS) -> dict:
    """What the spawned ranks (ring) run."""
    import hostreduce.horovod.keras as hvd

    hvd.init()
    result: dict = {"fit": {key: fit(rank, size, *key) for key in fits},
                    "tape": {o: tape(rank, size, o) for o in TAPES}}
    if extras:
        result["all_reduce"] = _all_reduce_values(rank)
        result["callbacks"] = callbacks(rank, size)
        result["timeline"] = streaming(rank, size)
    hvd.shutdown()
    return result


def main(out_dir: str) -> None:
    """Under mpirun: the trainings; weights to OUT_DIR/rank{r}.npz."""
    import hostreduce.horovod.keras as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    arrays = {}
    for optimizer, on_host in FITS_SHORT:
        for i, w in enumerate(fit(rank, size, optimizer, on_host)["weights"]):
            arrays[f"fit_{optimizer}_{int(on_host)}_{i}"] = w
    for optimizer in TAPES:
        for i, w in enumerate(tape(rank, size, optimizer)):
            arrays[f"tape_{optimizer}_{i}"] = w
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **arrays)
    from hostreduce.ops import job as _engine

    print(f"RESULT rank {rank}/{size}: engine={_engine.job().strategy.reducer_name} ok", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])


def legacy_optimizer_rank(rank: int, size: int) -> list:
    """A tf_keras legacy optimizer (``OptimizerV2``) wrapped by ``DistributedOptimizer``
    and trained with ``train_on_batch`` on this rank's own data, as Horovod's
    test_legacy_optimizer does (there without a check of the result): the weights each
    rank ends with."""
    import tf_keras

    import hostreduce.horovod.keras as hvd

    hvd.init()
    tf_keras.utils.set_random_seed(7)
    opt = hvd.DistributedOptimizer(tf_keras.optimizers.legacy.Adam(learning_rate=0.01))
    model = tf_keras.Sequential([tf_keras.layers.Dense(2, input_shape=(3,))])
    model.compile(loss="mse", optimizer=opt)
    rng = np.random.default_rng(100 + rank)  # every rank its own batch
    for _ in range(3):
        model.train_on_batch(rng.random((8, 3), np.float32), rng.random((8, 2), np.float32))
    weights = [w.numpy() for w in model.weights]
    hvd.shutdown()
    return weights
