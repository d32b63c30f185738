"""The ``tf.distribute`` surface of ``hostreduce.ParameterServerStrategy`` for custom
loops, in one process against in-process ps: ``tf.distribute.coordinator.ClusterCoordinator``
returns hostreduce's coordinator; a loop of ``schedule``d steps whose optimizer was made
in ``strategy.scope()`` trains on the ps exactly as Keras trains in one process; what
the surface cannot take is refused by name. (``tests/test_tf_distribute_tutorials.py``
runs the tutorial's loop on 2 workers and 2 ps.)"""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.tf, pytest.mark.timeout(180)]


@pytest.fixture
def ps_strategy(monkeypatch: pytest.MonkeyPatch) -> Any:
    import hostreduce
    from tests.ps_helpers import LocalCluster

    ps = LocalCluster(2, 1)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"chief": ["127.0.0.1:1"], "ps": ps.addresses},
                                                "task": {"type": "chief", "index": 0}}))
    monkeypatch.setenv("HOSTREDUCE_SECRET", ps.secret)
    strategy = hostreduce.ParameterServerStrategy()
    try:
        yield strategy
    finally:
        strategy.job.end("test over")
        ps.stop()


def _model(keras: Any) -> Any:
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(1)])


def _data(tf: Any) -> Any:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 6)).astype(np.float32), rng.normal(size=(64, 1)).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat()


def _step(tf: Any, keras: Any, model: Any, optimizer: Any, run: Any) -> Any:
    @tf.function
    def step_fn(iterator):
        def replica_fn(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(keras.losses.mean_squared_error(y, model(x, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        x, y = next(iterator)
        return run(replica_fn, (x, y))

    return step_fn


@pytest.mark.parametrize("make", [pytest.param(lambda k: k.optimizers.RMSprop(0.01, momentum=0.5), id="rmsprop"),
                                  pytest.param(lambda k: k.optimizers.Adam(0.01), id="adam")])
def test_scheduled_loop_with_an_optimizer_made_in_scope_equals_keras_in_one_process(ps_strategy: Any, make: Any) -> None:
    import keras
    import tensorflow as tf

    from hostreduce.ps_training.coordinator import ClusterCoordinator, RemoteValue

    reference, ref_opt = _model(keras), make(keras)
    ref_step = _step(tf, keras, reference, ref_opt, lambda fn, args: fn(*args))
    ref_it = iter(_data(tf))
    ref_losses = [float(ref_step(ref_it)) for _ in range(6)]

    strategy = ps_strategy
    with strategy.scope():
        model, optimizer = _model(keras), make(keras)
    assert hasattr(optimizer, "_hostreduce_exchange") and type(optimizer).__name__ == type(ref_opt).__name__
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    assert isinstance(coordinator, ClusterCoordinator) and coordinator.strategy is strategy
    assert tf.distribute.coordinator.ClusterCoordinator(strategy) is coordinator

    step = _step(tf, keras, model, optimizer,
                 lambda fn, args: strategy.reduce("SUM", strategy.run(fn, args=args), axis=None))
    iterator = iter(coordinator.create_per_worker_dataset(lambda: strategy.distribute_datasets_from_function(
        lambda context: _data(tf).shard(context.num_input_pipelines, context.input_pipeline_id))))
    values = [coordinator.schedule(step, args=(iterator,)) for _ in range(6)]
    coordinator.join()
    assert coordinator.done() and all(isinstance(v, RemoteValue) for v in values)
    losses = [float(v) for v in coordinator.fetch(values)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    ps_values = strategy.keras_variables()
    for ours, theirs in zip(model.trainable_variables, reference.trainable_variables):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(ps_values[ours.path], theirs.numpy(), rtol=1e-5, atol=1e-7)
    assert int(optimizer.iterations.numpy()) == 6


def test_the_surface_refuses_what_it_cannot_take_by_name(ps_strategy: Any) -> None:
    import keras
    import tensorflow as tf

    from hostreduce.errors import ConfigError

    strategy = ps_strategy
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with pytest.raises(ConfigError, match=r"`fn` must be a callable.*Received: fn=3"):
        coordinator.schedule(3)
    with pytest.raises(ConfigError, match=r"`dataset_fn` must return a tf.data.Dataset. Received: dataset_fn=.*, "
                                          r"which returned a list"):
        coordinator.create_per_worker_dataset(lambda: [1, 2])
    with pytest.raises(ConfigError, match=r"`reduce_op` must be tf.distribute.ReduceOp.SUM or MEAN. Received: "
                                          r"reduce_op='MAX'"):
        strategy.reduce("MAX", tf.constant(1.0), axis=None)
    assert float(strategy.reduce(tf.distribute.ReduceOp.MEAN, tf.constant([1.0, 3.0]), axis=0)) == 2.0
    assert strategy.num_replicas_in_sync == 1 and strategy.experimental_local_results(5) == (5,)
    with pytest.raises(ConfigError, match=r"setting amsgrad=True is not supported on parameter servers"):
        with strategy.scope():
            keras.optimizers.Adam(amsgrad=True)
    with pytest.raises(ConfigError, match=r"must be a keras.optimizers SGD, Adam, Adagrad or RMSprop. Received: "
                                          r"<keras.src.optimizers.adamax.Adamax"):
        with strategy.scope():
            keras.optimizers.Adamax()
    with pytest.raises(ConfigError, match=r"`strategy` must be a hostreduce.ParameterServerStrategy"):
        from hostreduce.ps_training.coordinator import ClusterCoordinator

        ClusterCoordinator(object())


def test_a_coordinator_on_an_evaluator_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import tensorflow as tf

    import hostreduce
    from hostreduce.errors import ClusterError

    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"],
                                                            "evaluator": ["127.0.0.1:3"]},
                                                "task": {"type": "evaluator", "index": 0}}))
    coordinator = tf.distribute.coordinator.ClusterCoordinator(hostreduce.ParameterServerStrategy())
    with pytest.raises(ClusterError, match=r"reached ClusterCoordinator.schedule. Received: task.type='evaluator'"):
        coordinator.schedule(tf.function(lambda: 1))


def test_datasets_from_function_name_this_workers_input_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    """``input_context.input_pipeline_id`` is this worker's rank of
    ``num_input_pipelines`` training tasks (TensorFlow's coordinator passes 0 of 1)."""
    import hostreduce

    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2",
                                                                                                    "127.0.0.1:3"],
                                                            "ps": ["127.0.0.1:4"]},
                                                "task": {"type": "worker", "index": 1}}))
    contexts = []
    strategy = hostreduce.ParameterServerStrategy()
    assert strategy.distribute_datasets_from_function(lambda context: contexts.append(context) or 7) == 7
    assert [(c.num_input_pipelines, c.input_pipeline_id, c.num_replicas_in_sync) for c in contexts] == [(3, 2, 1)]


def test_legacy_optimizer_names_in_the_scope_make_keras3_optimizers_on_the_ps(ps_strategy: Any) -> None:
    """``tf.keras.optimizers.legacy.RMSprop`` (TensorFlow's parameter-server tutorial;
    Keras 3 refuses to construct it) makes Keras 3's RMSprop in the scope, with the
    arguments given, training on the ps; outside the scope Keras 3's refusal stands."""
    import keras
    import tensorflow as tf

    with ps_strategy.scope():
        optimizer = tf.keras.optimizers.legacy.RMSprop(learning_rate=0.1, rho=0.8)
        sgd = tf.keras.optimizers.legacy.SGD(momentum=0.5)
    assert isinstance(optimizer, keras.optimizers.RMSprop) and optimizer.rho == 0.8
    assert isinstance(sgd, keras.optimizers.SGD) and sgd.momentum == 0.5
    assert hasattr(optimizer, "_hostreduce_exchange") and hasattr(sgd, "_hostreduce_exchange")
    with pytest.raises(ImportError, match="not supported in Keras 3"):
        tf.keras.optimizers.legacy.RMSprop(learning_rate=0.1)
