"""Estimator in one process: train, evaluate, predict, train_and_evaluate, model_fn and
input_fn signatures."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
from tests.tf_workers import tf_common as common  # noqa: E402

from hostreduce.errors import SpecError  # noqa: E402
from hostreduce.estimator import (  # noqa: E402
    Estimator, EstimatorSpec, EvalSpec, ModeKeys, RunConfig, TrainSpec, train_and_evaluate)

pytestmark = pytest.mark.tf


def test_train_evaluate_predict() -> None:
    est = Estimator(common.mlp_model_fn, params={"optimizer": "adam"}, config=RunConfig(log_step_count_steps=5))
    eval_input = common.make_input_fn(repeat=False)
    before = est.evaluate(eval_input)
    est.train(common.make_input_fn(), steps=40)
    est.train(common.make_input_fn(), max_steps=40)  # already there: no-op
    after = est.evaluate(eval_input, steps=8)
    assert est.global_step == 40 and after["global_step"] == 40
    assert after["loss"] < before["loss"] and after["accuracy"] > before["accuracy"]
    x, y = common.dataset_arrays()
    preds = list(est.predict(lambda: tf.data.Dataset.from_tensor_slices(x[:50]).batch(16)))
    assert len(preds) == 50 and set(preds[0]) == {"classes"}
    batches = list(est.predict(lambda: tf.data.Dataset.from_tensor_slices(x[:50]).batch(16),
                               yield_single_examples=False))
    assert [len(b["classes"]) for b in batches] == [16, 16, 16, 2]
    assert 0.0 <= after["accuracy"] <= 1.0


def test_train_until_data_ends_and_train_and_evaluate() -> None:
    est = Estimator(common.mlp_model_fn, params={"optimizer": "sgd"})
    est.train(common.make_input_fn(n=64, repeat=False))
    assert est.global_step == 4  # 64 examples / global batch 16
    metrics, _ = train_and_evaluate(est, TrainSpec(common.make_input_fn(), max_steps=20),
                                    EvalSpec(common.make_input_fn(repeat=False), steps=2, every_n_steps=7))
    assert est.global_step == 20 and metrics["global_step"] == 20


def test_model_fn_with_config_and_tf1_metric_tuple() -> None:
    seen = {}

    def model_fn(features, labels, mode, config):
        seen["config"] = config
        logits = keras.layers.Dense(common.CLASSES)(features)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
        return EstimatorSpec(mode, loss=loss, eval_metric_ops={"double": tf.compat.v1.metrics.mean(2 * loss)})

    config = RunConfig(log_step_count_steps=None)
    metrics = Estimator(model_fn, config=config).evaluate(common.make_input_fn(repeat=False), steps=3)
    assert seen["config"] is config
    assert metrics["double"] == pytest.approx(2 * metrics["loss"], rel=1e-6)


def test_input_fn_must_return_dataset() -> None:
    with pytest.raises(SpecError, match="tf.data.Dataset"):
        Estimator(common.mlp_model_fn).train(lambda: [1, 2, 3], steps=1)


def test_single_process_train_op_without_host_call() -> None:
    """Without a strategy, a device-side train_op (no host_call) is allowed."""
    def model_fn(features, labels, mode):
        model = keras.Sequential([keras.layers.Dense(common.CLASSES)])
        logits = model(features)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
        if mode != ModeKeys.TRAIN:
            return EstimatorSpec(mode, loss=loss)
        optimizer = keras.optimizers.SGD(0.1)
        from hostreduce.estimator import compute_gradients

        grads = compute_gradients(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return EstimatorSpec(mode, loss=loss, train_op=tf.identity(loss))

    est = Estimator(model_fn)
    before = est.evaluate(common.make_input_fn(repeat=False), steps=4)["loss"]
    est.train(common.make_input_fn(), steps=20)
    assert est.evaluate(common.make_input_fn(repeat=False), steps=4)["loss"] < before
    assert np.isfinite(before)


def test_multi_worker_strategy_from_resolver(monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from hostreduce.strategies import HorovodStrategy, MultiWorkerStrategy

    cluster = {"worker": ["127.0.0.1:23456", "127.0.0.1:23457"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}}))
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = MultiWorkerStrategy(cluster_resolver=resolver, variables_on_host=False)
    assert (strategy.rank, strategy.size, strategy.is_chief) == (1, 2, False)
    assert not strategy.variables_on_host and strategy.reducer_name == "ring"
    context = strategy.input_context()
    assert (context.num_input_pipelines, context.input_pipeline_id) == (2, 1)
    assert context.get_per_replica_batch_size(64) == 32
    assert MultiWorkerStrategy().rank == 1  # from TF_CONFIG directly
    assert HorovodStrategy(reducer="mpi").reducer_name == "mpi"
    with pytest.raises(Exception, match="variables_on_host"):
        MultiWorkerStrategy(variables_on_host="yes")


def test_model_built_outside_model_fn_is_tracked() -> None:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(common.CLASSES)])
    model.build((None, common.FEATURES))
    optimizer = keras.optimizers.SGD(0.1, momentum=0.5)

    def model_fn(features, labels, mode):
        from hostreduce.estimator import host_train_spec

        logits = model(features)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
        return host_train_spec(mode, loss, optimizer, model.trainable_variables)

    est = Estimator(model_fn)
    est.train(common.make_input_fn(), steps=3)
    names = est.get_variable_names()
    assert sum(n.startswith("external/") for n in names) >= 2, names
    kernel = [n for n in names if n.startswith("external/") and "kernel" in n][0]
    np.testing.assert_array_equal(est.get_variable_value(kernel), model.layers[0].kernel.numpy())
    assert int(optimizer.iterations) == 3


def test_tensorboard_summaries_of_training_and_evaluation(tmp_path: Path) -> None:
    from hostreduce.estimator.summaries import read_scalars

    config = RunConfig(model_dir=str(tmp_path), save_summary_steps=3, log_step_count_steps=None)
    est = Estimator(common.mlp_model_fn, params={"optimizer": "adam"}, config=config)
    losses: list[float] = []
    est.train(common.make_input_fn(), steps=9, hooks=[lambda step, loss: losses.append(loss)])
    metrics = est.evaluate(common.make_input_fn(repeat=False), steps=4)
    est.close()
    train = read_scalars(str(tmp_path))
    assert sorted(train) == ["examples/sec", "global_step/sec", "loss"]
    assert [step for step, _ in train["loss"]] == [3, 6, 9]
    # The chief's loss of that step.
    np.testing.assert_allclose([v for _, v in train["loss"]], [losses[2], losses[5], losses[8]], rtol=1e-6)
    assert all(v > 0 for _, v in train["examples/sec"] + train["global_step/sec"])
    evaluation = read_scalars(str(tmp_path / "eval"))
    assert set(evaluation) == {"loss", "accuracy"}
    for name in ("loss", "accuracy"):
        assert evaluation[name] == [(9, pytest.approx(metrics[name], rel=1e-6))]
    # None (or 0) writes no event file.
    quiet = tmp_path / "quiet"
    est = Estimator(common.mlp_model_fn, params={"optimizer": "sgd"},
                    config=RunConfig(model_dir=str(quiet), save_summary_steps=None))
    est.train(common.make_input_fn(), steps=3)
    est.close()
    assert not [p for p in quiet.rglob("events.out.tfevents.*")]
    from hostreduce.errors import ConfigError

    with pytest.raises(ConfigError, match="save_summary_steps=-1"):
        RunConfig(save_summary_steps=-1)
