"""A script in the shape of Horovod's TensorFlow 2 Keras MNIST example, with the same
calls in the same order, changed only where a port changes it:

* the import line: ``import hostreduce.horovod.keras as hvd``;
* Keras 3: ``model.compile`` has no ``experimental_run_tf_function`` argument, and
  ``ModelCheckpoint`` writes ``.keras`` files;
* the data: scikit-learn's 8x8 digits shaped like MNIST (no download), and the number
  of epochs, steps and the checkpoint directory from the command line so that tests
  stay short.

At the end every rank prints a digest of its weights (``RESULT rank R: weights=...``),
so a test can check that every rank ends with the same weights.

Run: ``hostreduce run -np 2 -- python tensorflow2_keras_mnist.py EPOCHS STEPS DIR`` or
``mpirun -np 2 python tensorflow2_keras_mnist.py EPOCHS STEPS DIR``.
"""
import hashlib
import os
import sys

import numpy as np
import tensorflow as tf

import hostreduce.horovod.keras as hvd

from tests.seed_workers import digits  # noqa: E402

EPOCHS = int(sys.argv[1]) if len(sys.argv) > 1 else 24
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 500
CHECKPOINT_DIR = sys.argv[3] if len(sys.argv) > 3 else "."

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
dataset = dataset.repeat().shuffle(10000).batch(128)

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

# Scale the learning rate by the number of workers; the warmup callback below starts
# from scaled_lr / size and reaches scaled_lr after 3 epochs.
scaled_lr = 0.001 * hvd.size()
opt = tf.optimizers.Adam(scaled_lr)

# Reduce the gradients over the job.
opt = hvd.DistributedOptimizer(
    opt, backward_passes_per_step=1, average_aggregated_gradients=True)

mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
                    optimizer=opt,
                    metrics=["accuracy"])

callbacks = [
    # Start every worker from rank 0's weights and optimizer state.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),

    # Average the metrics over the workers at the end of every epoch.
    hvd.callbacks.MetricAverageCallback(),

    # Warm the learning rate up over the first 3 epochs.
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
]

# Only rank 0 saves checkpoints, so that other workers do not corrupt them.
if hvd.rank() == 0:
    callbacks.append(tf.keras.callbacks.ModelCheckpoint(os.path.join(CHECKPOINT_DIR, "checkpoint-{epoch}.keras")))

# Only rank 0 shows the progress bar.
verbose = 1 if hvd.rank() == 0 else 0

mnist_model.fit(dataset, steps_per_epoch=STEPS // hvd.size(), callbacks=callbacks, epochs=EPOCHS, verbose=verbose)

weights = np.concatenate([np.ravel(v.numpy()).astype(np.float64) for v in mnist_model.variables])
print(f"RESULT rank {hvd.rank()}/{hvd.size()}: weights={hashlib.sha256(weights.tobytes()).hexdigest()[:16]}",
      flush=True)
