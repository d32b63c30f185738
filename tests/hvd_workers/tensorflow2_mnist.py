"""A script in the shape of Horovod's TensorFlow 2 GradientTape MNIST example, with the
same calls in the same order, changed only where a port changes it:

* the import line: ``import hostreduce.horovod as hvd``;
* Keras 3: ``opt.variables`` is a property (``opt.variables()`` before Keras 3);
* the data: scikit-learn's 8x8 digits shaped like MNIST (no download), and a step
  count and checkpoint directory from the command line so that tests stay short.

At the end every rank prints a digest of its weights (``RESULT rank R: weights=...``),
so a test can check that every rank ends with the same weights.

Run: ``hostreduce run -np 2 -- python tensorflow2_mnist.py STEPS DIR`` or
``mpirun -np 2 python tensorflow2_mnist.py STEPS DIR``.
"""
import hashlib
import sys

import numpy as np
import tensorflow as tf

import hostreduce.horovod as hvd

from tests.seed_workers import digits

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 200
CHECKPOINT_DIR = sys.argv[2] if len(sys.argv) > 2 else "./checkpoints"

# Initialize the job.
hvd.init()

# Pin the GPU of this process's local rank (one GPU per process).
gpus = tf.config.experimental.list_physical_devices("GPU")
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

(mnist_images, mnist_labels), _ = digits.load_data()

dataset = tf.data.Dataset.from_tensor_slices(
    (tf.cast(mnist_images[..., tf.newaxis] / 255.0, tf.float32),
     tf.cast(mnist_labels, tf.int64))
)
dataset = dataset.shard(hvd.size(), hvd.rank()).repeat().shuffle(10000).batch(128)

mnist_model = tf.keras.Sequential([
    tf.keras.layers.Conv2D(32, [3, 3], activation="relu"),
    tf.keras.layers.Conv2D(64, [3, 3], activation="relu"),
    tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
    tf.keras.layers.Dropout(0.25),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(128, activation="relu"),
    tf.keras.layers.Dropout(0.5),
    tf.keras.layers.Dense(10, activation="softmax"),
])
loss = tf.losses.SparseCategoricalCrossentropy()

# Scale the learning rate by the number of workers.
opt = tf.optimizers.Adam(0.001 * hvd.size())

checkpoint_dir = CHECKPOINT_DIR
checkpoint = tf.train.Checkpoint(model=mnist_model, optimizer=opt)


@tf.function
def training_step(images, labels, first_batch):
    with tf.GradientTape() as tape:
        probs = mnist_model(images, training=True)
        loss_value = loss(labels, probs)

    # Reduce the gradients over the job.
    tape = hvd.DistributedGradientTape(tape)

    grads = tape.gradient(loss_value, mnist_model.trainable_variables)
    opt.apply_gradients(zip(grads, mnist_model.trainable_variables))

    # Start every worker from rank 0's weights and optimizer state, after the first
    # step (so that the optimizer's variables exist).
    if first_batch:
        hvd.broadcast_variables(mnist_model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)

    return loss_value


for batch, (images, labels) in enumerate(dataset.take(STEPS // hvd.size())):
    loss_value = training_step(images, labels, batch == 0)

    if batch % 10 == 0 and hvd.local_rank() == 0:
        print("Step #%d\tLoss: %.6f" % (batch, loss_value))

# Only rank 0 saves, so that other workers do not corrupt the checkpoint.
if hvd.rank() == 0:
    checkpoint.save(checkpoint_dir)

weights = np.concatenate([np.ravel(v.numpy()).astype(np.float64) for v in mnist_model.variables])
print(f"RESULT rank {hvd.rank()}/{hvd.size()}: weights={hashlib.sha256(weights.tobytes()).hexdigest()[:16]} "
      f"loss={float(loss_value):.4f}", flush=True)
