"""A script in the shape of an IPU Estimator multi-worker example, ported by renames:
``import tensorflow.compat.v1 as tf``, Keras layers built in ``model_fn``, a TF1
optimizer's ``compute_gradients`` on the device and ``apply_gradients`` in
``host_call``, ``tf.compat.v1.metrics`` in evaluation, ``EvalSpec`` without ``steps``
on a repeating dataset, the cluster from ``TFConfigClusterResolver``, device and
session settings passed to ``RunConfig``, and no ``close()`` anywhere.

``SEED_OPTIMIZER=keras`` uses a Keras Adam instead of ``tf.compat.v1.train.AdamOptimizer``.
"""
import argparse
import os

import numpy as np

import tensorflow.compat.v1 as tf

import hostreduce

from tests.seed_workers import digits

BATCH_SIZE = 32


def input_fn(mode, input_context=None):
    (images, labels), _ = digits.load_data()
    images = np.expand_dims(images.astype(np.float32) / 255.0, axis=-1)
    labels = labels.astype(np.int32)
    rank = input_context.input_pipeline_id if input_context else 0
    rows = digits.maybe_failing(images, rank) if mode == hostreduce.ModeKeys.TRAIN else images

    def examples():
        return zip(rows, labels)

    dataset = tf.data.Dataset.from_generator(examples, (images.dtype, labels.dtype),
                                             (images.shape[1:], labels.shape[1:]))
    if input_context:
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
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
    if mode == hostreduce.ModeKeys.EVAL:
        predictions = tf.argmax(input=logits, axis=-1)
        keras_accuracy = tf.keras.metrics.Accuracy()
        keras_accuracy.update_state(labels, predictions)
        return hostreduce.EstimatorSpec(mode, loss=loss, eval_metric_ops={
            "accuracy": tf.compat.v1.metrics.accuracy(labels=labels, predictions=predictions),
            "keras_accuracy": keras_accuracy,
        })

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


cluster = tf.distribute.cluster_resolver.TFConfigClusterResolver()
strategy = hostreduce.MultiWorkerStrategy(cluster, variables_on_host=True)
config = hostreduce.RunConfig(
    session_config=tf.ConfigProto(allow_soft_placement=False),
    iterations_per_loop=1,
    train_distribute=strategy,
)

parser = argparse.ArgumentParser()
parser.add_argument("--num-steps", type=int, default=400)
parser.add_argument("--model-dir")
args = parser.parse_args()

classifier = hostreduce.Estimator(config=config, model_fn=model_fn, model_dir=args.model_dir)
tf.logging.set_verbosity(tf.logging.INFO)
metrics, _ = hostreduce.train_and_evaluate(
    classifier,
    train_spec=hostreduce.TrainSpec(input_fn=input_fn, max_steps=args.num_steps),
    eval_spec=hostreduce.EvalSpec(input_fn=input_fn))
print(f"RESULT rank {strategy.rank}: accuracy={metrics['accuracy']:.6f} "
      f"keras_accuracy={metrics['keras_accuracy']:.6f} loss={metrics['loss']:.6f} step={metrics['global_step']}",
      flush=True)
