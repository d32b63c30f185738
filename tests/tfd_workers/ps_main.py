"""The ``model.fit`` part of TensorFlow's parameter-server tutorial
(``parameter_server_training``), with the same calls in the same order: a dataset of
global batches, a model built and compiled in ``strategy.scope()`` (``steps_per_execution``
too), ``fit`` with the tutorial's ``TensorBoard``, ``ModelCheckpoint`` and
``BackupAndRestore`` callbacks. Changed:

* the cluster: ``TF_CONFIG`` with ``ps`` tasks, every task running this script (the
  tutorial's in-process ``tf.distribute.Server`` cluster and ``ClusterCoordinator``
  client have no counterpart), and the strategy line:
  ``hostreduce.ParameterServerStrategy()`` for
  ``tf.distribute.ParameterServerStrategy(cluster_resolver, variable_partitioner=...)``
  (hostreduce splits variables of 4 MiB and more by rows on its own);
* on Keras 3 only (``KERAS3``; under ``TF_USE_LEGACY_KERAS=1`` the tutorial's own lines
  run): a ``.keras`` name for ``ModelCheckpoint``'s file, an ``Input`` layer (Keras 3's
  ``BackupAndRestore`` needs a built model) and labels of shape ``(10, 1)`` (Keras 3's
  ``mse`` does not broadcast ``(64,)`` against the model's ``(64, 10)``), and the data
  made equal on every task;
* the epochs, steps and working directory from the command line.

(``tf.keras.optimizers.legacy.SGD``, which Keras 3 refuses, stays: in the strategy's
scope it makes Keras 3's SGD.)

Each training task prints its losses and ``RESULT rank R/N: weights=<digest>``.

Run: ``hostreduce run -np 2 --ps 2 -- python ps_main.py EPOCHS STEPS DIR``.
"""
import json
import os
import sys

import tensorflow as tf

import hostreduce
from tests.hvd_workers.digest import report

EPOCHS, STEPS, working_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
KERAS3 = os.environ.get("TF_USE_LEGACY_KERAS") != "1"

strategy = hostreduce.ParameterServerStrategy()

global_batch_size = 64

x = tf.random.stateless_uniform((10, 10), seed=(1, 2))  # equal on every task (the tutorial: tf.random.uniform)
if KERAS3:
    y = tf.random.stateless_uniform((10, 1), seed=(3, 4))  # Keras 3's mse does not broadcast (10,) against (10, 10)
else:
    y = tf.random.stateless_uniform((10,), seed=(3, 4))

dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10).repeat()
dataset = dataset.batch(global_batch_size)
dataset = dataset.prefetch(2)

with strategy.scope():
    if KERAS3:
        model = tf.keras.models.Sequential([tf.keras.Input((10,)), tf.keras.layers.Dense(10)])
    else:
        model = tf.keras.models.Sequential([tf.keras.layers.Dense(10)])

    model.compile(tf.keras.optimizers.legacy.SGD(), loss="mse", steps_per_execution=10)

log_dir = os.path.join(working_dir, "log")
ckpt_filepath = os.path.join(working_dir, "ckpt.keras" if KERAS3 else "ckpt")
backup_dir = os.path.join(working_dir, "backup")

callbacks = [
    tf.keras.callbacks.TensorBoard(log_dir=log_dir),
    tf.keras.callbacks.ModelCheckpoint(filepath=ckpt_filepath),
    tf.keras.callbacks.BackupAndRestore(backup_dir=backup_dir),
]

history = model.fit(dataset, epochs=EPOCHS, steps_per_epoch=STEPS, callbacks=callbacks)
print("LOSSES", json.dumps(history.history["loss"]), flush=True)
report(strategy.rank, strategy.size, model.weights)
