"""A script in the shape of Horovod's elastic TensorFlow 2 MNIST example
(``examples/elastic/tensorflow2/tensorflow2_mnist_elastic.py``), with the same calls in
the same order, changed only where a port changes it:

* the import line: ``import hostreduce.horovod as hvd``;
* Keras 3: ``opt.learning_rate.assign`` (``opt.lr`` before Keras 3);
* the data: scikit-learn's 8x8 digits shaped like MNIST (no download); the number of
  batches and the checkpoint directory from the command line, so tests stay short.

For the tests, with ``HR_ELASTIC_MARKS`` set to a directory, a worker records its start
(``started-w<worker>``) and each commit (``commit-w<worker>-b<batch>-s<size>``) there,
and after the commit of batch B waits while a file ``hold-b<B>`` exists, so that a test acts on events
and not on timing; at the end every rank prints a digest of its weights
(``RESULT rank R/N: weights=...``) and the batch it reached.

Run: ``hostreduce run -np 2 --min-np 1 --max-np 3 --host-discovery-script S --
python tensorflow2_mnist_elastic.py BATCHES DIR``.
"""
import os
import sys

import tensorflow as tf

import hostreduce.horovod as hvd

from tests import marks
from tests.hvd_workers.digest import report
from tests.seed_workers import digits

BATCHES = int(sys.argv[1]) if len(sys.argv) > 1 else 100
CHECKPOINT_DIR = sys.argv[2] if len(sys.argv) > 2 else "./checkpoints"
MARKS = os.environ.get("HR_ELASTIC_MARKS")
WORKER = os.environ.get("HOSTREDUCE_ELASTIC_WORKER", "?")


def main():
    if MARKS:
        marks.mark(MARKS, f"started-w{WORKER}")
    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank (one GPU per process)
    gpus = tf.config.experimental.list_physical_devices('GPU')
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

    (mnist_images, mnist_labels), _ = digits.load_data()

    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(mnist_images[..., tf.newaxis] / 255.0, tf.float32),
         tf.cast(mnist_labels, tf.int64))
    )
    dataset = dataset.repeat().shuffle(10000, seed=7).batch(32)

    mnist_model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(8, [3, 3], activation='relu'),
        tf.keras.layers.Conv2D(16, [3, 3], activation='relu'),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(32, activation='relu'),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation='softmax')
    ])
    loss = tf.losses.SparseCategoricalCrossentropy()

    # Horovod: adjust learning rate based on number of GPUs.
    lr = 0.001
    opt = tf.optimizers.Adam(lr * hvd.size())

    @tf.function
    def training_step(images, labels, allreduce=True):
        with tf.GradientTape() as tape:
            probs = mnist_model(images, training=True)
            loss_value = loss(labels, probs)

        # Horovod: add Horovod Distributed GradientTape.
        if allreduce:
            tape = hvd.DistributedGradientTape(tape)

        grads = tape.gradient(loss_value, mnist_model.trainable_variables)
        opt.apply_gradients(zip(grads, mnist_model.trainable_variables))
        return loss_value

    # Horovod: initialize model and optimizer state so we can synchronize across workers
    for batch_idx, (images, labels) in enumerate(dataset.take(1)):
        training_step(images, labels, allreduce=False)

    @hvd.elastic.run
    def train(state):
        start_batch = state.batch

        # Horovod: adjust number of steps based on number of GPUs.
        for batch_idx, (images, labels) in enumerate(dataset.skip(state.batch).take(BATCHES // hvd.size())):
            state.batch = start_batch + batch_idx
            loss_value = training_step(images, labels)

            if state.batch % 10 == 0 and hvd.rank() == 0:
                print('Step #%d\tLoss: %.6f' % (state.batch, loss_value))

            # Horovod: commit state at the end of each batch
            state.commit()
            if MARKS:
                marks.mark(MARKS, f"commit-w{WORKER}-b{state.batch}-s{hvd.size()}")
                marks.wait_for_absence(MARKS, f"hold-b{state.batch}", timeout=240)

    def on_state_reset():
        opt.learning_rate.assign(lr * hvd.size())

    state = hvd.elastic.TensorFlowKerasState(mnist_model, opt, batch=0)
    state.register_reset_callbacks([on_state_reset])

    train(state)

    checkpoint_dir = CHECKPOINT_DIR
    checkpoint = tf.train.Checkpoint(model=mnist_model, optimizer=opt)

    # Horovod: save checkpoints only on worker 0 to prevent other workers from
    # corrupting it.
    if hvd.rank() == 0:
        checkpoint.save(checkpoint_dir)

    print(f"DONE worker {WORKER} rank {hvd.rank()}/{hvd.size()} batch {state.batch}", flush=True)
    report(hvd.rank(), hvd.size(), mnist_model.variables)


if __name__ == '__main__':
    main()
