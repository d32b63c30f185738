"""Horovod's TensorFlow API as Horovod's own test files use it (tests/hvd_workers/
horovod_exact.py): the narrow integer dtypes and bool, integer scaling, gradients of the
collectives, TensorFlow's error types for mismatches (eagerly, in TF1 graphs and in
``tf.function``) with the engine usable afterwards,
object collectives, layout ops, and TF1 global-variable broadcasts, in eager,
``tf.function`` and TF1 graph mode, on the ring and under mpirun (the MPI engine)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.hvd_workers import horovod_exact
from tests.mpi_workers.mpi_launch import mpi_skip_reason
from tests.script_jobs import base_env, run_mpirun

pytestmark = [pytest.mark.tf, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
CHECKS = 3 * (9 + 3 + 3 + 1) + 5 + 8 + 6


def test_horovod_exact_on_the_ring() -> None:
    from hostreduce.testing import run_ranks

    assert run_ranks(horovod_exact.rank_main, 2, timeout=240) == [CHECKS, CHECKS]


@pytest.mark.skipif(bool(mpi_skip_reason()), reason=mpi_skip_reason() or "")
def test_horovod_exact_under_mpirun() -> None:
    worker = run_mpirun(HERE / "hvd_workers" / "horovod_exact.py", [], env=base_env(), timeout=240)
    assert worker.returncode == 0, worker.output
    assert sorted(re.findall(rf"RESULT rank (\d)/2: checks={CHECKS}(?!\d)", worker.output)) == ["0", "1"], worker.output
