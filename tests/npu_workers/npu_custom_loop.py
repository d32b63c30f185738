"""A custom training loop in the shape of TF Adapter's TensorFlow 2 distributed-training
guide (``npu.distribute``), with the same calls in the same order, changed only where a
port changes it:

* the import line: ``import npu_device as npu`` and ``npu.open().as_default()`` become
  ``import hostreduce.distribute as distribute``, so ``npu.distribute.X`` is
  ``distribute.X``;
* Keras 3: ``tf.keras`` is Keras 3 in TensorFlow 2.16+ (nothing else changes here);
* the data: scikit-learn's 8x8 digits shaped like MNIST (no download), read without
  tf.data's autotune thread (its wait at the iterator's end would slow the tests), and
  the step count from the command line so that tests stay short.

At the end every rank saves its weights to ``DIR/weights-rank{R}.npz`` (the only use of
``hostreduce.horovod``: for the rank), so a test can check they are identical.

Run: ``hostreduce run -np 2 -- python npu_custom_loop.py STEPS DIR`` or
``mpirun -np 2 python npu_custom_loop.py STEPS DIR``.
"""
import os
import sys

import numpy as np
import tensorflow as tf

import hostreduce.distribute as distribute

from tests.seed_workers import digits  # noqa: E402

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 100
WEIGHTS_DIR = sys.argv[2] if len(sys.argv) > 2 else "."
GLOBAL_BATCH_SIZE = 64

(x_train, y_train), _ = digits.load_data()
x_train = x_train.reshape(len(x_train), -1).astype(np.float32) / 255.0

dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train.astype(np.int64)))
options = tf.data.Options()
options.autotune.enabled = False
dataset = dataset.with_options(options)

# Each worker takes its shard of the data and its part of the global batch.
dataset, batch_size = distribute.shard_and_rebatch_dataset(dataset, GLOBAL_BATCH_SIZE)
dataset = dataset.shuffle(len(x_train), seed=0).repeat().batch(batch_size, drop_remainder=True).take(STEPS)

model = tf.keras.Sequential([
    tf.keras.layers.Dense(128, activation="relu"),
    tf.keras.layers.Dropout(0.2),
    tf.keras.layers.Dense(10),
])
loss_object = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = tf.keras.optimizers.Adam(1e-3)


@tf.function
def train_step(images, labels):
    with tf.GradientTape() as tape:
        logits = model(images, training=True)
        loss = loss_object(labels, logits)
    grads = tape.gradient(loss, model.trainable_variables)
    # Average the gradients over the workers.
    grads = distribute.all_reduce(grads, "mean")
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


for step, (images, labels) in enumerate(dataset):
    loss = train_step(images, labels)
    if step == 0:
        # The model's variables exist after its first call: give every worker rank 0's.
        distribute.broadcast(model.trainable_variables, root_rank=0)
    if step % 10 == 0:
        print(f"step {step}: loss {float(loss):.4f}", flush=True)

import hostreduce.horovod as hvd  # noqa: E402

os.makedirs(WEIGHTS_DIR, exist_ok=True)
np.savez(os.path.join(WEIGHTS_DIR, f"weights-rank{hvd.rank()}.npz"), *model.get_weights())
print(f"RESULT rank {hvd.rank()}/{hvd.size()}: loss={float(loss):.4f}", flush=True)
