"""The recommender's model and data: a wide-and-deep click model and a synthetic,
deterministic click log (nothing is downloaded).

Every example has ``FIELDS`` categorical ids (user, item, ad, ... hashed into one table of
``vocab`` rows: field ``f`` owns rows ``[f * vocab // FIELDS, (f + 1) * vocab // FIELDS)``)
and ``DENSE`` numeric features. Ids are skewed towards the start of each field's range
(``u ** 3`` of a uniform ``u``), so a few ids are hot and most are rare, as in real
click logs. The label is a click drawn with probability ``sigmoid(true logit)``, where
the true logit sums a fixed pseudo-random weight per id (a hash of the id, so no table
of true weights is stored) and a fixed linear function of the numeric features: the
model can learn it, hot ids first.

Each batch is a pure function of ``(seed, stream, index)`` (stateless random ops), so
every run, worker count and restart sees the same data; training workers read disjoint
streams, and evaluation reads a stream no worker trains on (held-out data).

The model (``model_fn``): deep part ``Embedding(vocab, dim)`` of every field,
concatenated with the numeric features, through ``Dense(256, relu)``,
``Dense(128, relu)``, ``Dense(1)``; wide part ``Embedding(vocab, 1)`` summed over the
fields, added to the logit. Loss: mean sigmoid cross-entropy. Adam applies the
gradients in ``host_call`` (on the parameter servers under
``hostreduce.ParameterServerStrategy``, on the host of each worker under the ring).
``keras_model`` is the same model as a Keras functional model, for ``model.fit``.
"""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["FIELDS", "DENSE", "HIDDEN", "EVAL_STREAM", "click_batch", "make_input_fn", "model_fn", "keras_model"]

FIELDS = 8
DENSE = 13
HIDDEN = (256, 128)
EVAL_STREAM = 1 << 20  # the held-out stream: no training worker reads it
_MIX = 2654435761      # Knuth's multiplicative hash constant


def click_batch(seed: int, stream: Any, index: Any, batch: int, vocab: int) -> tuple[dict[str, Any], Any]:
    """Batch ``index`` of stream ``stream``: ``({"ids": int64 [batch, FIELDS], "x":
    float32 [batch, DENSE]}, clicks float32 [batch, 1])``, the same for the same inputs."""
    import tensorflow as tf

    key = tf.stack([tf.cast(seed, tf.int64) * 1_000_003 + tf.cast(stream, tf.int64), tf.cast(index, tf.int64)])
    k_ids, k_x, k_click = (tf.random.experimental.stateless_fold_in(key, i) for i in range(3))
    span = vocab // FIELDS
    u = tf.random.stateless_uniform([batch, FIELDS], k_ids, dtype=tf.float32)
    local = tf.minimum(tf.cast(tf.floor(u * u * u * span), tf.int64), span - 1)
    ids = local + tf.range(FIELDS, dtype=tf.int64) * span
    x = tf.random.stateless_normal([batch, DENSE], k_x, dtype=tf.float32)
    # The true weight of an id: its hash mapped to [-1, 1); fixed per id, no table.
    hashed = tf.math.floormod(ids * _MIX, 1 << 16)
    id_weight = tf.cast(hashed, tf.float32) / float(1 << 15) - 1.0
    x_weight = tf.linspace(-0.5, 0.5, DENSE)
    true_logit = 0.6 * tf.reduce_sum(id_weight, axis=1) + tf.linalg.matvec(x, x_weight) - 1.0
    clicks = tf.cast(tf.random.stateless_uniform([batch], k_click) < tf.sigmoid(true_logit), tf.float32)
    return {"ids": ids, "x": x}, clicks[:, None]


def make_input_fn(batch: int, vocab: int, seed: int = 0, eval_batches: int | None = None) -> Callable[..., Any]:
    """``input_fn(mode, input_context)``: training, an endless stream per worker
    (``batch`` examples per worker per step); with ``eval_batches``, that many held-out
    batches shared out over the workers."""
    def input_fn(mode: Any = None, input_context: Any = None) -> Any:
        import tensorflow as tf

        workers = input_context.num_input_pipelines if input_context is not None else 1
        worker = input_context.input_pipeline_id if input_context is not None else 0
        if eval_batches is None:
            indices = tf.data.Dataset.range(1 << 62)
            make = lambda i: click_batch(seed, worker, i, batch, vocab)  # noqa: E731
        else:
            indices = tf.data.Dataset.range(eval_batches).shard(workers, worker)
            make = lambda i: click_batch(seed, EVAL_STREAM, i, batch, vocab)  # noqa: E731
        return indices.map(make).prefetch(2)

    return input_fn


def model_fn(features: Any, labels: Any, mode: str, params: dict) -> Any:
    """The Estimator's ``model_fn``; ``params``: ``vocab``, ``dim``, ``learning_rate``."""
    import keras
    import tensorflow as tf

    from hostreduce.estimator import EstimatorSpec, ModeKeys, compute_gradients

    table = keras.layers.Embedding(params["vocab"], params["dim"], name="deep_embedding")
    wide = keras.layers.Embedding(params["vocab"], 1, embeddings_initializer="zeros", name="wide_embedding")
    layers = [keras.layers.Dense(units, activation="relu", name=f"hidden{i}") for i, units in enumerate(HIDDEN)]
    layers.append(keras.layers.Dense(1, name="logit"))
    ids = features["ids"]
    rows = table(ids)
    h = tf.concat([tf.reshape(rows, [-1, FIELDS * params["dim"]]), features["x"]], axis=1)
    for layer in layers:
        h = layer(h)
    logits = h + tf.reduce_sum(wide(ids), axis=1)
    if mode == ModeKeys.PREDICT:
        return EstimatorSpec(mode, predictions={"click_probability": tf.sigmoid(logits)})
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))
    if mode == ModeKeys.TRAIN:
        variables = table.trainable_variables + wide.trainable_variables + [
            v for layer in layers for v in layer.trainable_variables]
        optimizer = keras.optimizers.Adam(params["learning_rate"])
        grads = compute_gradients(loss, variables)  # the tables' as IndexedSlices: the batch's rows only

        def host_fn(*grads: Any) -> None:  # run where the variables live (the ps, or the host)
            optimizer.apply_gradients(zip(grads, variables))

        return EstimatorSpec(mode, loss=loss, train_op=tf.identity(loss), host_call=(host_fn, grads))
    auc, accuracy = keras.metrics.AUC(name="auc"), keras.metrics.BinaryAccuracy(name="accuracy")
    probabilities = tf.sigmoid(logits)
    auc.update_state(labels, probabilities)
    accuracy.update_state(labels, probabilities)
    return EstimatorSpec(mode, loss=loss, eval_metric_ops={"auc": auc, "accuracy": accuracy})


def keras_model(vocab: int, dim: int) -> Any:
    """The same model for Keras ``fit``: inputs ``{"ids", "x"}``, output the click logit."""
    import keras

    ids = keras.Input((FIELDS,), dtype="int64", name="ids")
    x = keras.Input((DENSE,), name="x")
    rows = keras.layers.Embedding(vocab, dim, name="deep_embedding")(ids)
    h = keras.layers.Concatenate()([keras.layers.Flatten()(rows), x])
    for i, units in enumerate(HIDDEN):
        h = keras.layers.Dense(units, activation="relu", name=f"hidden{i}")(h)
    wide = keras.layers.Embedding(vocab, 1, embeddings_initializer="zeros", name="wide_embedding")(ids)
    logits = keras.layers.Dense(1, name="logit")(h) + keras.ops.sum(wide, axis=1)
    return keras.Model({"ids": ids, "x": x}, logits, name="wide_deep")
