"""``fit`` in ``hostreduce.MultiWorkerStrategy().scope()`` where worker 1 raises at its
fourth batch; the script never closes anything. Every worker must end non-zero, the
others naming worker 1's error.

Run: ``hostreduce run -np 2 -- python fit_fails.py`` (or by hand with ``TF_CONFIG``).
"""
import numpy as np
import tensorflow as tf

import hostreduce

strategy = hostreduce.MultiWorkerStrategy()
x = np.random.default_rng(0).standard_normal((512, 8)).astype("float32")
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(4), tf.keras.layers.Dense(1)])
    model.compile("sgd", "mse")


class FailOnWorker1(tf.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if strategy.rank == 1 and batch == 3:
            raise RuntimeError("worker 1 failed on purpose")


model.fit(tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(32), epochs=2, verbose=0,
          callbacks=[FailOnWorker1()])
print(f"worker {strategy.rank} finished", flush=True)
