"""A script in the shape of Horovod's TensorFlow 1 MNIST example (a TF1 graph,
``hvd.DistributedOptimizer`` over a TF1 optimizer, ``hvd.BroadcastGlobalVariablesHook``,
``MonitoredTrainingSession``), with the same calls in the same order, changed only where a
port to TensorFlow 2.16+ changes it:

* the import line: ``import hostreduce.horovod as hvd``;
* TensorFlow 1 in TensorFlow 2: ``import tensorflow.compat.v1 as tf`` and
  ``tf.disable_v2_behavior()``; ``tf.layers`` is tf_keras's (``TF_USE_LEGACY_KERAS=1``
  before TensorFlow is imported: Keras 3 has no ``tf.compat.v1.layers``);
  ``tf.estimator.ModeKeys`` is ``hostreduce.ModeKeys``;
* the data: scikit-learn's 8x8 digits scaled to MNIST's 28x28 (no download), and the
  last step and checkpoint directory from the command line so that tests stay short.

When the session closes every rank prints a digest of its global variables, optimizer
slots included (``RESULT rank R/N: weights=...``).

Run: ``hostreduce run -np 2 -- python tensorflow_mnist.py --steps N --checkpoint-dir DIR``.
"""
import os

os.environ["TF_USE_LEGACY_KERAS"] = "1"

import argparse  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

import hostreduce  # noqa: E402
import hostreduce.horovod as hvd  # noqa: E402

from tests.hvd_workers.digest import report  # noqa: E402
from tests.seed_workers import digits  # noqa: E402

tf.disable_v2_behavior()
layers = tf.layers

tf.logging.set_verbosity(tf.logging.INFO)

# Training settings
parser = argparse.ArgumentParser(description="TensorFlow MNIST example")
parser.add_argument("--use-adasum", action="store_true", default=False)
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--steps", type=int, default=20000)
parser.add_argument("--checkpoint-dir", default="./checkpoints")
args = parser.parse_args()


def conv_model(feature, target, mode):
    """Two convolution layers and two dense ones."""
    target = tf.one_hot(tf.cast(target, tf.int32), 10, 1, 0)
    feature = tf.reshape(feature, [-1, 28, 28, 1])

    with tf.variable_scope("conv_layer1"):
        h_conv1 = layers.conv2d(feature, 32, kernel_size=[5, 5], activation=tf.nn.relu, padding="SAME")
        h_pool1 = tf.nn.max_pool(h_conv1, ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1], padding="SAME")

    with tf.variable_scope("conv_layer2"):
        h_conv2 = layers.conv2d(h_pool1, 64, kernel_size=[5, 5], activation=tf.nn.relu, padding="SAME")
        h_pool2 = tf.nn.max_pool(h_conv2, ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1], padding="SAME")
        h_pool2_flat = tf.reshape(h_pool2, [-1, 7 * 7 * 64])

    h_fc1 = layers.dropout(layers.dense(h_pool2_flat, 1024, activation=tf.nn.relu),
                           rate=0.5, training=mode == hostreduce.ModeKeys.TRAIN)

    logits = layers.dense(h_fc1, 10, activation=None)
    loss = tf.losses.softmax_cross_entropy(target, logits)

    return tf.argmax(logits, 1), loss


def train_input_generator(x_train, y_train, batch_size=64):
    assert len(x_train) == len(y_train)
    while True:
        p = np.random.permutation(len(x_train))
        x_train, y_train = x_train[p], y_train[p]
        index = 0
        while index <= len(x_train) - batch_size:
            yield x_train[index:index + batch_size], y_train[index:index + batch_size],
            index += batch_size


class DigestHook(tf.train.SessionRunHook):
    """Prints this rank's digest of the global variables when the session closes."""

    def end(self, session):
        report(hvd.rank(), hvd.size(), session.run(tf.global_variables()))


def main(_):
    # Initialize the job.
    hvd.init()

    (x_train, y_train), (x_test, y_test) = digits.load_mnist()

    x_train = np.reshape(x_train, (-1, 784)) / 255.0
    x_test = np.reshape(x_test, (-1, 784)) / 255.0

    with tf.name_scope("input"):
        image = tf.placeholder(tf.float32, [None, 784], name="image")
        label = tf.placeholder(tf.float32, [None], name="label")
    predict, loss = conv_model(image, label, hostreduce.ModeKeys.TRAIN)

    lr_scaler = hvd.size()
    if args.use_adasum:
        lr_scaler = hvd.local_size() if hvd.nccl_built() else 1

    # Scale the learning rate.
    opt = tf.train.AdamOptimizer(0.001 * lr_scaler)

    # Reduce the gradients over the job.
    opt = hvd.DistributedOptimizer(opt, op=hvd.Adasum if args.use_adasum else hvd.Average,
                                   gradient_predivide_factor=args.gradient_predivide_factor)

    global_step = tf.train.get_or_create_global_step()
    train_op = opt.minimize(loss, global_step=global_step)

    hooks = [
        # Start every worker from rank 0's variables.
        hvd.BroadcastGlobalVariablesHook(0),
        # The steps divided by the number of workers.
        tf.train.StopAtStepHook(last_step=args.steps // hvd.size()),
        tf.train.LoggingTensorHook(tensors={"step": global_step, "loss": loss}, every_n_iter=10),
        DigestHook(),
    ]

    # Pin the GPU of this process's local rank.
    config = tf.ConfigProto()
    config.gpu_options.allow_growth = True
    config.gpu_options.visible_device_list = str(hvd.local_rank())

    # Only rank 0 writes checkpoints.
    checkpoint_dir = args.checkpoint_dir if hvd.rank() == 0 else None
    training_batch_generator = train_input_generator(x_train, y_train, batch_size=100)
    with tf.train.MonitoredTrainingSession(checkpoint_dir=checkpoint_dir, hooks=hooks,
                                           config=config) as mon_sess:
        while not mon_sess.should_stop():
            image_, label_ = next(training_batch_generator)
            mon_sess.run(train_op, feed_dict={image: image_, label: label_})


if __name__ == "__main__":
    tf.app.run()
