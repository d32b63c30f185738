"""A script in the shape of Horovod's TensorFlow Estimator MNIST example (a TF1
``model_fn`` with ``tf.layers``, ``hvd.DistributedOptimizer`` over a TF1 optimizer and
its ``minimize(loss, global_step)`` inside ``model_fn``, ``numpy_input_fn``,
``LoggingTensorHook`` and ``hvd.BroadcastGlobalVariablesHook`` passed to ``train``,
``evaluate``), with the same calls in the same order, changed only where a port to
TensorFlow 2.16+ changes it:

* the import line: ``import hostreduce.horovod as hvd``;
* ``tf.estimator`` (gone from TensorFlow 2.16) is ``hostreduce.estimator``:
  ``Estimator``, ``RunConfig``, ``EstimatorSpec``, ``ModeKeys`` and
  ``inputs.numpy_input_fn`` keep their names and arguments;
* TensorFlow 1 in TensorFlow 2: ``import tensorflow.compat.v1 as tf`` (TensorFlow 2
  behaviour stays on: the Estimator runs ``tf.function``); ``tf.layers`` is tf_keras's
  (``TF_USE_LEGACY_KERAS=1`` before TensorFlow is imported);
* the data: scikit-learn's 8x8 digits scaled to MNIST's 28x28 (no download), and the
  number of steps and the model directory from the command line so that tests stay short.

After evaluating, every rank prints a digest of its variables (``RESULT rank R/N:
weights=...``).

Run: ``hostreduce run -np 2 -- python tensorflow_mnist_estimator.py --steps N --model-dir DIR``.
"""
import os

os.environ["TF_USE_LEGACY_KERAS"] = "1"

import argparse  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

import hostreduce.horovod as hvd  # noqa: E402
from hostreduce import estimator  # noqa: E402

from tests.hvd_workers.digest import report  # noqa: E402
from tests.seed_workers import digits  # noqa: E402

tf.logging.set_verbosity(tf.logging.INFO)

parser = argparse.ArgumentParser(description="TensorFlow Estimator MNIST example")
parser.add_argument("--steps", type=int, default=20000)
parser.add_argument("--model-dir", default="./mnist_convnet_model")
parser.add_argument("--log-every", type=int, default=500)
args = parser.parse_args()


def cnn_model_fn(features, labels, mode):
    """Two convolution and pooling layers, a dense layer with dropout, the logits."""
    input_layer = tf.reshape(features["x"], [-1, 28, 28, 1])

    conv1 = tf.layers.conv2d(inputs=input_layer, filters=32, kernel_size=[5, 5], padding="same",
                             activation=tf.nn.relu)
    pool1 = tf.layers.max_pooling2d(inputs=conv1, pool_size=[2, 2], strides=2)
    conv2 = tf.layers.conv2d(inputs=pool1, filters=64, kernel_size=[5, 5], padding="same",
                             activation=tf.nn.relu)
    pool2 = tf.layers.max_pooling2d(inputs=conv2, pool_size=[2, 2], strides=2)
    pool2_flat = tf.reshape(pool2, [-1, 7 * 7 * 64])
    dense = tf.layers.dense(inputs=pool2_flat, units=1024, activation=tf.nn.relu)
    dropout = tf.layers.dropout(inputs=dense, rate=0.4, training=mode == estimator.ModeKeys.TRAIN)
    logits = tf.layers.dense(inputs=dropout, units=10)

    predictions = {
        "classes": tf.argmax(input=logits, axis=1),
        # The logging hook reads this tensor by name.
        "probabilities": tf.nn.softmax(logits, name="softmax_tensor"),
    }
    if mode == estimator.ModeKeys.PREDICT:
        return estimator.EstimatorSpec(mode=mode, predictions=predictions)

    onehot_labels = tf.one_hot(indices=tf.cast(labels, tf.int32), depth=10)
    loss = tf.losses.softmax_cross_entropy(onehot_labels=onehot_labels, logits=logits)

    if mode == estimator.ModeKeys.TRAIN:
        # The learning rate grows with the number of workers.
        optimizer = tf.train.MomentumOptimizer(learning_rate=0.001 * hvd.size(), momentum=0.9)
        # The gradients are averaged over the workers.
        optimizer = hvd.DistributedOptimizer(optimizer, backward_passes_per_step=1)
        train_op = optimizer.minimize(loss=loss, global_step=tf.train.get_global_step())
        return estimator.EstimatorSpec(mode=mode, loss=loss, train_op=train_op)

    eval_metric_ops = {"accuracy": tf.metrics.accuracy(labels=labels, predictions=predictions["classes"])}
    return estimator.EstimatorSpec(mode=mode, loss=loss, eval_metric_ops=eval_metric_ops)


def main(unused_argv):
    hvd.init()

    (train_data, train_labels), (eval_data, eval_labels) = digits.load_mnist()

    # (-1, 28, 28) images to (-1, 784) rows in [0, 1].
    train_data = np.reshape(train_data, (-1, 784)) / 255.0
    eval_data = np.reshape(eval_data, (-1, 784)) / 255.0

    # One GPU per process, by local rank.
    config = tf.ConfigProto()
    config.gpu_options.allow_growth = True
    config.gpu_options.visible_device_list = str(hvd.local_rank())

    # Only rank 0 writes checkpoints.
    model_dir = args.model_dir if hvd.rank() == 0 else None

    mnist_classifier = estimator.Estimator(model_fn=cnn_model_fn, model_dir=model_dir,
                                           config=estimator.RunConfig(session_config=config))

    # Log the probabilities of the "softmax_tensor" tensor.
    tensors_to_log = {"probabilities": "softmax_tensor"}
    logging_hook = tf.train.LoggingTensorHook(tensors=tensors_to_log, every_n_iter=args.log_every)

    # Every rank starts from rank 0's variables (initial or restored).
    bcast_hook = hvd.BroadcastGlobalVariablesHook(0)

    train_input_fn = estimator.inputs.numpy_input_fn(x={"x": train_data}, y=train_labels, batch_size=100,
                                                     num_epochs=None, shuffle=True)

    # The steps divided by the number of workers.
    mnist_classifier.train(input_fn=train_input_fn, steps=args.steps // hvd.size(),
                           hooks=[logging_hook, bcast_hook])

    eval_input_fn = estimator.inputs.numpy_input_fn(x={"x": eval_data}, y=eval_labels, num_epochs=1,
                                                    shuffle=False)
    eval_results = mnist_classifier.evaluate(input_fn=eval_input_fn)
    print(eval_results)

    variables = mnist_classifier.get_variables()
    report(hvd.rank(), hvd.size(), [variables[name] for name in sorted(variables)])


if __name__ == "__main__":
    tf.app.run()
