"""``hostreduce.horovod``'s gradient aggregation (``backward_passes_per_step``,
``average_aggregated_gradients``), local layers, ``SyncBatchNormalization``, the TF1
``DistributedOptimizer`` and the Keras names added for Horovod 0.28.1, on 2 ring workers
(one spawn shared by the module), in the shapes of Horovod's own tests; and the
argument errors in one process."""
from __future__ import annotations

import numpy as np
import pytest

from tests.hvd_workers import accumulation

pytestmark = [pytest.mark.tf, pytest.mark.slow]

SIZE = 2


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    from hostreduce.testing import run_ranks

    return run_ranks(accumulation.rank_main, SIZE, timeout=300)


def _expected(step: int, average: bool) -> list[float]:
    applied = (step + 1) // accumulation.PASSES
    grad = applied * (1.0 if average else float(accumulation.PASSES))
    return [0.0 + grad, 1.0 - grad, 2.0]


@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("traced", [True, False], ids=["tf_function", "eager"])
def test_keras_optimizer_applies_once_per_backward_passes_per_step(ranks: list[dict], average: bool,
                                                                    traced: bool) -> None:
    for result in ranks:
        got = result["keras_aggregation"][(average, traced)]
        np.testing.assert_allclose(got["values"], [_expected(i, average) for i in range(accumulation.STEPS)])
        assert got["iterations"] == list(range(1, accumulation.STEPS + 1))
        assert got["counter"] == accumulation.STEPS % accumulation.PASSES


def test_fit_with_aggregation_keeps_ranks_equal(ranks: list[dict]) -> None:
    kernels = [r["fit"]["kernel"] for r in ranks]
    np.testing.assert_allclose(kernels[0], kernels[1], rtol=1e-6)
    assert [r["fit"]["iterations"] for r in ranks] == [4, 4]
    assert [r["fit"]["counter"] for r in ranks] == [0, 0]


@pytest.mark.parametrize("local", [0, 1, 2])
def test_local_layers_are_not_reduced(ranks: list[dict], local: int) -> None:
    for result in ranks:
        got = result["partial"][local]
        assert got["tape"] and got["optimizer"]
        n_local = [0, 2, 2][local]  # the RepeatVector has no weights
        assert got["split"] == (n_local, 4 - n_local) and got["split_locals"]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf_function"])
def test_sync_batch_norm_uses_the_global_batch(ranks: list[dict], traced: bool) -> None:
    for result in ranks:
        assert result["sync_bn"][traced] == {"outputs": True, "moving_mean": True, "moving_variance": True}


def test_tf1_optimizer_eagerly(ranks: list[dict]) -> None:
    for result in ranks:
        np.testing.assert_allclose(result["tf1_eager"], [1.0 - 1.5])  # mean of the ranks' gradients 1, 2


def test_tf1_optimizer_in_a_session_aggregates(ranks: list[dict]) -> None:
    for result in ranks:
        values = [v for v, _ in result["tf1_graph"]]
        np.testing.assert_allclose(values, [[1.0, 2.0], [-0.5, 0.5], [-0.5, 0.5], [-2.0, -1.0]])
        assert [s for _, s in result["tf1_graph"]] == [1, 2, 3, 4]


def test_broadcast_callback_leaves_local_variables(ranks: list[dict]) -> None:
    assert [r["callback"] for r in ranks] == [True, True]


def test_elastic_states_sync_restore_and_commit(ranks: list[dict]) -> None:
    for result in ranks:
        assert result["elastic"] == {"keras_sync": True, "keras_restore": True, "keras_commit": True,
                                     "tf_sync": True, "tf_commit": True}


def test_argument_errors() -> None:
    tf = pytest.importorskip("tensorflow")
    import hostreduce.horovod as hvd
    import hostreduce.horovod.keras as hvd_keras
    from hostreduce.errors import ConfigError

    hvd.init()
    with pytest.raises(ConfigError, match="backward_passes_per_step=0"):
        hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(), backward_passes_per_step=0)
    with pytest.raises(ConfigError, match="local_layers"):
        hvd.PartialDistributedGradientTape(tf.GradientTape(), local_layers=["dense"])
    with pytest.raises(ConfigError, match="fused=True"):
        hvd.SyncBatchNormalization(fused=True)
    with pytest.raises(ConfigError, match="Adasum"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), op=hvd.Adasum)
    assert isinstance(hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)), tf.keras.optimizers.SGD)
