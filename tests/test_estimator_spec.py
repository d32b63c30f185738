"""EstimatorSpec/host_call validation, RunConfig validation and model_fn signatures."""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from hostreduce.errors import ConfigError, SpecError  # noqa: E402
from hostreduce.estimator import (  # noqa: E402
    Estimator, EstimatorSpec, ModeKeys, RunConfig, compute_gradients, host_train_spec)

pytestmark = pytest.mark.tf


def _input_fn(mode, input_context=None):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()


def _train_with(make_spec):
    def model_fn(features, labels, mode, params):
        model = keras.Sequential([keras.layers.Dense(3), keras.layers.Dense(2)])
        logits = model(features)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
        return make_spec(mode, loss, model)

    Estimator(model_fn).train(_input_fn, steps=1)


def test_train_without_loss() -> None:
    with pytest.raises(SpecError, match="requires `loss`"):
        _train_with(lambda mode, loss, model: EstimatorSpec(mode, train_op=tf.identity(loss)))


@pytest.mark.parametrize("host_call", [
    "not a pair",
    (lambda *g: None,),
    (lambda *g: None, "grads"),
    ("fn", []),
])
def test_malformed_host_call(host_call) -> None:
    with pytest.raises(SpecError, match="host_call"):
        _train_with(lambda mode, loss, model: EstimatorSpec(mode, loss=loss, host_call=host_call))


def test_host_call_arity_mismatch() -> None:
    def make(mode, loss, model):
        grads = compute_gradients(loss, model.trainable_variables)
        return EstimatorSpec(mode, loss=loss, host_call=(lambda a, b: None, grads))

    with pytest.raises(SpecError, match="cannot take 4 positional arguments"):
        _train_with(make)


def test_none_gradient_names_the_variable() -> None:
    def make(mode, loss, model):
        unused = keras.Variable(np.zeros(3, "float32"), name="unused_weight")
        compute_gradients(loss, model.trainable_variables + [unused])

    with pytest.raises(SpecError, match="unused_weight"):
        _train_with(make)


def test_none_tensor_in_host_call() -> None:
    with pytest.raises(SpecError, match="tensor #1 is None"):
        _train_with(lambda mode, loss, model: EstimatorSpec(mode, loss=loss, host_call=(lambda *a: None, [loss, None])))


def test_wrong_return_and_mode() -> None:
    with pytest.raises(SpecError, match="must return an EstimatorSpec"):
        _train_with(lambda mode, loss, model: {"loss": loss})
    with pytest.raises(SpecError, match="mode"):
        _train_with(lambda mode, loss, model: EstimatorSpec("bogus", loss=loss))


def test_predict_requires_predictions() -> None:
    with pytest.raises(SpecError, match="predictions"):
        EstimatorSpec(ModeKeys.PREDICT).validate()


def test_model_fn_without_features() -> None:
    with pytest.raises(SpecError, match="features"):
        Estimator(lambda x, y: None)


def test_run_config_validation() -> None:
    with pytest.raises(ConfigError, match="save_checkpoints_steps"):
        RunConfig(save_checkpoints_steps=0)
    with pytest.raises(ConfigError, match="train_distribute"):
        RunConfig(train_distribute="ring")
    with pytest.raises(ConfigError, match="steps"):
        Estimator(lambda features, labels, mode: None).train(_input_fn, steps=1, max_steps=2)


def test_signatures_input_context_and_host_train_spec() -> None:
    """model_fn(features, labels, mode) with host_train_spec; input_fn(input_context)."""
    seen = {}

    def input_fn(input_context):
        seen["context"] = (input_context.num_input_pipelines, input_context.input_pipeline_id)
        return _input_fn(ModeKeys.TRAIN)

    def model_fn(features, labels, mode):
        model = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
        logits = model(features)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
        seen["model"] = model
        return host_train_spec(mode, loss, keras.optimizers.Adam(0.05), model.trainable_variables,
                               eval_metric_ops={"mean_logit": tf.reduce_mean(logits)})

    est = Estimator(model_fn)
    before = est.evaluate(_input_fn, steps=4)
    est.train(input_fn, steps=30)
    after = est.evaluate(_input_fn, steps=4)
    assert seen["context"] == (1, 0)
    assert after["global_step"] == 30 and after["loss"] < before["loss"]
    assert set(after) == {"loss", "mean_logit", "global_step"}
    # Evaluation ran the model trained by the training program (shared variables).
    names = est.get_variable_names()
    assert any(n.startswith("adam/") and "momentum" in n for n in names)
    assert est.get_variable_value("adam/iteration") == 30
