"""Data-parallel equivalence: N workers on a global batch B train exactly like one
process on batch B (the ring under TF_CONFIG, and MPI under mpirun), with the host
applying each gradient as its reduction completes (the default) and applying all at
once (``host_apply="once"``), which give the same bits."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tests.mpi_workers.mpi_launch import mpi_skip_reason
from tests.tf_workers import tf_common as common

pytestmark = [pytest.mark.tf, pytest.mark.slow]

STEPS = 24
OPTIMIZERS = ["sgd", "adam"]
RUNS = OPTIMIZERS + [f"{opt}@once" for opt in OPTIMIZERS]


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, np.ndarray]]:
    return {opt: common.train_weights(None, opt, STEPS) for opt in OPTIMIZERS}


def _assert_same(expected: dict[str, np.ndarray], got: dict[str, np.ndarray], what: str) -> None:
    assert sorted(expected) == sorted(got), what
    for key, want in expected.items():
        have = got[key]
        scale = max(float(np.max(np.abs(want))), 1e-12)
        err = float(np.max(np.abs(have.astype(np.float64) - want))) / scale
        assert err <= 1e-5, f"{what}: {key} differs, relative error {err:.3g}"


def test_ring_two_workers_match_one_process(reference: dict) -> None:
    from hostreduce.testing import run_ranks

    results = run_ranks(common.ring_rank, 2, args=(RUNS, STEPS), timeout=150)
    assert [r["uneven_steps"] for r in results] == [3, 3]  # workers agree to stop together
    for run in RUNS:
        opt = run.split("@")[0]
        assert int(results[0][run]["adam/iteration" if opt == "adam" else "sgd/iteration"]) == STEPS
        for rank in range(2):
            _assert_same(reference[opt], results[rank][run], f"ring rank {rank} ({run})")
    _assert_apply_once_is_identical(results[0])


def test_updates_made_inside_model_fn_average_over_the_ring() -> None:
    """``tf.estimator`` habits: a Keras optimizer's ``apply_gradients`` and a TF1
    optimizer's ``minimize(loss, get_or_create_global_step())`` as ``train_op`` inside
    ``model_fn``. With two workers the update runs on the host after the all-reduce, and
    the result equals one process that made the update in place on the global batch."""
    from hostreduce.testing import run_ranks

    runs = ["sgd+keras_apply", "adam+tf1_minimize"]
    expected = {run: common.train_weights(None, run, STEPS) for run in runs}
    results = run_ranks(common.ring_rank, 2, args=(runs, STEPS, False), timeout=150)
    for run in runs:
        for rank in range(2):
            _assert_same(expected[run], results[rank][run], f"ring rank {rank} ({run})")
    assert int(results[0]["adam+tf1_minimize"]["global_step"]) == STEPS


def _assert_apply_once_is_identical(runs: dict) -> None:
    for opt in OPTIMIZERS:
        per_gradient, once = runs[opt], runs[f"{opt}@once"]
        for key in per_gradient:
            if not key.startswith("__"):
                np.testing.assert_array_equal(per_gradient[key], once[key], err_msg=f"{opt}: {key}")


_MPI_SKIP = mpi_skip_reason()


@pytest.mark.mpi
@pytest.mark.skipif(_MPI_SKIP is not None, reason=_MPI_SKIP or "")
def test_mpi_two_workers_match_one_process(reference: dict, tmp_path: Path) -> None:
    from tests.mpi_workers.mpi_launch import run_mpi

    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "HOSTREDUCE_SECRET")}
    code, out = run_mpi("mpi", 2, str(Path(common.__file__)), ",".join(RUNS), str(STEPS), str(tmp_path),
                        timeout=200, env=env)
    assert code == 0, out
    for run in RUNS:
        for rank in range(2):
            assert f"OK {run} rank {rank}/2" in out, out
            _assert_same(reference[run.split("@")[0]], common.load_result(str(tmp_path / f"{run}-rank{rank}.npz")),
                         f"mpi rank {rank} ({run})")
    _assert_apply_once_is_identical({run: common.load_result(str(tmp_path / f"{run}-rank0.npz")) for run in RUNS})
