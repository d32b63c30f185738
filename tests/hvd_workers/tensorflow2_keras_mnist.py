"""A script in the shape of Horovod's TensorFlow 2 Keras MNIST example, with the same
calls in the same order, changed only where a port changes it:

* the import line: ``import hostreduce.horovod.keras as hvd``;
* Keras 3: no ``experimental_run_tf_function`` in ``compile``; checkpoints end in
  ``.keras`` instead of ``.h5``;
* the data: scikit-learn's 8x8 digits scaled to MNIST's 28x28 (no download), and the
  steps per epoch, epochs and checkpoint directory from the command line so that tests
  stay short.

At the end every rank prints a digest of its weights (``RESULT rank R/N: weights=...``).

Run: ``hostreduce run -np 2 -- python tensorflow2_keras_mnist.py STEPS EPOCHS DIR`` or
``mpirun -np 2 python tensorflow2_keras_mnist.py STEPS EPOCHS DIR``.
"""
import os
import sys

import tensorflow as tf

import hostreduce.horovod.keras as hvd

from tests.hvd_workers.digest import report
from tests.seed_workers import digits

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 500
EPOCHS = int(sys.argv[2]) if len(sys.argv) > 2 else 24
CHECKPOINT_DIR = sys.argv[3] if len(sys.argv) > 3 else "."


def main():
    # Initialize the job.
    hvd.init()

    # Pin the GPU of this process's local rank (one GPU per process).
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    (mnist_images, mnist_labels), _ = digits.load_mnist()

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

    # Scale the learning rate by the number of workers.
    scaled_lr = 0.001 * hvd.size()
    opt = tf.optimizers.Adam(scaled_lr)

    # Reduce the gradients over the job.
    opt = hvd.DistributedOptimizer(
        opt, backward_passes_per_step=1, average_aggregated_gradients=True)

    mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
                        optimizer=opt,
                        metrics=["accuracy"])

    callbacks = [
        # Start every worker from rank 0's weights.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Average the metrics over the workers at the end of every epoch.
        hvd.callbacks.MetricAverageCallback(),
        # Ramp the learning rate up to the scaled one over the first epochs.
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
    ]

    # Only rank 0 writes checkpoints.
    if hvd.rank() == 0:
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(os.path.join(CHECKPOINT_DIR, "checkpoint-{epoch}.keras")))

    # Only rank 0 writes logs.
    verbose = 1 if hvd.rank() == 0 else 0

    # Train, with the steps divided by the number of workers.
    mnist_model.fit(dataset, steps_per_epoch=STEPS // hvd.size(), callbacks=callbacks, epochs=EPOCHS, verbose=verbose)

    report(hvd.rank(), hvd.size(), mnist_model.variables + opt.variables)


if __name__ == "__main__":
    main()
