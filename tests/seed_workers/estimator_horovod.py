"""A script in the shape of an IPU Estimator Horovod example, ported by renames:
``hvd.init()``, the dataset sharded with ``hvd.size()``/``hvd.rank()`` inside
``input_fn(mode)``, a TF1 optimizer's ``compute_gradients`` on the device and
``apply_gradients`` in ``host_call``, ``HorovodStrategy(variables_on_host=True)``,
device and session settings passed to ``RunConfig``, ``classifier.train`` only, and no
``close()`` anywhere. Run under ``mpirun``.

``SEED_OPTIMIZER=keras`` uses a Keras Adam instead of ``tf.compat.v1.train.AdamOptimizer``.
"""
import argparse
import os

import numpy as np

import tensorflow.compat.v1 as tf

import hostreduce
from hostreduce import horovod as hvd

from tests.seed_workers import digits

BATCH_SIZE = 32


def input_fn(mode):
    (images, labels), _ = digits.load_data()
    images = np.expand_dims(images.astype(np.float32) / 255.0, axis=-1)
    labels = labels.astype(np.int32)
    rows = digits.maybe_failing(images, hvd.rank())

    def examples():
        return zip(rows, labels)

    dataset = tf.data.Dataset.from_generator(examples, (images.dtype, labels.dtype),
                                             (images.shape[1:], labels.shape[1:]))
    dataset = dataset.shard(hvd.size(), hvd.rank())
    return dataset.shuffle(len(labels)).cache().batch(BATCH_SIZE, drop_remainder=True).repeat()


def model_fn(features, labels, mode):
    model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(16, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(32, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    logits = model(features, training=mode == hostreduce.ModeKeys.TRAIN)
    if mode == hostreduce.ModeKeys.PREDICT:
        return hostreduce.EstimatorSpec(mode, predictions={"logits": logits})

    if os.environ.get("SEED_OPTIMIZER") == "keras":
        optimizer = tf.keras.optimizers.Adam(0.003)
    else:
        optimizer = tf.compat.v1.train.AdamOptimizer(0.003)
    per_example = tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=tf.compat.v1.losses.Reduction.NONE)(labels, logits)
    loss = tf.reduce_sum(per_example) * (1.0 / BATCH_SIZE)

    variables = model.trainable_variables

    def host_model_fn(*host_gradients):
        return optimizer.apply_gradients(zip(host_gradients, variables))

    if isinstance(optimizer, tf.train.Optimizer):
        grads_and_vars = optimizer.compute_gradients(loss, var_list=variables)
        gradients = [g for (g, _) in grads_and_vars]
    else:
        gradients = hostreduce.compute_gradients(loss, variables)
    return hostreduce.EstimatorSpec(mode=mode, loss=loss, train_op=tf.identity(loss),
                                    host_call=(host_model_fn, gradients))


hvd.init()
strategy = hostreduce.HorovodStrategy(variables_on_host=True)
config = hostreduce.RunConfig(
    session_config=tf.ConfigProto(allow_soft_placement=False),
    train_distribute=strategy,
)

parser = argparse.ArgumentParser()
parser.add_argument("--num-steps", type=int, default=400)
parser.add_argument("--model-dir")
args = parser.parse_args()

classifier = hostreduce.Estimator(config=config, model_fn=model_fn, model_dir=args.model_dir)
tf.logging.set_verbosity(tf.logging.INFO)
classifier.train(input_fn=input_fn, max_steps=args.num_steps)
print(f"RESULT rank {hvd.rank()}/{hvd.size()}: step={classifier.global_step}", flush=True)
