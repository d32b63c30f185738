"""A training step's lookup ids read from the batch with numpy (``hostreduce/ps_training/direct_ids.py``) equal
the traced function's, and anything but features passed through the allowed ops keeps
the traced function."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.tf

tf = pytest.importorskip("tensorflow")

from hostreduce.ps_training.direct_ids import feature_sources, read_ids  # noqa: E402

SIG = [{"ids": tf.TensorSpec([None, 8], tf.int64), "small": tf.TensorSpec([None, 2], tf.int32),
        "x": tf.TensorSpec([None, 3], tf.float32)}, tf.TensorSpec([None, 1], tf.float32)]


def _batch():
    rng = np.random.default_rng(0)
    features = {"ids": tf.constant(rng.integers(-5, 1000, (16, 8))),
                "small": tf.constant(rng.integers(0, 9, (16, 2)).astype(np.int32)), "x": tf.zeros([16, 3])}
    return features, tf.zeros([16, 1])


def test_ids_from_the_batch_equal_the_traced_function():
    def ids(features, labels):
        raw = features["ids"]
        rows = tf.cast(tf.constant([1000, 4])[0], tf.int64)  # Keras's wrap of negative ids
        return {"wrapped": tf.reshape(tf.where(raw < 0, raw + rows, raw), [-1]),
                "both": tf.concat([tf.reshape(raw, [-1]), tf.reshape(tf.cast(features["small"], tf.int64), [-1])], 0),
                "shifted": tf.expand_dims(tf.reshape(tf.cast(features["small"], tf.int64) + 1, [-1]), 0)}

    function = tf.function(ids, input_signature=SIG)
    plan = feature_sources(function, ["wrapped", "both", "shifted"])
    assert plan is not None and sorted(plan) == ["both", "shifted", "wrapped"]
    features, labels = _batch()
    expected = function(features, labels)
    got = read_ids(plan, tf.nest.flatten([features, labels]))
    for name, value in expected.items():
        assert got[name].dtype == np.int64
        np.testing.assert_array_equal(np.sort(got[name]), np.sort(value.numpy().reshape(-1)))


@pytest.mark.parametrize("body", [
    lambda f: tf.reshape(f["ids"][:4], [-1]),                                      # a slice of the batch
    lambda f: tf.reshape(f["ids"] + tf.cast(f["small"][:, :1], tf.int64), [-1]),   # two features combined
    lambda f: tf.reshape(tf.cast(f["x"], tf.int64), [-1]),                         # from floats
    lambda f: tf.reshape(f["ids"] * tf.constant([1, 2, 3, 4, 5, 6, 7, 8], tf.int64), [-1]),  # a vector constant
])
def test_other_ids_keep_the_traced_function(body):
    function = tf.function(lambda features, labels: {"ids": body(features)}, input_signature=SIG)
    assert feature_sources(function, ["ids"]) is None
