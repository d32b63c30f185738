"""TensorFlow's multi-worker Estimator tutorial (``multi_worker_with_estimator``), with
the same calls in the same order: TF1 graph mode, an ``input_fn`` that shards with its
``input_context``, a ``model_fn`` that builds a Keras model and returns
``train_op=optimizer.minimize(loss, get_or_create_global_step())`` of a TF1 optimizer,
``train_and_evaluate``. Changed:

* ``tf.estimator.*`` -> ``hostreduce.*``, and the strategy line
  (``hostreduce.MultiWorkerStrategy()``);
* local data (digits shaped like MNIST) for ``tfds.load``, and the model directory and
  the training steps (``TrainSpec(max_steps=...)``: the tutorial's data ends after one
  pass) and the learning rate (so that a short run sees the loss fall) from the command
  line;
* Keras 3 only: the loss takes ``reduction=None`` (``tf.keras.losses.Reduction`` is gone).

Each worker prints ``EVAL {"loss": ..., "global_step": ...}`` (what
``train_and_evaluate`` returned) and ``RESULT rank R/N: weights=<digest>`` of the
trained variables.

Run: ``hostreduce run -np 2 -- python estimator_main.py MODEL_DIR STEPS [LEARNING_RATE]``.
"""
import json
import os
import sys

import numpy as np
import tensorflow as tf

import hostreduce
from tests.hvd_workers.digest import report
from tests.seed_workers import digits

NO_REDUCTION = tf.keras.losses.Reduction.NONE if os.environ.get("TF_USE_LEGACY_KERAS") == "1" else None

tf.compat.v1.disable_eager_execution()

BUFFER_SIZE = 10000
BATCH_SIZE = 64


def input_fn(mode, input_context=None):
    (x_train, y_train), (x_test, y_test) = digits.load_mnist()
    images, labels = (x_train, y_train) if mode == hostreduce.ModeKeys.TRAIN else (x_test, y_test)
    mnist_dataset = tf.data.Dataset.from_tensor_slices((images[..., np.newaxis], labels.astype(np.int64)))

    def scale(image, label):
        image = tf.cast(image, tf.float32)
        image /= 255
        return image, label

    if input_context:
        mnist_dataset = mnist_dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return mnist_dataset.map(scale).cache().shuffle(BUFFER_SIZE).batch(BATCH_SIZE)


LEARNING_RATE = float(sys.argv[3]) if len(sys.argv) > 3 else 1e-4


def model_fn(features, labels, mode):
    model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, 3, activation="relu", input_shape=(28, 28, 1)),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    logits = model(features, training=False)

    if mode == hostreduce.ModeKeys.PREDICT:
        predictions = {"logits": logits}
        return hostreduce.EstimatorSpec(labels=labels, predictions=predictions)

    optimizer = tf.compat.v1.train.GradientDescentOptimizer(learning_rate=LEARNING_RATE)
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=NO_REDUCTION)(labels, logits)
    loss = tf.reduce_sum(loss) * (1. / BATCH_SIZE)
    if mode == hostreduce.ModeKeys.EVAL:
        return hostreduce.EstimatorSpec(mode, loss=loss)

    return hostreduce.EstimatorSpec(
        mode=mode, loss=loss,
        train_op=optimizer.minimize(loss, tf.compat.v1.train.get_or_create_global_step()))


strategy = hostreduce.MultiWorkerStrategy()
config = hostreduce.RunConfig(train_distribute=strategy)

classifier = hostreduce.Estimator(model_fn=model_fn, model_dir=sys.argv[1], config=config)
metrics, _ = hostreduce.train_and_evaluate(
    classifier,
    train_spec=hostreduce.TrainSpec(input_fn=input_fn, max_steps=int(sys.argv[2])),
    eval_spec=hostreduce.EvalSpec(input_fn=input_fn),
)

print("EVAL", json.dumps({"loss": float(metrics["loss"]), "global_step": int(metrics["global_step"])}), flush=True)
tf_config = json.loads(os.environ["TF_CONFIG"])
report(tf_config["task"]["index"], len(tf_config["cluster"]["worker"]),
       [classifier.get_variable_value(n) for n in classifier.get_variable_names()
        if n != "global_step" and "/" in n])
