"""A TF2 script in the shape of TF Adapter's distributed-training guide, ported by its
import lines only: ``import npu_device as npu`` became ``import hostreduce as npu`` and
``from npu_device.distribute import hccl_ops`` became
``from hostreduce.distribute import hccl_ops``. Every ``npu.X`` call below is
TF Adapter's, as written for it: ``npu.open().as_default()``,
``npu.distribute.shard_and_rebatch_dataset``, ``npu.distribute.broadcast``,
``npu.distribute.all_reduce`` in a custom ``tf.function`` step, then
``npu.distribute.npu_distributed_keras_optimizer_wrapper`` for ``model.fit``, a TF1
optimizer under ``npu.distribute.npu_distributed_optimizer_wrapper``, and HCCL's ops.

The data is scikit-learn's 8x8 digits shaped like MNIST (no download), read without
tf.data's autotune thread, and the step count comes from the command line so that
tests stay short. At the end every rank saves its weights to
``DIR/weights-rank{R}.npz`` so a test can check they are identical.

Run: ``hostreduce run -np 2 -- python npu_ported_as_is.py STEPS DIR`` or
``mpirun -np 2 python npu_ported_as_is.py STEPS DIR``.
"""
import os
import sys

import numpy as np
import tensorflow as tf

import hostreduce as npu  # was: import npu_device as npu
from hostreduce.distribute import hccl_ops  # was: from npu_device.distribute import hccl_ops

from tests.seed_workers import digits  # noqa: E402

npu.open().as_default()

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
dataset, batch_size = npu.distribute.shard_and_rebatch_dataset(dataset, GLOBAL_BATCH_SIZE)
dataset = dataset.shuffle(len(x_train), seed=0).repeat().batch(batch_size, drop_remainder=True)

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
    grads = npu.distribute.all_reduce(grads, "mean")
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


# A custom loop: all_reduce in the step.
for step, (images, labels) in enumerate(dataset.take(STEPS)):
    loss = train_step(images, labels)
    if step == 0:
        # The model's variables exist after its first call: give every worker rank 0's.
        npu.distribute.broadcast(model.trainable_variables, root_rank=0)
print(f"custom loop: loss {float(loss):.4f}", flush=True)

# model.fit: the wrapped optimizer reduces the gradients.
model.compile(optimizer=npu.distribute.npu_distributed_keras_optimizer_wrapper(tf.keras.optimizers.SGD(0.01)),
              loss=loss_object)
history = model.fit(dataset, epochs=1, steps_per_epoch=STEPS, verbose=0)
print(f"fit: loss {history.history['loss'][-1]:.4f}", flush=True)

# HCCL: ranks, collectives and a TF1 optimizer.
rank, size = npu.distribute.get_rank_id(), npu.distribute.get_rank_size()
x = tf.fill([size * 2], float(rank + 1))
summed = hccl_ops.allreduce(x, "sum")
gathered = hccl_ops.allgather(tf.constant([rank]), size)
scattered = hccl_ops.reduce_scatter(x, "max", size)
from_root = hccl_ops.broadcast([tf.constant([rank + 10])], 0)[0]
counts = tf.ones([size, size], tf.int64)  # every rank sends one element to every rank
exchanged = hccl_ops.all_to_all_v_c(tf.fill([size], rank), counts, rank)
expected_sum = size * (size + 1) / 2
assert summed.numpy().tolist() == [expected_sum] * (size * 2), summed
assert gathered.numpy().tolist() == list(range(size)), gathered
assert scattered.numpy().tolist() == [float(size)] * 2, scattered
assert from_root.numpy().tolist() == [10], from_root
assert exchanged.numpy().tolist() == list(range(size)), exchanged

v = tf.Variable(0.0)
tf1_optimizer = npu.distribute.npu_distributed_optimizer_wrapper(tf.compat.v1.train.GradientDescentOptimizer(1.0))
tf1_optimizer.minimize(lambda: float(rank + 1) * v, var_list=[v])  # gradient rank + 1, averaged
assert v.numpy() == -(size + 1) / 2, v.numpy()

os.makedirs(WEIGHTS_DIR, exist_ok=True)
np.savez(os.path.join(WEIGHTS_DIR, f"weights-rank{rank}.npz"), *model.get_weights(), v.numpy())
print(f"RESULT rank {rank}/{size}: loss={history.history['loss'][-1]:.4f}", flush=True)
