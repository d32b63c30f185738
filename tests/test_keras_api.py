"""Keras ``fit`` and GradientTape loops on hostreduce: ``hostreduce.horovod.keras``
(``DistributedOptimizer``, Horovod's callbacks) and ``hostreduce.distribute`` (TF
Adapter's calls).

* ``fit`` with ``DistributedOptimizer`` (SGD, Adam; variables on the host or not; a model
  with an Embedding, whose gradients are ``tf.IndexedSlices``) and a GradientTape loop
  with ``distribute.all_reduce`` on 2 and 4 ring workers and under mpirun give the
  weights of one process on the global batch;
* with ``variables_on_host=True`` every model and optimizer variable is on ``/CPU:0``;
* in ``fit`` the first reduction is submitted before the backward pass ends;
* the callbacks: broadcast makes ranks equal, metric averages are means, the learning
  rates are Horovod's formulas;
* one worker: every ``distribute`` call is a no-op; clear errors.

(Horovod's TF2 Keras MNIST example, in shape, is in ``test_horovod_examples.py``.)

The ring runs are shared by several tests (one spawn per world size).
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
from tests.keras_workers import keras_api  # noqa: E402
from tests.mpi_workers.mpi_launch import mpi_skip_reason  # noqa: E402
from tests.script_jobs import base_env, run_mpirun  # noqa: E402
from tests.weights_check import check_training as _check_training  # noqa: E402
from tests.timeline_spans import reduction_starts  # noqa: E402

pytestmark = [pytest.mark.tf, pytest.mark.slow]

_MPI_SKIP = mpi_skip_reason()
_JOB_VARS = ("TF_CONFIG", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
             "HOROVOD_RANK", "HOROVOD_SIZE")


@pytest.fixture(scope="module")
def reference() -> dict:
    return {"fit": {key: keras_api.reference_fit(key[0]) for key in keras_api.FITS},
            "tape": {o: keras_api.reference_tape(o) for o in keras_api.TAPES}}


@pytest.fixture(scope="module")
def ring(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list]:
    """Rank results by world size (the 2-worker run also checks callbacks, all_reduce
    and the timeline)."""
    from hostreduce.testing import run_ranks

    timeline_dir = tmp_path_factory.mktemp("timeline")
    return {
        2: run_ranks(keras_api.rank_main, 2, args=(True,), timeout=240,
                     env={"HOSTREDUCE_TIMELINE": str(timeline_dir)}),
        4: run_ranks(keras_api.rank_main, 4, args=(False, keras_api.FITS_SHORT), timeout=300),
    }


_FIT_RUNS = [(2, t) for t in keras_api.FITS] + [(4, t) for t in keras_api.FITS_SHORT]


@pytest.mark.parametrize(("size", "training"), _FIT_RUNS, ids=lambda v: f"{v[0]}-variables_on_host={v[1]}"
                         if isinstance(v, tuple) else str(v))
def test_fit_equals_one_process_on_the_global_batch(ring: dict, reference: dict, size: int, training: tuple) -> None:
    _check_training([r["fit"][training]["weights"] for r in ring[size]], reference["fit"][training],
                    f"fit {training} on {size} workers")


@pytest.mark.parametrize("size", [2, 4])
def test_variables_on_host_puts_every_variable_and_slot_on_the_cpu(ring: dict, size: int) -> None:
    for rank, result in enumerate(ring[size]):
        for training in result["fit"]:
            if training[1]:
                fit = result["fit"][training]
                assert fit["away"] == [], (rank, training, fit["away"])
                assert fit["slots"] >= 2, (rank, training, fit["slots"])


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("optimizer", keras_api.TAPES)
def test_tape_loop_with_distribute_all_reduce_equals_one_process(ring: dict, reference: dict, size: int,
                                                                 optimizer: str) -> None:
    _check_training([r["tape"][optimizer] for r in ring[size]], reference["tape"][optimizer],
                    f"tape loop ({optimizer}) on {size} workers")


def test_distribute_all_reduce_of_a_nest_eagerly_and_in_tf_function(ring: dict) -> None:
    for result in ring[2]:
        eager, graph = result["all_reduce"]["eager"], result["all_reduce"]["graph"]
        np.testing.assert_array_equal(eager["mean"]["a"], [1.5, 3.0])
        np.testing.assert_array_equal(eager["sum"]["a"], [3.0, 6.0])
        np.testing.assert_array_equal(eager["max"]["a"], [2.0, 4.0])
        np.testing.assert_array_equal(eager["min"]["a"], [1.0, 2.0])
        np.testing.assert_array_equal(eager["sum"]["b"], [1, 2])
        assert eager["sum"]["b"].dtype == np.int32
        np.testing.assert_array_equal(graph[0], [3.0, 6.0])
        np.testing.assert_array_equal(graph[1], [6.0, 12.0])


def test_broadcast_callback_makes_ranks_equal_from_different_initial_weights(ring: dict) -> None:
    first, second = (r["callbacks"] for r in ring[2])
    assert any(not np.array_equal(a, b) for a, b in zip(first["initial"], second["initial"]))
    for a, b in zip(first["weights"], second["weights"]):
        np.testing.assert_array_equal(a, b)


def test_metric_average_callback_logs_the_mean_over_ranks(ring: dict) -> None:
    results = [r["callbacks"] for r in ring[2]]
    for epoch in range(2):
        local = [r["local"][epoch]["loss"] for r in results]
        assert local[0] != local[1]
        for r in results:
            assert r["averaged"][epoch]["loss"] == pytest.approx(np.mean(local), rel=1e-6)


def test_learning_rate_callbacks_follow_horovods_formulas(ring: dict) -> None:
    size, steps, warmup_epochs, initial = 2, keras_api.STEPS, 2, 0.4
    expected = []
    for epoch in range(2):
        for batch in range(steps):
            e = epoch + batch / steps + 1.0 / steps
            expected.append(initial / size * (e * (size - 1) / warmup_epochs + 1))
    schedule = [0.2 if epoch == 0 else 0.2 * 0.5 ** epoch for epoch in range(3) for _ in range(steps)]
    schedule[:steps] = [expected[-1]] * steps  # epoch 0 is outside [start_epoch, ...): the rate is left as it was
    for result in ring[2]:
        np.testing.assert_allclose(result["callbacks"]["warmup"], expected, rtol=1e-6)
        np.testing.assert_allclose(result["callbacks"]["schedule"], schedule, rtol=1e-6)


def test_first_reduction_starts_before_the_backward_pass_ends_in_fit(ring: dict) -> None:
    for rank, result in enumerate(ring[2]):
        spans = [e for e in result["timeline"] if e.get("ph") == "X"]
        last = reduction_starts(spans, "last/kernel")  # small: it may travel in a bucket with its neighbours
        first = [e["ts"] for e in spans if e["name"].startswith("hand-off") and e["name"].endswith("first/kernel")]
        assert len(last) == len(first) == 6, (rank, len(last), len(first))
        # After the first step (start-up work): the last layer's reduction was submitted
        # before the first layer's gradient reached its hand-off op.
        early = [lst < fst for lst, fst in zip(last[1:], first[1:])]
        assert sum(early) >= len(early) - 1, f"rank {rank}: submitted before the first layer's gradient: {early}"


@pytest.mark.mpi
@pytest.mark.skipif(_MPI_SKIP is not None, reason=_MPI_SKIP or "")
def test_fit_and_tape_under_mpirun(reference: dict, tmp_path: Path) -> None:
    worker = run_mpirun(HERE / "keras_workers" / "keras_api.py", [str(tmp_path)], env=base_env(), timeout=240)
    assert worker.returncode == 0, worker.output
    assert sorted(re.findall(r"RESULT rank (\d)/2: engine=mpi ok", worker.output)) == ["0", "1"], worker.output
    saved = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    for optimizer, on_host in keras_api.FITS_SHORT:
        expected = reference["fit"][(optimizer, on_host)]
        weights = [[s[f"fit_{optimizer}_{int(on_host)}_{i}"] for i in range(len(expected))] for s in saved]
        _check_training(weights, expected, f"fit {(optimizer, on_host)} under mpirun")
    for optimizer in keras_api.TAPES:
        expected = reference["tape"][optimizer]
        weights = [[s[f"tape_{optimizer}_{i}"] for i in range(len(expected))] for s in saved]
        _check_training(weights, expected, f"tape loop ({optimizer}) under mpirun")


@pytest.fixture
def one_worker(monkeypatch: pytest.MonkeyPatch):
    import hostreduce.horovod as hvd

    for var in _JOB_VARS:
        monkeypatch.delenv(var, raising=False)
    hvd.shutdown()
    yield
    hvd.shutdown()


def test_distribute_with_one_worker_returns_its_inputs(one_worker: None) -> None:
    import keras
    import tensorflow as tf

    import hostreduce.distribute as distribute

    values = {"a": tf.constant([1.0, 2.0]), "b": [tf.constant(3)]}
    assert distribute.all_reduce(values) is values
    assert tf.function(lambda: distribute.all_reduce([tf.ones([2])], reduction="max"))()[0].numpy().tolist() == [1, 1]
    variable = tf.Variable([5.0])
    assert distribute.broadcast([variable], root_rank=0) is None and variable.numpy().tolist() == [5.0]
    dataset = tf.data.Dataset.range(10)
    assert distribute.shard_and_rebatch_dataset(dataset, 8) == (dataset, 8)
    sgd = keras.optimizers.SGD(0.1)
    assert distribute.keras_optimizer_wrapper(sgd) is sgd
    on_host = distribute.keras_optimizer_wrapper(keras.optimizers.Adam(0.1), variables_on_host=True)
    assert type(on_host).__name__ == "Adam" and on_host is not sgd


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_variables_on_host_applies_keras_adam_with_the_fused_kernel(one_worker: None, sparse: bool) -> None:
    """The wrapper's update is the fused ``ResourceApplyAdam`` for dense gradients (a
    wrapped Adam counts as Adam), and Keras's own for ``IndexedSlices``."""
    import keras
    import tensorflow as tf

    import hostreduce.horovod.keras as hvd

    hvd.init()
    with tf.device("/CPU:0"):
        variable = keras.Variable(tf.ones([4, 3]))
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.1), variables_on_host=True)
    opt.build([variable])
    grad = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([2]), tf.constant([4, 3])) if sparse else tf.ones([4, 3])
    step = tf.function(lambda: opt.apply([grad], [variable]))
    ops = {op.type for op in step.get_concrete_function().graph.get_operations()}
    assert ("ResourceApplyAdam" in ops) != sparse, sorted(ops)


def test_clear_errors_for_unsupported_arguments(one_worker: None) -> None:
    import keras
    import tensorflow as tf

    import hostreduce.distribute as distribute
    import hostreduce.horovod.keras as hvd
    from hostreduce.errors import ConfigError, HostReduceError

    from hostreduce.horovod import Adasum, NotInitializedError

    with pytest.raises(NotInitializedError):
        hvd.DistributedOptimizer(keras.optimizers.SGD())
    hvd.init()
    with pytest.raises(ConfigError, match=r"`backward_passes_per_step` must be an integer >= 1"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0)
    with pytest.raises(ConfigError, match=r"`op=Adasum` is not supported"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), op=Adasum)
    with pytest.raises(HostReduceError, match="`process_set` must be a hvd.ProcessSet"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), process_set="pairs")
    with pytest.raises(ConfigError, match="`optimizer` must be a Keras optimizer"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    wrapped = hvd.DistributedOptimizer(keras.optimizers.SGD())
    with pytest.raises(ConfigError, match="wrap an optimizer only once"):
        hvd.DistributedOptimizer(wrapped)
    with pytest.raises(HostReduceError, match="does not support eager execution"):
        hvd.broadcast_global_variables(0)
    with pytest.raises(ConfigError, match=r"`reduction` must be one of \['max', 'mean', 'min', 'sum'\]"):
        distribute.all_reduce([tf.ones([2])], reduction="prod")
    with pytest.raises(ConfigError, match="`group` must be 'hccl_world_group'"):
        distribute.all_reduce([tf.ones([2])], group="pairs")
    with pytest.raises(ConfigError, match="`global_bs` must be a positive integer"):
        distribute.shard_and_rebatch_dataset(tf.data.Dataset.range(4), 0)
    with pytest.raises(ConfigError, match="`initial_lr` is required"):
        hvd.callbacks.LearningRateScheduleCallback(None, 0.5)
    # variables_on_host with a model whose variables are not in host memory is refused
    # at the first step; on a CPU-only machine every variable already is, so only the
    # check's own verdict is tested here.
    from hostreduce.ops.optimizer import _check_host_variables

    class Remote:
        path = "dense/kernel"
        device = "/job:localhost/replica:0/task:0/device:GPU:0"

    with pytest.raises(ConfigError, match=r"`variables_on_host=True` needs the model's trainable variables in host"):
        _check_host_variables([Remote()])
    with pytest.raises(ConfigError, match="jit_compile=False"):
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD()), loss="mse", jit_compile=True)
        model.fit(np.ones((2, 2), np.float32), np.ones((2, 1), np.float32), verbose=0)




@pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None, reason="tf_keras is not installed")
def test_tf_keras_legacy_optimizer_reduces() -> None:
    """tf_keras's legacy optimizers (``OptimizerV2``) are wrapped too: ranks that train on
    different data end with the same weights."""
    from hostreduce.testing import run_ranks

    first, second = run_ranks(keras_api.legacy_optimizer_rank, 2, timeout=180)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
