"""A script in the shape of Horovod's TensorFlow 2 Keras synthetic benchmark (a Keras
application trained with ``model.fit`` on random images), with the same calls in the
same order, changed only where a port changes it:

* the import line: ``import hostreduce.horovod.keras as hvd``;
* Keras 3: no ``experimental_run_tf_function`` in ``compile``.

At the end every rank prints a digest of its trainable weights (``RESULT rank R/N:
weights=...``; batch normalization's moving statistics differ between ranks, each of
which draws its own random batch, as with Horovod).

Run: ``hostreduce run -np 2 -- python tensorflow2_keras_synthetic_benchmark.py
--no-cuda --model MobileNetV3Small --batch-size 2 --num-iters 2 --num-batches-per-iter 1``.
"""
import argparse
import os
from timeit import default_timer as timer

import numpy as np
import tensorflow as tf
from tensorflow.keras import applications

import hostreduce.horovod.keras as hvd

from tests.hvd_workers.digest import report

# Benchmark settings
parser = argparse.ArgumentParser(description="TensorFlow synthetic benchmark",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--model", type=str, default="ResNet50")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--num-batches-per-iter", type=int, default=10)
parser.add_argument("--num-iters", type=int, default=10)
parser.add_argument("--no-cuda", action="store_true", default=False)

args = parser.parse_args()
args.cuda = not args.no_cuda
device = "GPU" if args.cuda else "CPU"

# Initialize the job.
hvd.init()

if hvd.rank() == 0:
    print("Model: %s" % args.model)
    print("Batch size: %d" % args.batch_size)
    print("Number of %ss: %d" % (device, hvd.size()))

# Pin the GPU of this process's local rank.
if args.cuda:
    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")
else:
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"

# A standard model.
model = getattr(applications, args.model)(weights=None)
opt = tf.optimizers.SGD(0.01)

# Synthetic dataset
data = tf.random.uniform([args.batch_size, 224, 224, 3])
target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=999, dtype=tf.int64)
dataset = tf.data.Dataset.from_tensor_slices((data, target)).cache().repeat().batch(args.batch_size)

# Optional compression of the reductions.
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

# Reduce the gradients over the job.
opt = hvd.DistributedOptimizer(opt, compression=compression)

model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt)

callbacks = [
    # Start every worker from rank 0's weights.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    # Average the metrics over the workers at the end of every epoch.
    hvd.callbacks.MetricAverageCallback(),
]


class TimingCallback(tf.keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.img_secs = []

    def on_train_end(self, logs=None):
        img_sec_mean = np.mean(self.img_secs)
        img_sec_conf = 1.96 * np.std(self.img_secs)
        print("Img/sec per %s: %.1f +-%.1f" % (device, img_sec_mean, img_sec_conf))
        print("Total img/sec on %d %s(s): %.1f +-%.1f" %
              (hvd.size(), device, hvd.size() * img_sec_mean, hvd.size() * img_sec_conf))

    def on_epoch_begin(self, epoch, logs=None):
        self.starttime = timer()

    def on_epoch_end(self, epoch, logs=None):
        time = timer() - self.starttime
        img_sec = args.batch_size * args.num_batches_per_iter / time
        print("Iter #%d: %.1f img/sec per %s" % (epoch, img_sec, device))
        # Skip the warm-up epoch.
        if epoch > 0:
            self.img_secs.append(img_sec)


# Only rank 0 writes logs.
if hvd.rank() == 0:
    timing = TimingCallback()
    callbacks.append(timing)

# Train the model.
model.fit(
    dataset,
    batch_size=args.batch_size,
    steps_per_epoch=args.num_batches_per_iter,
    callbacks=callbacks,
    epochs=args.num_iters,
    verbose=0,
)

report(hvd.rank(), hvd.size(), model.trainable_variables)
