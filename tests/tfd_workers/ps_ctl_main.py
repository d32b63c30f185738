"""The custom-training-loop part of TensorFlow's parameter-server tutorial
(``parameter_server_training``), with the same calls in the same order: Keras
preprocessing models built in ``strategy.scope()``, a model with an embedding and its
optimizer and metric built in the scope, a ``step_fn`` (``tf.function``) calling
``strategy.run`` and ``strategy.reduce``, ``tf.distribute.coordinator.ClusterCoordinator``,
``create_per_worker_dataset`` of a ``tf.function`` returning
``strategy.distribute_datasets_from_function(dataset_fn)``, the ``schedule``/``join``
epochs, ``fetch`` of the final loss, then the tutorial's two evaluations (a plain loop,
and ``eval_step`` scheduled on a per-worker dataset). Changed:

* the cluster: ``TF_CONFIG`` with ``ps`` tasks, every task running this script (the
  tutorial's in-process ``tf.distribute.Server`` cluster has no counterpart; a ps task
  serves from the end of the ``strategy.scope()`` block that makes the optimizer), and
  the strategy line: ``hostreduce.ParameterServerStrategy()`` for
  ``tf.distribute.ParameterServerStrategy(cluster_resolver, variable_partitioner=...)``;
* the tutorial's check that TensorFlow's partitioner split the embedding in two: the
  table (8 rows, 512 KiB) is below hostreduce's ``shard_bytes`` (4 MiB), so it stays whole;
* on Keras 3 only (``KERAS3``; under ``TF_USE_LEGACY_KERAS=1`` the tutorial's own
  lines run): ``tf.keras.ops.mean`` on the embedding's output (Keras 3 refuses a
  ``KerasTensor`` given to ``tf.reduce_mean``), a variable's ``value.device`` (a Keras 3
  variable has no ``device``), the preprocessing models mapped over batches, not
  examples (Keras 3's functional models take a batch), and the metric's
  ``reset_state`` (``reset_states``). (``tf.keras.optimizers.legacy.RMSprop``, which
  Keras 3 refuses, stays: in the strategy's scope it makes Keras 3's RMSprop.)

Each training task prints the tutorial's lines, its per-epoch accuracies and final loss
as ``ACCURACIES`` and ``FINAL_LOSS``, and ``RESULT rank R/N: weights=<digest>``.

Run: ``hostreduce run -np 2 --ps 2 -- python ps_ctl_main.py``.
"""
import json
import os
import random

import tensorflow as tf

import hostreduce
from tests.hvd_workers.digest import report

KERAS3 = os.environ.get("TF_USE_LEGACY_KERAS") != "1"

# Set the environment variable to allow reporting worker and ps failure to the
# coordinator. This is a workaround and won't be necessary in the future.
os.environ["GRPC_FAIL_FAST"] = "use_caller"

NUM_PS = 2

variable_partitioner = (
    tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=(256 << 10),
        max_shards=NUM_PS))

strategy = hostreduce.ParameterServerStrategy()

feature_vocab = [
    "avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"
]
label_vocab = ["yes", "no"]

with strategy.scope():
    feature_lookup_layer = tf.keras.layers.StringLookup(
        vocabulary=feature_vocab,
        mask_token=None)
    label_lookup_layer = tf.keras.layers.StringLookup(
        vocabulary=label_vocab,
        num_oov_indices=0,
        mask_token=None)

    raw_feature_input = tf.keras.layers.Input(
        shape=(3,),
        dtype=tf.string,
        name="feature")
    feature_id_input = feature_lookup_layer(raw_feature_input)
    feature_preprocess_stage = tf.keras.Model(
        {"features": raw_feature_input},
        feature_id_input)

    raw_label_input = tf.keras.layers.Input(
        shape=(1,),
        dtype=tf.string,
        name="label")
    label_id_input = label_lookup_layer(raw_label_input)

    label_preprocess_stage = tf.keras.Model(
        {"label": raw_label_input},
        label_id_input)


def feature_and_label_gen(num_examples=200):
    examples = {"features": [], "label": []}
    for _ in range(num_examples):
        features = random.sample(feature_vocab, 3)
        label = ["yes"] if "avenger" in features else ["no"]
        examples["features"].append(features)
        examples["label"].append(label)
    return examples


examples = feature_and_label_gen()


def dataset_fn(_):
    raw_dataset = tf.data.Dataset.from_tensor_slices(examples)

    if KERAS3:
        train_dataset = raw_dataset.shuffle(200).batch(32).map(
            lambda x: (
                {"features": feature_preprocess_stage(x["features"])},
                label_preprocess_stage(x["label"])
            )).repeat()
        return train_dataset
    train_dataset = raw_dataset.map(
        lambda x: (
            {"features": feature_preprocess_stage(x["features"])},
            label_preprocess_stage(x["label"])
        )).shuffle(200).batch(32).repeat()
    return train_dataset


# These variables created under the `Strategy.scope` will be placed on parameter
# servers in a round-robin fashion.
with strategy.scope():
    # Create the model. The input needs to be compatible with Keras processing layers.
    model_input = tf.keras.layers.Input(
        shape=(3,), dtype=tf.int64, name="model_input")

    emb_layer = tf.keras.layers.Embedding(
        input_dim=len(feature_lookup_layer.get_vocabulary()), output_dim=16384)
    if KERAS3:
        emb_output = tf.keras.ops.mean(emb_layer(model_input), axis=1)
    else:
        emb_output = tf.reduce_mean(emb_layer(model_input), axis=1)
    dense_output = tf.keras.layers.Dense(
        units=1, activation="sigmoid",
        kernel_regularizer=tf.keras.regularizers.L2(1e-4),
    )(emb_output)
    model = tf.keras.Model({"features": model_input}, dense_output)

    optimizer = tf.keras.optimizers.legacy.RMSprop(learning_rate=0.1)
    accuracy = tf.keras.metrics.Accuracy()

assert len(emb_layer.weights) == 1  # whole: below shard_bytes (the tutorial: 2 shards of 4 rows)
assert emb_layer.weights[0].shape == (8, 16384)

print(emb_layer.weights[0].value.device if KERAS3 else emb_layer.weights[0].device)


@tf.function
def step_fn(iterator):

    def replica_fn(batch_data, labels):
        with tf.GradientTape() as tape:
            pred = model(batch_data, training=True)
            per_example_loss = tf.keras.losses.BinaryCrossentropy(
                reduction=tf.keras.losses.Reduction.NONE)(labels, pred)
            loss = tf.nn.compute_average_loss(per_example_loss)
            model_losses = model.losses
            if model_losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
        gradients = tape.gradient(loss, model.trainable_variables)

        optimizer.apply_gradients(zip(gradients, model.trainable_variables))

        actual_pred = tf.cast(tf.greater(pred, 0.5), tf.int64)
        accuracy.update_state(labels, actual_pred)
        return loss

    batch_data, labels = next(iterator)
    losses = strategy.run(replica_fn, args=(batch_data, labels))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)


coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)


@tf.function
def per_worker_dataset_fn():
    return strategy.distribute_datasets_from_function(dataset_fn)


per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
per_worker_iterator = iter(per_worker_dataset)

accuracies = []
num_epochs = 4
steps_per_epoch = 5
for i in range(num_epochs):
    accuracy.reset_state() if KERAS3 else accuracy.reset_states()
    for _ in range(steps_per_epoch):
        coordinator.schedule(step_fn, args=(per_worker_iterator,))
    # Wait at epoch boundaries.
    coordinator.join()
    print("Finished epoch %d, accuracy is %f." % (i, accuracy.result().numpy()))
    accuracies.append(float(accuracy.result().numpy()))

loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
print("Final loss is %f" % loss.fetch())

if KERAS3:
    eval_dataset = tf.data.Dataset.from_tensor_slices(
        feature_and_label_gen(num_examples=16)).batch(8).map(
            lambda x: (
                {"features": feature_preprocess_stage(x["features"])},
                label_preprocess_stage(x["label"])
            ))
else:
    eval_dataset = tf.data.Dataset.from_tensor_slices(
        feature_and_label_gen(num_examples=16)).map(
            lambda x: (
                {"features": feature_preprocess_stage(x["features"])},
                label_preprocess_stage(x["label"])
            )).batch(8)

eval_accuracy = tf.keras.metrics.Accuracy()

for batch_data, labels in eval_dataset:
    pred = model(batch_data, training=False)
    actual_pred = tf.cast(tf.greater(pred, 0.5), tf.int64)
    eval_accuracy.update_state(labels, actual_pred)

print("Evaluation accuracy: %f" % eval_accuracy.result())

with strategy.scope():
    # Define the eval metric on parameter servers.
    eval_accuracy = tf.keras.metrics.Accuracy()


@tf.function
def eval_step(iterator):
    def replica_fn(batch_data, labels):
        pred = model(batch_data, training=False)
        actual_pred = tf.cast(tf.greater(pred, 0.5), tf.int64)
        eval_accuracy.update_state(labels, actual_pred)
    batch_data, labels = next(iterator)
    strategy.run(replica_fn, args=(batch_data, labels))


def eval_dataset_fn():
    if KERAS3:
        return tf.data.Dataset.from_tensor_slices(
            feature_and_label_gen(num_examples=16)).shuffle(16).repeat().batch(8).map(
                lambda x: (
                    {"features": feature_preprocess_stage(x["features"])},
                    label_preprocess_stage(x["label"])
                ))
    return tf.data.Dataset.from_tensor_slices(
        feature_and_label_gen(num_examples=16)).map(
            lambda x: (
                {"features": feature_preprocess_stage(x["features"])},
                label_preprocess_stage(x["label"])
            )).shuffle(16).repeat().batch(8)


per_worker_eval_dataset = coordinator.create_per_worker_dataset(eval_dataset_fn)
per_worker_eval_iterator = iter(per_worker_eval_dataset)

eval_steps_per_epoch = 2
for _ in range(eval_steps_per_epoch):
    coordinator.schedule(eval_step, args=(per_worker_eval_iterator,))
coordinator.join()
print("Evaluation accuracy: %f" % eval_accuracy.result())

print("ACCURACIES", json.dumps(accuracies), flush=True)
print("FINAL_LOSS", json.dumps(float(loss.fetch())), flush=True)
report(strategy.rank, strategy.size, model.weights)
