"""TF1 optimizers (``tf.compat.v1.train``) and ``tf.keras`` optimizers in an Estimator
``model_fn``/``host_call``: numerically equal to TensorFlow's own loop, host-resident,
checkpointed; clear errors for what cannot run.

Written against ``tf.keras``, so the file runs twice: here with Keras 3, and (by
``test_whole_file_under_legacy_keras``) in a subprocess with ``TF_USE_LEGACY_KERAS=1``,
where ``tf.keras`` is tf_keras.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")
from tests.tf_workers import tf_common as common  # noqa: E402

from hostreduce.errors import SpecError  # noqa: E402
from hostreduce.estimator import Estimator, EstimatorSpec, ModeKeys, RunConfig  # noqa: E402
from hostreduce.host.tf1 import HOST_CALL, MODEL_FN, tf1_optimizer_scope  # noqa: E402
from hostreduce.strategies import SingleProcessStrategy  # noqa: E402

pytestmark = pytest.mark.tf

LEGACY = os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true")
BATCH = common.GLOBAL_BATCH
STEPS = 6

TF1_OPTIMIZERS = {
    "gradient_descent": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1),
    "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(0.05, momentum=0.9),
    "nesterov": lambda: tf.compat.v1.train.MomentumOptimizer(0.05, momentum=0.9, use_nesterov=True),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(1e-2),
    "adagrad": lambda: tf.compat.v1.train.AdagradOptimizer(0.1),
    "rmsprop": lambda: tf.compat.v1.train.RMSPropOptimizer(1e-2, momentum=0.5),
}


def _loss(labels, logits):
    # The loss of the ported IPU example: per-example losses summed over the local batch.
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    return tf.reduce_sum(per_example) * (1.0 / BATCH)


def _make_model_fn(make_optimizer, style: str, seen: dict):
    """``style``: "host_call" (compute_gradients in model_fn, apply_gradients on the
    host, the IPU example's shape) or "minimize" (one call inside model_fn)."""

    def model_fn(features, labels, mode):
        model = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="tanh"), tf.keras.layers.Dense(common.CLASSES)])
        logits = model(features, training=mode == ModeKeys.TRAIN)
        loss = _loss(labels, logits)
        if mode != ModeKeys.TRAIN:
            return EstimatorSpec(mode, loss=loss)
        seen["model"] = model
        optimizer = seen["optimizer"] = make_optimizer()
        variables = model.trainable_variables
        if style == "minimize":
            return EstimatorSpec(mode, loss=loss, train_op=optimizer.minimize(loss))  # var_list: all it read
        grads_and_vars = optimizer.compute_gradients(loss, var_list=variables)
        assert [v for _, v in grads_and_vars] == list(variables)  # the caller's own variable objects

        def host_model_fn(*host_gradients):
            return optimizer.apply_gradients(zip(host_gradients, variables))

        return EstimatorSpec(mode, loss=loss, train_op=tf.identity(loss),
                             host_call=(host_model_fn, [g for g, _ in grads_and_vars]))

    return model_fn


def _reference(make_optimizer, initial: list[np.ndarray], steps: int) -> list[np.ndarray]:
    """The same TF1 optimizer on plain tf.Variables, eagerly, on the same batches."""
    x, y = common.dataset_arrays()
    variables = [tf.Variable(w) for w in initial]
    optimizer = make_optimizer()
    for i in range(steps):
        xb, yb = x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]

        def loss():
            hidden = tf.tanh(tf.matmul(xb, variables[0]) + variables[1])
            return _loss(yb, tf.matmul(hidden, variables[2]) + variables[3])

        optimizer.minimize(loss, var_list=variables)
    return [v.numpy() for v in variables]


def _relative_error(want: np.ndarray, got: np.ndarray) -> float:
    return float(np.max(np.abs(want.astype(np.float64) - got)) / max(np.max(np.abs(want)), 1e-12))


@pytest.mark.parametrize("name, style", [(name, "host_call") for name in sorted(TF1_OPTIMIZERS)]
                         + [("adam", "minimize"), ("momentum", "minimize")])
def test_tf1_optimizer_equals_tensorflow(name: str, style: str) -> None:
    seen: dict = {}
    est = Estimator(_make_model_fn(TF1_OPTIMIZERS[name], style, seen),
                    config=RunConfig(train_distribute=SingleProcessStrategy(variables_on_host=True),
                                     log_step_count_steps=None, tf_random_seed=0))
    est.train(common.make_input_fn(), steps=0)  # builds the step, creates and initializes variables
    initial = [v.numpy() for v in seen["model"].trainable_variables]
    est.train(common.make_input_fn(), steps=STEPS)
    got = [v.numpy() for v in seen["model"].trainable_variables]
    want = _reference(TF1_OPTIMIZERS[name], initial, STEPS)
    for a, b, w0 in zip(want, got, initial):
        assert not np.array_equal(a, w0)
        err = _relative_error(a, b)
        assert err <= 1e-6, f"{name}/{style}: weights differ from TensorFlow's, relative error {err:.3g}"
    # Every variable, slot and Adam's beta powers is in the store, on the host.
    store = dict(est._store.items())
    optimizer = seen["optimizer"]
    with tf1_optimizer_scope("host_call"):  # get_slot of a Keras 3 variable, as inside host_call
        slots = [optimizer.get_slot(v, s) for v in seen["model"].trainable_variables
                 for s in optimizer.get_slot_names()]
    assert all(s is not None for s in slots)
    held = {id(v) for v in store.values()}
    assert all(id(s) in held for s in slots + optimizer.variables())
    for key, var in store.items():
        assert var.device.endswith("CPU:0"), (key, var.device)
    if name == "adam":
        powers = {k: float(v) for k, v in est.get_variables().items() if "beta" in k and "power" in k}
        assert powers == pytest.approx({"beta1_power": 0.9 ** (STEPS + 1), "beta2_power": 0.999 ** (STEPS + 1)})


def test_tf1_slots_checkpointed_and_restored(tmp_path: Path) -> None:
    def estimator() -> Estimator:
        config = RunConfig(model_dir=str(tmp_path), log_step_count_steps=None)
        return Estimator(_make_model_fn(TF1_OPTIMIZERS["adam"], "host_call", {}), config=config)

    first = estimator()
    first.train(common.make_input_fn(), steps=3)
    second = estimator()
    second.train(common.make_input_fn(), steps=0)  # restores the checkpoint of step 3
    saved, restored = first.get_variables(), second.get_variables()
    assert sorted(saved) == sorted(restored) and len(saved) == 4 + 2 + 8  # weights, beta powers, m and v
    for key in saved:
        np.testing.assert_array_equal(saved[key], restored[key], err_msg=key)
    # Training on from the restored state equals training on without a restart.
    first.train(common.make_input_fn(), steps=2)
    second.train(common.make_input_fn(), steps=2)
    for key, value in first.get_variables().items():
        np.testing.assert_allclose(second.get_variables()[key], value, rtol=1e-6, err_msg=key)


def test_ported_ipu_model_fn_trains() -> None:
    """The model_fn of an IPU Estimator script, as written for ``import tensorflow.compat.v1
    as tf``: tf.keras layers, a TF1 optimizer, the global step from tf.train."""
    v1 = tf.compat.v1
    rng = np.random.default_rng(0)
    x = rng.standard_normal((160, 8, 8, 1)).astype("float32")
    y = (x.mean(axis=(1, 2, 3)) > 0).astype("int32")

    def model_fn(features, labels, mode):
        model = v1.keras.Sequential([v1.keras.layers.Conv2D(4, 3, activation="relu"), v1.keras.layers.MaxPooling2D(),
                                     v1.keras.layers.Flatten(), v1.keras.layers.Dense(8, activation="relu"),
                                     v1.keras.layers.Dense(2)])
        logits = model(features, training=mode == ModeKeys.TRAIN)
        loss = v1.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=v1.losses.Reduction.NONE)(labels, logits)
        loss = v1.reduce_sum(loss) * (1. / BATCH)
        if mode != ModeKeys.TRAIN:
            return EstimatorSpec(mode=mode, loss=loss)
        optimizer = v1.train.AdamOptimizer(1e-2)
        variables = model.trainable_variables

        def host_model_fn(*host_gradients):
            return optimizer.apply_gradients(zip(host_gradients, variables),
                                             global_step=v1.train.get_or_create_global_step())

        grads_and_vars = optimizer.compute_gradients(loss, var_list=variables)
        return EstimatorSpec(mode=mode, loss=loss, train_op=v1.identity(loss),
                             host_call=(host_model_fn, [g for (g, _) in grads_and_vars]))

    def input_fn():
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True).repeat()

    est = Estimator(model_fn, config=RunConfig(log_step_count_steps=None, tf_random_seed=0))
    before = est.evaluate(input_fn, steps=4)["loss"]
    est.train(input_fn, steps=60)
    assert est.evaluate(input_fn, steps=4)["loss"] < 0.8 * before
    assert int(est.get_variable_value("global_step")) == 60


def test_update_inside_model_fn_with_several_workers_runs_on_the_host() -> None:
    """With several workers, ``minimize``/``apply_gradients`` inside ``model_fn`` update
    nothing there: they leave the update, with its gradients, for the host (the Estimator
    all-reduces the gradients and runs it, as an explicit ``host_call``)."""
    for how in ("minimize", "apply"):
        variable = tf.Variable(np.ones(3, "float32"))
        optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.1)
        seen = []

        @tf.function(autograph=False)
        def step(twice: bool):
            with tf1_optimizer_scope(MODEL_FN, workers=2) as context:
                loss = tf.reduce_sum(variable * variable)
                for _ in range(2 if twice else 1):
                    if how == "minimize":
                        optimizer.minimize(loss, var_list=[variable])
                    else:
                        optimizer.apply_gradients(optimizer.compute_gradients(loss, var_list=[variable]))
            seen.append(context.host_call)
            return loss

        step(False)
        np.testing.assert_array_equal(variable.numpy(), np.ones(3, "float32"))  # not updated in model_fn
        fn, grads = seen[0]
        assert len(grads) == 1

        @tf.function(autograph=False)
        def host(grad):
            with tf1_optimizer_scope(HOST_CALL):
                fn(grad)

        host(tf.constant(np.full(3, 2.0, "float32")))  # the averaged gradient
        np.testing.assert_allclose(variable.numpy(), np.full(3, 0.8, "float32"))
        with pytest.raises(SpecError, match="called twice"):
            step(True)


def test_unsupported_arguments_raise_spec_error() -> None:
    optimizer = tf.compat.v1.train.AdamOptimizer()
    variable = tf.Variable(np.ones(3, "float32"))

    @tf.function(autograph=False)
    def host_call_without_var_list():
        with tf1_optimizer_scope("host_call"):
            optimizer.compute_gradients(tf.reduce_sum(variable))

    with pytest.raises(SpecError, match="var_list=model.trainable_variables"):
        host_call_without_var_list()

    @tf.function(autograph=False)
    def tensors_as_variables():
        with tf1_optimizer_scope("host_call"):
            optimizer.apply_gradients([(tf.ones(3), tf.ones(3))])

    with pytest.raises(SpecError, match="must hold variables"):
        tensors_as_variables()


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_keras_optimizer_fused_equals_its_own_apply(name: str) -> None:
    """``tf.keras`` Adam/SGD in ``host_call``: the fused kernels reproduce the optimizer's
    own arithmetic (Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1)."""
    make = {"adam": lambda: tf.keras.optimizers.Adam(1e-2),
            "sgd": lambda: tf.keras.optimizers.SGD(0.05, momentum=0.9)}[name]
    weights = {}
    for fused in (False, True):
        seen: dict = {}
        tf.keras.utils.set_random_seed(7)
        est = Estimator(_keras_model_fn(make, seen),
                        config=RunConfig(fused_apply=fused, log_step_count_steps=None))
        est.train(common.make_input_fn(), steps=STEPS)
        weights[fused] = [v.numpy() for v in seen["model"].trainable_variables]
        ops = {op.type for op in est._programs["train"][1].host_function.get_concrete_function().graph.get_operations()}
        kernel = "ResourceApplyAdam" if name == "adam" else "ResourceApplyKerasMomentum"
        assert (kernel in ops) == fused, sorted(ops)
        assert int(seen["optimizer"].iterations) == STEPS
    for a, b in zip(weights[False], weights[True]):
        assert _relative_error(a, b) <= 1e-5


def _keras_model_fn(make_optimizer, seen: dict):
    from hostreduce.estimator import compute_gradients

    def model_fn(features, labels, mode):
        model = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="tanh"), tf.keras.layers.Dense(common.CLASSES)])
        logits = model(features)
        loss = _loss(labels, logits)
        seen["model"] = model
        optimizer = seen["optimizer"] = make_optimizer()
        grads = compute_gradients(loss, model.trainable_variables)

        def host_model_fn(*grads):
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        return EstimatorSpec(mode, loss=loss, train_op=tf.identity(loss), host_call=(host_model_fn, grads))

    return model_fn


def test_tf_keras_is_what_the_environment_asks_for() -> None:
    package = type(tf.keras.layers.Dense(1)).__module__.split(".")[0]
    assert package == ("tf_keras" if LEGACY else "keras")


@pytest.mark.skipif(LEGACY, reason="this is the legacy run")
@pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None, reason="tf_keras is not installed")
def test_whole_file_under_legacy_keras() -> None:
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-x"],
        env=env, capture_output=True, text=True, timeout=280, cwd=Path(__file__).resolve().parent.parent,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout
