"""The ``tf.distribute`` surface of ``hostreduce.MultiWorkerStrategy`` piece by piece, on
2 ranks of the ring: reductions, gathers, variables made in the scope, the replica
context's all-reduce in a traced step, the distributed datasets and their input
contexts, and the cluster's description."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.tf, pytest.mark.slow]


@pytest.fixture(scope="module")
def seen() -> list[dict]:
    from hostreduce.testing import run_ranks
    from tests.tfd_workers.surface import surface_rank

    return run_ranks(surface_rank, 2, timeout=120)


def test_the_job_as_tf_distribute_describes_it(seen: list[dict]) -> None:
    for rank, out in enumerate(seen):
        assert out["replicas"] == 2 and out["task"] == ("worker", rank)
        assert out["should_checkpoint"] == (rank == 0)
        assert out["values_fn"] == (rank, 2)
        assert out["in_scope"]


def test_reductions_and_gathers(seen: list[dict]) -> None:
    base = np.array([[1.0, 2.0, 3.0]])
    for out in seen:
        np.testing.assert_allclose(out["sum"], 3 * base)
        # MEAN over axis 0 of rank 0's one row and rank 1's two rows: (1 + 2 + 2) / 3
        np.testing.assert_allclose(out["mean_axis0"], base[0] * 5 / 3, rtol=1e-6)
        np.testing.assert_allclose(out["gather0"], np.concatenate([base, 2 * base]))
        np.testing.assert_allclose(out["gather1"], np.concatenate([base, 2 * base], axis=1))
        assert float(out["all_reduce_in_function"]) == pytest.approx(2.0 * (1 + 2))


def test_variables_start_from_rank_0_on_the_host(seen: list[dict]) -> None:
    np.testing.assert_array_equal(seen[0]["variable"], seen[1]["variable"])
    assert all(out["flag"] is False for out in seen)  # rank 0's bool
    assert all("CPU" in out["variable_device"] for out in seen)


def test_distributed_datasets(seen: list[dict]) -> None:
    # Global batches [0..3], [4..7], [8, 9]: each rank takes its half of every batch.
    assert seen[0]["sliced"] == [[0, 1], [4, 5], [8]]
    assert seen[1]["sliced"] == [[2, 3], [6, 7], [9]]
    for out in seen:  # handed on (to fit, which distributes what it gets): not sliced again
        assert out["twice"] == out["sliced"]
    for rank, out in enumerate(seen):
        assert out["contexts"] == [(2, rank, 2, 4)]
        assert out["from_function"] == [[float(v) for v in range(rank, 10, 2)][i:i + 4] for i in (0, 4)]
        assert "every element of `dataset` must be a batch" in out["unbatched_error"]
