"""``fit`` inside ``hostreduce.ParameterServerStrategy.scope()`` against the same Keras in
one process: a model with an embedding the ps split by rows (a row cache on the worker)
and a dense layer, built (and called eagerly on a sample batch, before any optimizer
connected the job), compiled and trained in the scope, one training task and 2
in-process ps. Cases: a ``tf.keras.optimizers.legacy`` Adam, and SGD with momentum (on
Keras 3 the scope makes their Keras 3 classes; the reference uses those), and a model
subclassed in this script compiled with ``"sgd"`` by name. Then a model that looks its
table up twice in a step is refused with a ``SpecError`` naming the table. Prints
``ERRORS {"<case>": max relative error of the variables the ps hold, ...}`` and
``REFUSED <message>``. Runs on the Keras ``TF_USE_LEGACY_KERAS`` chooses, in a process
of its own."""
import json
import os

import numpy as np
import tensorflow as tf

import hostreduce
from hostreduce.errors import SpecError
from hostreduce.ps_training.rowcache import is_row_cache
from tests.ps_helpers import LocalCluster, max_rel

KERAS3 = os.environ.get("TF_USE_LEGACY_KERAS") != "1"
IDS = np.random.default_rng(0).integers(0, 100_000, size=(64, 2)).astype(np.int32)
LABELS = np.random.default_rng(1).normal(size=(64, 1)).astype(np.float32)


def _embedding() -> tf.keras.layers.Embedding:
    return tf.keras.layers.Embedding(100_000, 16, embeddings_initializer=tf.keras.initializers.RandomUniform(seed=1))


def _dense() -> tf.keras.layers.Dense:
    return tf.keras.layers.Dense(1, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2))


class Net(tf.keras.Model):
    """Subclassed here: its class's module is this script, not a Keras package."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.flatten, self.dense = _embedding(), tf.keras.layers.Flatten(), _dense()

    def call(self, ids):
        return self.dense(self.flatten(self.embedding(ids)))


def sequential() -> tf.keras.Model:
    return tf.keras.models.Sequential([tf.keras.Input((2,), dtype="int32"), _embedding(), tf.keras.layers.Flatten(),
                                       _dense()])


def train(model: tf.keras.Model, optimizer) -> None:
    data = tf.data.Dataset.from_tensor_slices((IDS, LABELS)).repeat().batch(8)
    model.compile(optimizer, loss="mse", steps_per_execution=2)
    model.fit(data, epochs=2, steps_per_epoch=4, verbose=0)


def on_the_ps(run) -> object:
    """``run(strategy)`` with a fresh in-process job; what it returns."""
    ps = LocalCluster(2, 1)
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"chief": ["127.0.0.1:1"], "ps": ps.addresses},
                                          "task": {"type": "chief", "index": 0}})
    os.environ["HOSTREDUCE_SECRET"] = ps.secret
    strategy = hostreduce.ParameterServerStrategy(shard_bytes=1 << 20)
    try:
        return run(strategy)
    finally:
        strategy.job.end("done")
        ps.stop()


def main() -> None:
    keras_optimizers = tf.keras.optimizers if KERAS3 else tf.keras.optimizers.legacy
    errors = {}
    for name, build, make in (("Adam", sequential, lambda optimizers: optimizers.Adam(0.01)),
                              ("SGD momentum", sequential, lambda optimizers: optimizers.SGD(0.1, momentum=0.9)),
                              ("subclassed, 'sgd'", Net, lambda optimizers: "sgd")):
        reference = build()
        reference(IDS[:2])
        train(reference, make(keras_optimizers))

        def run(strategy):
            with strategy.scope():
                model = build()
                model(IDS[:2])  # built eagerly on a sample batch: no optimizer has connected yet
                table = model.weights[0]
                assert is_row_cache(getattr(table, "_value", table)), type(table)
                train(model, make(tf.keras.optimizers.legacy))
            return strategy.keras_variables()

        held = on_the_ps(run)
        assert len(held) == 3, list(held)
        errors[name] = max(max_rel(value, want) for value, want in zip(held.values(), reference.get_weights()))
    print("ERRORS", json.dumps(errors), flush=True)

    def twice(strategy):
        with strategy.scope():
            ids = tf.keras.Input((2,), dtype="int32")
            table = tf.keras.layers.Embedding(100_000, 4, name="twice")
            model = tf.keras.Model(ids, _dense()(tf.keras.layers.Flatten()(table(ids) + table(ids + 1))))
            model.compile(tf.keras.optimizers.legacy.SGD(0.1), loss="mse")
        try:
            model.fit(tf.data.Dataset.from_tensor_slices((IDS, LABELS)).batch(8), epochs=1, steps_per_epoch=1,
                      verbose=0)
        except SpecError as e:
            return str(e)
        return "not refused"

    print("REFUSED", on_the_ps(twice), flush=True)


if __name__ == "__main__":
    main()
