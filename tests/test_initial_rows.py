"""The chief computes the initial value of a table the ps shard by rows by blocks of
rows (``hostreduce/ps_training/initial_rows.py``), so that TensorFlow's CPU allocator,
which keeps the most memory it ever held, never holds the table whole: the value is the
one the initializer computes whole, bit for bit, and an initializer whose value cannot
be computed by rows is computed whole, as it is, with a warning."""
from __future__ import annotations

import logging

import numpy as np
import pytest

pytestmark = pytest.mark.tf

SHAPE = (1001, 7)  # rows of 7 elements: blocks start at multiples of 4 rows, not of a row's size
BLOCK = 1024       # 36 rows of float32 (28 blocks, the last one short), 72 of float16


def _keras3():
    import keras

    i = keras.initializers
    return {"RandomUniform": i.RandomUniform(seed=1), "RandomNormal": i.RandomNormal(seed=2),
            "TruncatedNormal": i.TruncatedNormal(seed=3), "GlorotUniform": i.GlorotUniform(seed=4),
            "HeNormal": i.HeNormal(seed=5), "unseeded": i.RandomUniform(), "Zeros": i.Zeros(), "Ones": i.Ones(),
            "Constant": i.Constant(0.25)}


def _tf_keras():
    tf_keras = pytest.importorskip("tf_keras")
    i = tf_keras.initializers
    return {"RandomUniform": i.RandomUniform(seed=1), "RandomNormal": i.RandomNormal(seed=2),
            "TruncatedNormal": i.TruncatedNormal(seed=3), "GlorotNormal": i.GlorotNormal(seed=4),
            "Zeros": i.Zeros()}


def _by_rows(init, dtype: str, caplog) -> tuple[np.ndarray, np.ndarray, int]:
    """The value by rows, the value computed whole, and the most elements of a tensor
    that an op made while the value was computed by rows."""
    from tensorflow.python.framework import op_callbacks

    from hostreduce.ps_training.initial_rows import initial_value_in_rows

    whole = np.asarray(init(SHAPE, dtype=dtype))
    largest = [0]

    def watch(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        largest[0] = max([largest[0]] + [int(np.prod(t.shape)) for t in outputs])

    op_callbacks.add_op_callback(watch)
    try:
        with caplog.at_level(logging.WARNING, logger="hostreduce.ps"):
            got = initial_value_in_rows(lambda: init(SHAPE, dtype=dtype), SHAPE, dtype, "table", block_bytes=BLOCK)
    finally:
        op_callbacks.remove_op_callback(watch)
    return got, whole, largest[0]


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("api", ["keras3", "tf_keras"])
def test_by_rows_the_value_is_the_whole_initializers(api: str, dtype: str, caplog) -> None:
    for name, init in (_keras3() if api == "keras3" else _tf_keras()).items():
        got, whole, largest = _by_rows(init, dtype, caplog)
        assert got.dtype == whole.dtype and got.shape == SHAPE, name
        np.testing.assert_array_equal(got, whole, err_msg=name)
        rows = BLOCK // (SHAPE[1] * np.dtype(dtype).itemsize) // 4 * 4
        assert largest <= rows * SHAPE[1], (name, largest)  # TensorFlow made one block at a time
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # every block computed by rows


def test_an_initializer_not_by_rows_is_computed_whole_with_a_warning(caplog) -> None:
    import keras
    import tensorflow as tf

    def centred(shape, dtype):  # a mean over the rows: a block's mean is not the table's
        x = tf.random.stateless_uniform(shape, seed=[1, 2], dtype=dtype)
        return x - tf.reduce_mean(x, axis=0)

    for name, init in {"Orthogonal": keras.initializers.Orthogonal(seed=2), "Identity": keras.initializers.Identity(),
                       "centred": centred, "numpy": lambda shape, dtype: np.full(shape, 2.0, dtype)}.items():
        caplog.clear()
        got, whole, _ = _by_rows(init, "float32", caplog)
        np.testing.assert_array_equal(got, whole, err_msg=name)
        assert "computed whole on the chief" in caplog.text, name


def test_a_seed_generator_is_drawn_from_as_by_one_call(caplog) -> None:
    """A block stops at the generator's first op, before its state advances: the value
    is the one a single call of the initializer gives."""
    import keras
    from hostreduce.ps_training.initial_rows import initial_value_in_rows

    want = np.asarray(keras.initializers.RandomUniform(seed=keras.random.SeedGenerator(5))(SHAPE, dtype="float32"))
    init = keras.initializers.RandomUniform(seed=keras.random.SeedGenerator(5))
    got = initial_value_in_rows(lambda: init(SHAPE, dtype="float32"), SHAPE, "float32", block_bytes=BLOCK)
    np.testing.assert_array_equal(got, want)
