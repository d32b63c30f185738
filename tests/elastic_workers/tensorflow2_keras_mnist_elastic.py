"""A script in the shape of Horovod's elastic TensorFlow 2 Keras MNIST example
(``examples/elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py``), with the same
calls in the same order, changed only where a port changes it:

* the import line: ``import hostreduce.horovod.keras as hvd``;
* Keras 3: no ``experimental_run_tf_function`` in ``compile``;
  ``optimizer.learning_rate.assign`` for ``tf.keras.backend.set_value(optimizer.lr, ...)``;
  checkpoints end in ``.keras`` instead of ``.h5``;
* the data: scikit-learn's 8x8 digits shaped like MNIST (no download); the steps per
  epoch, epochs and checkpoint directory from the command line, so tests stay short.

For the tests, with ``HR_ELASTIC_MARKS`` set to a directory, a worker records its start
(``started-w<worker>``) and the end of each batch (``batch-w<worker>-e<epoch>-b<batch>-s<size>``)
there, and after batch B of epoch E waits while a file ``hold-e<E>-b<B>`` exists; at
the end every rank prints a digest of its weights (``RESULT rank R/N: weights=...``).

Run: ``hostreduce run -np 2 --min-np 1 --max-np 3 --host-discovery-script S --
python tensorflow2_keras_mnist_elastic.py STEPS EPOCHS DIR``.
"""
import argparse
import os

import tensorflow as tf

import hostreduce.horovod.keras as hvd

from tests import marks
from tests.hvd_workers.digest import report
from tests.seed_workers import digits

parser = argparse.ArgumentParser(description='Tensorflow 2.0 Keras MNIST Example')

parser.add_argument('--use-mixed-precision', action='store_true', default=False,
                    help='use mixed precision for training')
parser.add_argument('steps', type=int, nargs='?', default=500)
parser.add_argument('epochs', type=int, nargs='?', default=24)
parser.add_argument('checkpoint_dir', nargs='?', default='.')

args = parser.parse_args()
MARKS = os.environ.get("HR_ELASTIC_MARKS")
WORKER = os.environ.get("HOSTREDUCE_ELASTIC_WORKER", "?")

if args.use_mixed_precision:
    from tensorflow.keras import mixed_precision
    mixed_precision.set_global_policy('mixed_float16')

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

model = tf.keras.Sequential([
    tf.keras.layers.Conv2D(8, [3, 3], activation='relu'),
    tf.keras.layers.Conv2D(16, [3, 3], activation='relu'),
    tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
    tf.keras.layers.Dropout(0.25),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(32, activation='relu'),
    tf.keras.layers.Dropout(0.5),
    tf.keras.layers.Dense(10, activation='softmax')
])

# Horovod: adjust learning rate based on number of GPUs.
scaled_lr = 0.001 * hvd.size()
opt = tf.optimizers.Adam(scaled_lr)

# Horovod: add Horovod DistributedOptimizer.
opt = hvd.DistributedOptimizer(
    opt, backward_passes_per_step=1, average_aggregated_gradients=True)

# Horovod: Specify `experimental_run_tf_function=False` to ensure TensorFlow
# uses hvd.DistributedOptimizer() to compute gradients.
model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
                    optimizer=opt,
                    metrics=['accuracy'])

# Horovod: initialize optimizer state so we can synchronize across workers
# Keras has empty optimizer variables() for TF2:
# https://sourcegraph.com/github.com/tensorflow/tensorflow@v2.4.1/-/blob/tensorflow/python/keras/optimizer_v2/optimizer_v2.py#L351:10
model.fit(dataset, steps_per_epoch=1, epochs=1, callbacks=None)

state = hvd.elastic.KerasState(model, batch=0, epoch=0)

def on_state_reset():
    state.model.optimizer.learning_rate.assign(0.001 * hvd.size())
    # Re-initialize, to join with possible new ranks
    state.model.fit(dataset, steps_per_epoch=1, epochs=1, callbacks=None)

state.register_reset_callbacks([on_state_reset])


class _Marks(tf.keras.callbacks.Callback):
    """For the tests: record each batch's end, and wait while the test holds it."""

    def on_train_batch_end(self, batch, logs=None):
        name = f"e{state.epoch}-b{batch}"
        marks.mark(MARKS, f"batch-w{WORKER}-{name}-s{hvd.size()}")
        marks.wait_for_absence(MARKS, f"hold-{name}", timeout=240)


callbacks = [
    hvd.elastic.UpdateEpochStateCallback(state),
    hvd.elastic.UpdateBatchStateCallback(state),
    hvd.elastic.CommitStateCallback(state),
]
if MARKS:
    callbacks.append(_Marks())

# Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
if hvd.rank() == 0:
    callbacks.append(tf.keras.callbacks.ModelCheckpoint(os.path.join(args.checkpoint_dir, 'checkpoint-{epoch}.keras')))

# Train the model.
# Horovod: adjust number of steps based on number of GPUs.
@hvd.elastic.run
def train(state):
    state.model.fit(dataset, steps_per_epoch=args.steps // hvd.size(),
                    epochs=args.epochs-state.epoch, callbacks=callbacks,
                    verbose=1)

train(state)

print(f"DONE worker {WORKER} rank {hvd.rank()}/{hvd.size()} epoch {state.epoch}", flush=True)
report(hvd.rank(), hvd.size(), model.variables)
