"""What scripts ported from ``tf.estimator``, the IPU Estimator and TF Adapter expect of
the Estimator API, in one process: ``EvalSpec``'s default steps, TF1 metric pairs,
``RunConfig`` device and session settings, ``input_fn(mode, params)``, the field order
of ``EstimatorSpec`` and its ``eval_metrics``, progress through TensorFlow's logger."""
from __future__ import annotations

import logging
import os
import warnings

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
from tests.tf_workers import tf_common as common  # noqa: E402

from hostreduce.errors import ConfigError, SpecError  # noqa: E402
from hostreduce.estimator import (  # noqa: E402
    Estimator, EstimatorSpec, EvalSpec, ModeKeys, RunConfig, TrainSpec, train_and_evaluate)
from hostreduce.estimator import run_config as run_config_module  # noqa: E402

pytestmark = pytest.mark.tf


def _metrics_model_fn(features, labels, mode):
    model = keras.Sequential([keras.layers.Dense(common.CLASSES)])
    logits = model(features)
    loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
    predictions = tf.argmax(logits, axis=-1)
    if mode == ModeKeys.TRAIN:
        from hostreduce.estimator import host_train_spec

        return host_train_spec(mode, loss, keras.optimizers.SGD(0.1), model.trainable_variables)
    keras_accuracy = keras.metrics.Accuracy()
    keras_accuracy.update_state(labels, predictions)
    keras_loss = keras.metrics.Mean()
    keras_loss.update_state(loss)
    keras_rmse = keras.metrics.RootMeanSquaredError()
    keras_rmse.update_state(tf.cast(labels, tf.float32), tf.cast(predictions, tf.float32))
    return EstimatorSpec(mode, loss=loss, eval_metric_ops={
        "accuracy": tf.compat.v1.metrics.accuracy(labels=labels, predictions=predictions),
        "keras_accuracy": keras_accuracy,
        "mean_loss": tf.compat.v1.metrics.mean(loss),
        "keras_mean_loss": keras_loss,
        "keras_rmse": keras_rmse,
        "rmse": tf.compat.v1.metrics.root_mean_squared_error(tf.cast(labels, tf.float32),
                                                             tf.cast(predictions, tf.float32)),
    })


def test_tf1_metric_pairs_equal_keras_metrics_and_reset_per_evaluation() -> None:
    est = Estimator(_metrics_model_fn, config=RunConfig(log_step_count_steps=None))
    eval_input = common.make_input_fn(repeat=False)
    first = est.evaluate(eval_input, steps=7)
    again = est.evaluate(eval_input, steps=7)
    assert first == again  # state starts from zero at every evaluation
    assert first["accuracy"] == pytest.approx(first["keras_accuracy"], abs=1e-7)
    assert first["mean_loss"] == pytest.approx(first["keras_mean_loss"], rel=1e-6)
    est.train(common.make_input_fn(), steps=5)
    trained = est.evaluate(eval_input, steps=7)
    assert trained["accuracy"] == pytest.approx(trained["keras_accuracy"], abs=1e-7)
    # The RMSE over all 7 batches (not an average of per-batch values), as Keras computes it.
    assert trained["rmse"] == pytest.approx(trained["keras_rmse"], rel=1e-6)
    # Metric state is per evaluation: it is neither saved nor listed with the model.
    assert not [n for n in est.get_variable_names() if "accuracy" in n or "total" in n], est.get_variable_names()


def test_eval_spec_defaults_to_100_steps_on_a_repeating_dataset() -> None:
    assert EvalSpec(lambda: None).steps == 100
    batches = []

    input_fn = common.make_input_fn(repeat=True)

    def counting_model_fn(features, labels, mode):
        spec = _metrics_model_fn(features, labels, mode)
        if mode == ModeKeys.EVAL:
            counter = tf.numpy_function(lambda: batches.append(1) or np.int32(0), [], tf.int32)
            with tf.control_dependencies([counter]):
                spec = spec._replace(loss=tf.identity(spec.loss))
        return spec

    est = Estimator(counting_model_fn, config=RunConfig(log_step_count_steps=None))
    metrics, _ = train_and_evaluate(est, TrainSpec(input_fn, max_steps=3), EvalSpec(input_fn))
    assert len(batches) == 100 and metrics["global_step"] == 3
    with pytest.raises(ConfigError, match="hooks"):
        train_and_evaluate(est, TrainSpec(input_fn, max_steps=3), EvalSpec(input_fn, hooks=[object()]))


def test_run_config_accepts_device_settings_with_one_warning_each(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_config_module, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = RunConfig(session_config=tf.compat.v1.ConfigProto(allow_soft_placement=False),
                           ipu_run_config=object(), iterations_per_loop=100, precision_mode="allow_mix_precision",
                           save_checkpoints_steps=10)
        RunConfig(session_config=None, iterations_per_loop=1)
        replaced = config.replace(save_checkpoints_steps=20)
    messages = [str(w.message) for w in caught]
    for name in ("session_config", "ipu_run_config", "iterations_per_loop", "precision_mode"):
        assert sum(f"`{name}`" in m for m in messages) == 1, messages
    assert all(w.filename == __file__ for w in caught), [w.filename for w in caught]
    assert replaced.save_checkpoints_steps == 20 and set(replaced.device_options) == set(config.device_options)
    with pytest.raises(ConfigError, match=r"unknown argument\(s\) \['save_checkpoint_steps'\]"):
        RunConfig(save_checkpoint_steps=10)
    with pytest.raises(ConfigError, match="save_checkpoints_secs"):
        RunConfig(save_checkpoints_secs=-1)


def test_tf_random_seed_repeats_initial_weights() -> None:
    def initial_loss(seed: int) -> float:
        est = Estimator(common.mlp_model_fn, params={"optimizer": "sgd"},
                        config=RunConfig(tf_random_seed=seed, log_step_count_steps=None))
        return est.evaluate(common.make_input_fn(repeat=False), steps=2)["loss"]

    first = initial_loss(3)
    assert initial_loss(3) == first
    assert initial_loss(4) != first


def test_input_is_read_without_the_autotune_thread_unless_the_dataset_asks() -> None:
    # TensorFlow's iterator destructor waits for its autotune thread, which could hold up
    # the end of train() (and the exit of a script) for up to a minute.
    est = Estimator(common.mlp_model_fn)
    assert est._dataset(common.make_input_fn(), ModeKeys.TRAIN).options().autotune.enabled is False

    def tuned_input_fn(mode):
        options = tf.data.Options()
        options.autotune.enabled = True
        return common.make_input_fn()(mode).with_options(options)

    assert est._dataset(tuned_input_fn, ModeKeys.TRAIN).options().autotune.enabled is True


def test_input_fn_gets_params_and_config() -> None:
    seen = {}

    def input_fn(mode, params, config):
        seen.update(mode=mode, params=params, config=config)
        return common.make_input_fn()(mode)

    config = RunConfig(log_step_count_steps=None)
    est = Estimator(common.mlp_model_fn, config=config, params={"optimizer": "sgd", "depth": 1})
    est.train(input_fn, steps=2)
    assert seen == {"mode": ModeKeys.TRAIN, "params": {"optimizer": "sgd", "depth": 1}, "config": config}


def test_estimator_spec_field_order_eval_metrics_and_session_hooks() -> None:
    spec = EstimatorSpec(ModeKeys.PREDICT, {"y": 1})  # tf.estimator's order: mode, predictions, loss, ...
    assert spec.predictions == {"y": 1} and spec.loss is None

    def model_fn(features, labels, mode):
        logits = keras.layers.Dense(common.CLASSES)(features)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
        predictions = tf.argmax(logits, axis=-1)

        def metric_fn(labels, predictions):
            return {"accuracy": tf.compat.v1.metrics.accuracy(labels, predictions)}

        return EstimatorSpec(mode, loss=loss, eval_metrics=(metric_fn, {"labels": labels, "predictions": predictions}))

    metrics = Estimator(model_fn).evaluate(common.make_input_fn(repeat=False), steps=3)
    assert 0.0 <= metrics["accuracy"] <= 1.0
    with pytest.raises(SpecError, match="training_hooks"):
        EstimatorSpec(ModeKeys.TRAIN, loss=1.0, train_op=1.0, training_hooks=[object()]).validate()


def test_progress_reaches_tensorflow_logging(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    est = Estimator(common.mlp_model_fn, params={"optimizer": "sgd"}, config=RunConfig(log_step_count_steps=2))
    est.train(common.make_input_fn(), steps=4)
    text = caplog.text
    assert "step 2: loss" in text and "step 4: loss" in text and "Loss for final step" in text, text


def test_progress_still_reaches_tensorflow_logging_after_a_root_handler_appears() -> None:
    """``logging.info`` anywhere (TensorFlow's checkpoint code calls it) installs a root
    handler at WARNING; progress lines must still reach TensorFlow's INFO logger."""
    from hostreduce.progress import progress

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    root, tf_logger = logging.getLogger(), logging.getLogger("tensorflow")
    saved = (root.handlers[:], root.level, tf_logger.handlers[:], tf_logger.level)
    try:
        root.handlers[:] = [logging.StreamHandler()]
        root.setLevel(logging.WARNING)
        tf_logger.handlers[:] = [Keep()]
        tf_logger.setLevel(logging.INFO)
        progress("step %d: loss = %.3f", 7, 0.5)
    finally:
        root.handlers[:], root.level, tf_logger.handlers[:], tf_logger.level = saved
    assert seen == ["step 7: loss = 0.500"]


def _tf1_model_fn(features, labels, mode):
    """A TF1-style model_fn: a TF1 optimizer's ``minimize`` with ``global_step`` inside it,
    and a tensor named for the hooks to fetch."""
    logits = keras.layers.Dense(common.CLASSES)(features)
    tf.nn.softmax(logits, name="probabilities")
    loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
    if mode != ModeKeys.TRAIN:
        return EstimatorSpec(mode, loss=loss)
    optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    return EstimatorSpec(mode, loss=loss,
                         train_op=optimizer.minimize(loss, global_step=tf.compat.v1.train.get_global_step()))


class _Recorder(tf.compat.v1.train.SessionRunHook):
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fetched: list[dict] = []

    def begin(self) -> None:
        graph = tf.compat.v1.get_default_graph()
        self.calls.append("begin")
        self.step = tf.compat.v1.train.get_global_step()
        self.names = sorted(v.name for v in tf.compat.v1.global_variables())
        self.probabilities = graph.get_tensor_by_name("probabilities:0")

    def after_create_session(self, session, coord) -> None:
        self.calls.append("after_create_session")
        self.initial_step = session.run(self.step)

    def before_run(self, run_context):
        self.calls.append("before_run")
        return tf.compat.v1.train.SessionRunArgs({"step": self.step, "probabilities": "probabilities:0"})

    def after_run(self, run_context, run_values) -> None:
        self.calls.append("after_run")
        self.fetched.append(run_values.results)

    def end(self, session) -> None:
        self.calls.append("end")
        self.final_step = session.run(self.step)


def test_session_run_hooks_are_called_as_tf_estimator_called_them(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    recorder, plain = _Recorder(), []
    est = Estimator(_tf1_model_fn, config=RunConfig(log_step_count_steps=None))
    est.train(common.make_input_fn(), steps=10, hooks=[
        recorder, tf.compat.v1.train.LoggingTensorHook({"probabilities": "probabilities"}, every_n_iter=2),
        tf.compat.v1.train.StopAtStepHook(num_steps=3), lambda step, loss: plain.append(step)])
    # StopAtStepHook ended training after 3 of the 10 steps.
    assert est.global_step == 3 and plain == [1, 2, 3] and int(est.get_variable_value("global_step")) == 3
    assert recorder.calls == ["begin", "after_create_session"] + ["before_run", "after_run"] * 3 + ["end"]
    assert len(recorder.names) == 3 and any("global_step" in n for n in recorder.names), recorder.names
    # Fetched on the step's batch, before the step's update (as in one TF1 session.run).
    assert [int(f["step"]) for f in recorder.fetched] == [0, 1, 2]
    assert all(f["probabilities"].shape == (common.GLOBAL_BATCH, common.CLASSES) for f in recorder.fetched)
    assert np.allclose(recorder.fetched[0]["probabilities"].sum(axis=1), 1.0, atol=1e-5)
    assert (recorder.initial_step, recorder.final_step) == (0, 3)
    assert caplog.text.count("probabilities = [[") == 2, caplog.text  # steps 1 and 3
    # A second train() call begins anew; a hook may not feed tensors; hooks are hooks.
    recorder.calls.clear()
    est.train(common.make_input_fn(), steps=1, hooks=[recorder])
    assert recorder.calls == ["begin", "after_create_session", "before_run", "after_run", "end"]
    assert int(recorder.fetched[-1]["step"]) == 3

    class Feeding(tf.compat.v1.train.SessionRunHook):
        def before_run(self, run_context):
            return tf.compat.v1.train.SessionRunArgs("probabilities:0", feed_dict={"x": 1})

    with pytest.raises(SpecError, match="feed_dict"):
        est.train(common.make_input_fn(), steps=1, hooks=[Feeding()])
    with pytest.raises(ConfigError, match=r"`hooks` must hold SessionRunHook objects.*hooks\[0\]"):
        est.train(common.make_input_fn(), steps=1, hooks=[object()])


def test_numpy_input_fn_as_tf_estimator_inputs() -> None:
    from hostreduce.estimator import inputs

    x = np.arange(10, dtype=np.float32).reshape(5, 2)
    y = np.arange(5, dtype=np.int32)
    batches = list(inputs.numpy_input_fn({"x": x}, y, batch_size=2, num_epochs=2, shuffle=False)())
    assert [len(b[1]) for b in batches] == [2, 2, 2, 2, 2]  # batches run on across the epochs
    assert np.array_equal(np.concatenate([b[0]["x"] for b in batches]), np.concatenate([x, x]))
    assert np.array_equal(np.concatenate([b[1] for b in batches]), np.concatenate([y, y]))
    last = list(inputs.numpy_input_fn(x, batch_size=3, shuffle=False)())
    assert [len(b) for b in last] == [3, 2]  # features alone; a smaller last batch
    shuffled = next(iter(inputs.numpy_input_fn({"x": x}, y, batch_size=5, num_epochs=None, shuffle=True)()))
    assert sorted(shuffled[1].numpy()) == list(y)
    assert np.array_equal(shuffled[0]["x"].numpy()[:, 0] / 2, shuffled[1].numpy())  # rows stay with labels
    with pytest.raises(ConfigError, match="`shuffle` must be given"):
        inputs.numpy_input_fn({"x": x}, y)
    with pytest.raises(ConfigError, match="same number of examples"):
        inputs.numpy_input_fn({"x": x}, y[:3], shuffle=False)
    with pytest.raises(ConfigError, match="batch_size"):
        inputs.numpy_input_fn(x, batch_size=0, shuffle=False)
    # An Estimator trains on it.
    data_x, data_y = common.dataset_arrays(64)
    est = Estimator(_tf1_model_fn, config=RunConfig(log_step_count_steps=None))
    est.train(inputs.numpy_input_fn(data_x, data_y, batch_size=16, num_epochs=1, shuffle=True))
    assert est.global_step == 4


def stop_hooks_rank(rank: int, world_size: int) -> tuple[int, list[int]]:
    """A rank of the test below: only rank 1's hook asks to stop, after its second step."""
    from hostreduce.strategies import MultiWorkerStrategy

    class StopOnOne(tf.compat.v1.train.SessionRunHook):
        def __init__(self) -> None:
            self.steps: list[int] = []

        def before_run(self, run_context):
            return tf.compat.v1.train.SessionRunArgs(tf.compat.v1.train.get_global_step())

        def after_run(self, run_context, run_values) -> None:
            self.steps.append(int(run_values.results))
            if rank == 1 and len(self.steps) == 2:
                run_context.request_stop()

    hook = StopOnOne()
    est = Estimator(common.mlp_model_fn, params={"optimizer": "sgd"},
                    config=RunConfig(train_distribute=MultiWorkerStrategy(), log_step_count_steps=None))
    est.train(common.make_input_fn(), steps=10, hooks=[hook])
    est.close()
    return est.global_step, hook.steps


@pytest.mark.slow
def test_a_stop_one_worker_asks_for_stops_every_worker() -> None:
    from hostreduce.testing import run_ranks

    results = run_ranks(stop_hooks_rank, 2, timeout=150)
    assert results == [(2, [0, 1]), (2, [0, 1])], results
