"""``fit`` inside ``hostreduce.ParameterServerStrategy.scope()`` against the same Keras in
one process: a model with an embedding the ps split by rows (a row cache on the worker)
and a dense layer, built, compiled with a ``tf.keras.optimizers.legacy`` optimizer (on
Keras 3 the scope makes its Keras 3 class; the reference uses that class) and trained in
the scope, one training task and 2 in-process ps. Prints ``ERRORS {"<optimizer>": max
relative error of the variables the ps hold after training, ...}``. Runs on the Keras
``TF_USE_LEGACY_KERAS`` chooses, in a process of its own."""
import json
import os

import numpy as np
import tensorflow as tf

import hostreduce
from tests.ps_helpers import LocalCluster, max_rel

IDS = np.random.default_rng(0).integers(0, 100_000, size=(64, 2)).astype(np.int32)
LABELS = np.random.default_rng(1).normal(size=(64, 1)).astype(np.float32)


def build() -> tf.keras.Model:
    return tf.keras.models.Sequential([
        tf.keras.Input((2,), dtype="int32"),
        tf.keras.layers.Embedding(100_000, 16, embeddings_initializer=tf.keras.initializers.RandomUniform(seed=1)),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(1, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2))])


def train(model: tf.keras.Model, optimizer: tf.keras.optimizers.Optimizer) -> None:
    data = tf.data.Dataset.from_tensor_slices((IDS, LABELS)).repeat().batch(8)
    model.compile(optimizer, loss="mse", steps_per_execution=2)
    model.fit(data, epochs=2, steps_per_epoch=4, verbose=0)


def main() -> None:
    keras3 = os.environ.get("TF_USE_LEGACY_KERAS") != "1"
    errors = {}
    for name, make in (("Adam", lambda legacy: legacy.Adam(0.01)),
                       ("SGD momentum", lambda legacy: legacy.SGD(0.1, momentum=0.9))):
        reference = build()
        train(reference, make(tf.keras.optimizers if keras3 else tf.keras.optimizers.legacy))
        ps = LocalCluster(2, 1)
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"chief": ["127.0.0.1:1"], "ps": ps.addresses},
                                              "task": {"type": "chief", "index": 0}})
        os.environ["HOSTREDUCE_SECRET"] = ps.secret
        strategy = hostreduce.ParameterServerStrategy(shard_bytes=1 << 20)
        try:
            with strategy.scope():
                model = build()
                train(model, make(tf.keras.optimizers.legacy))
            held = strategy.keras_variables()
        finally:
            strategy.job.end("done")
            ps.stop()
        assert len(held) == 3, list(held)
        errors[name] = max(max_rel(value, want) for value, want in zip(held.values(), reference.get_weights()))
    print("ERRORS", json.dumps(errors), flush=True)


if __name__ == "__main__":
    main()
