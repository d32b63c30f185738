"""Host optimizer update: fused kernels equal Keras's own math; placement on /CPU:0."""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from hostreduce.host.apply import apply_gradients, fused_apply_supported, fused_optimizer_scope  # noqa: E402

pytestmark = pytest.mark.tf

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(1e-2),
    # A large epsilon makes its placement (outside the square root) visible.
    "adam_eps": lambda: keras.optimizers.Adam(1e-2, beta_1=0.8, beta_2=0.99, epsilon=1e-2),
    "adam_schedule": lambda: keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(1e-2, 3, 0.5)),
}


def _run(make, fused: bool, steps: int = 12):
    rng = np.random.default_rng(0)
    shapes = [(17, 9), (9,), (3, 3, 2)]
    variables = [keras.Variable(rng.standard_normal(s).astype("float32")) for s in shapes]
    grads = [[rng.standard_normal(s).astype("float32") * 10 ** rng.uniform(-3, 1) for s in shapes]
             for _ in range(steps)]
    optimizer = make()

    @tf.function
    def step(*g):
        if fused:
            apply_gradients(optimizer, zip(g, variables))
        else:
            optimizer.apply_gradients(zip(g, variables))

    for g in grads:
        step(*g)
    return [v.numpy() for v in variables], [v.numpy() for v in optimizer.variables], int(optimizer.iterations)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_equals_keras(name: str) -> None:
    assert fused_apply_supported(OPTIMIZERS[name]())
    want, want_slots, want_iter = _run(OPTIMIZERS[name], fused=False)
    got, got_slots, got_iter = _run(OPTIMIZERS[name], fused=True)
    assert got_iter == want_iter == 12
    for a, b in zip(want, got):
        err = np.max(np.abs(a.astype(np.float64) - b)) / max(np.max(np.abs(a)), 1e-12)
        assert err <= 1e-5, f"{name}: weights differ, relative error {err:.3g}"
    # The Adam kernel computes 1 - beta_2 in float32: 1 - float32(0.999) = 0.00099998713,
    # 1.3e-5 away from Keras's 0.001, which shows in the second moment only.
    for a, b in zip(want_slots, got_slots):
        err = np.max(np.abs(a.astype(np.float64) - b)) / max(np.max(np.abs(a)), 1e-12)
        assert err <= 3e-5, f"{name}: optimizer state differs, relative error {err:.3g}"


@pytest.mark.parametrize("make", [
    lambda: keras.optimizers.Adam(amsgrad=True),
    lambda: keras.optimizers.SGD(0.1, clipnorm=1.0),
    lambda: keras.optimizers.Adam(weight_decay=0.01),
    lambda: keras.optimizers.RMSprop(),
    lambda: keras.optimizers.AdamW(),
])
def test_other_configurations_use_keras(make) -> None:
    assert not fused_apply_supported(make())
    want, _, _ = _run(make, fused=False, steps=3)
    got, _, it = _run(make, fused=True, steps=3)
    assert it == 3
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)


def test_scope_routes_keras_apply_to_fused_kernel() -> None:
    var = keras.Variable(np.ones(4, "float32"))
    optimizer = keras.optimizers.Adam()

    @tf.function
    def step(g):
        with fused_optimizer_scope():
            optimizer.apply_gradients([(g, var)])

    graph = step.get_concrete_function(tf.TensorSpec([4])).graph
    assert "ResourceApplyAdam" in {op.type for op in graph.get_operations()}
    step(tf.ones(4))
    assert int(optimizer.iterations) == 1
    # Outside the scope Keras's own implementation is restored.
    assert keras.optimizers.Optimizer.apply_gradients.__name__ == "apply_gradients"


@pytest.mark.parametrize("on_host", [True, False])
def test_variables_and_slots_on_host(on_host: bool) -> None:
    from tests.tf_workers import tf_common as common

    from hostreduce.estimator import Estimator, RunConfig
    from hostreduce.strategies import SingleProcessStrategy

    est = Estimator(common.mlp_model_fn, config=RunConfig(train_distribute=SingleProcessStrategy(on_host)),
                    params={"optimizer": "adam"})
    est.train(common.make_input_fn(), steps=2)
    variables = dict(est._store.items())
    assert any("velocity" in k for k in variables) and any("kernel" in k for k in variables)
    if on_host:
        for key, var in variables.items():
            assert var.device.endswith("CPU:0"), (key, var.device)
    graph = est._programs["train"][1].host_function.get_concrete_function().graph
    ops = {op.type for op in graph.get_operations()}
    assert "ResourceApplyAdam" in ops  # the user's optimizer.apply_gradients ran fused
