"""tf_keras's optimizers (legacy ``OptimizerV2`` and new) against the ps's host kernels
(``hostreduce.ps.from_keras``) on a dense variable and an embedding's rows, 5 steps each;
prints ``ERRORS {"<case>": max relative error, ...}``. Run as its own process (it
imports tf_keras)."""
import json

import numpy as np
import tf_keras

from hostreduce.ps import from_keras, sum_duplicates

CASES = [("legacy", "SGD", {"learning_rate": 0.1, "momentum": 0.9}),
         ("legacy", "SGD", {"learning_rate": 0.05, "momentum": 0.8, "nesterov": True}),
         ("legacy", "Adam", {"learning_rate": 0.01}),
         ("legacy", "RMSprop", {"learning_rate": 0.01, "momentum": 0.5}),
         # a large epsilon: where it goes (inside or after the square root) shows
         ("legacy", "RMSprop", {"learning_rate": 0.01, "epsilon": 0.1}),
         ("legacy", "RMSprop", {"learning_rate": 0.01, "centered": True, "epsilon": 0.1}),
         ("legacy", "Adagrad", {"learning_rate": 0.1, "epsilon": 0.1}),
         ("new", "SGD", {"learning_rate": 0.1, "momentum": 0.9}),
         ("new", "Adam", {"learning_rate": 0.01}),
         ("new", "RMSprop", {"learning_rate": 0.01})]


def _max_rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-12))


def main() -> None:
    import tensorflow as tf

    errors = {}
    for kind, name, kwargs in CASES:
        rng = np.random.default_rng(0)
        dense0, emb0 = rng.normal(size=(7, 5)).astype(np.float32), rng.normal(size=(30, 4)).astype(np.float32)
        package = tf_keras.optimizers.legacy if kind == "legacy" else tf_keras.optimizers
        kopt = getattr(package, name)(**kwargs)
        host = from_keras(kopt)  # the ps's default: as this Keras optimizer updates
        kd, ke = tf.Variable(dense0), tf.Variable(emb0)
        hd, he = dense0.copy(), emb0.copy()
        sd, se = host.init_slots(hd), host.init_slots(he)
        for step in range(1, 6):
            g = rng.normal(size=dense0.shape).astype(np.float32)
            ids = rng.integers(0, 10, size=12)
            uniq, summed = sum_duplicates(ids, rng.normal(size=(12, 4)).astype(np.float32))
            kopt.apply_gradients([(tf.constant(g), kd),
                                  (tf.IndexedSlices(tf.constant(summed), tf.constant(uniq), [30, 4]), ke)])
            host.apply_dense(hd, sd, g, step)
            host.apply_rows(he, se, uniq, summed, step)
        errors[f"{kind} {name} {json.dumps(kwargs, sort_keys=True)}"] = [_max_rel(hd, kd.numpy()),
                                                                      _max_rel(he, ke.numpy())]
    print("ERRORS", json.dumps(errors), flush=True)


if __name__ == "__main__":
    main()
