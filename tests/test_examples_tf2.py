"""The TF2 examples and a TF Adapter-style loop as users start them: two workers under
``hostreduce run`` (the ring) and under ``mpirun`` (MPI).

* ``examples/keras/train.py`` (``model.fit`` with ``hostreduce.horovod.keras``);
* ``examples/custom_loop/train.py`` (``hvd.DistributedGradientTape`` in a ``tf.function``
  step);
* ``tests/npu_workers/npu_custom_loop.py`` (TF Adapter's ``npu.distribute`` calls,
  ported to ``hostreduce.distribute``);
* ``tests/npu_workers/npu_ported_as_is.py`` (a TF Adapter script whose only change is
  ``import npu_device as npu`` -> ``import hostreduce as npu``: ``npu.distribute``'s
  calls, ``npu_distributed_keras_optimizer_wrapper`` with ``model.fit``, HCCL's ops and a
  TF1 optimizer, each as TF Adapter names them).

Every worker exits 0, the result is reported once, and every rank ends with bitwise
the same weights. The scripts start from unseeded, so different, weights on each rank:
equal weights at the end need both the broadcast and the gradient reduction. Runs are a
few steps long; each example's options (``--variables-on-host``, ``--timeline``,
``--checkpoint-dir``) are spread over its two runs.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
from tests.mpi_workers.mpi_launch import mpi_skip_reason  # noqa: E402
from tests.script_jobs import ROOT, Worker, base_env, run_launcher, run_mpirun  # noqa: E402
from tests.weights_check import check_training  # noqa: E402

pytestmark = [pytest.mark.tf, pytest.mark.slow]

KERAS = ROOT / "examples" / "keras" / "train.py"
CUSTOM_LOOP = ROOT / "examples" / "custom_loop" / "train.py"
NPU_LOOP = HERE / "npu_workers" / "npu_custom_loop.py"
NPU_AS_IS = HERE / "npu_workers" / "npu_ported_as_is.py"
_MPI_SKIP = mpi_skip_reason()
needs_mpi = pytest.mark.skipif(_MPI_SKIP is not None, reason=_MPI_SKIP or "")
TIMEOUT = 180.0


def _check_job(worker: Worker, weights_dir: Path, what: str, reports: str) -> None:
    """Exit 0, ``reports`` printed by one rank alone, and every rank's weights saved
    and bitwise equal to rank 0's."""
    assert worker.returncode == 0, f"{what} exited {worker.returncode}:\n{worker.output}"
    assert worker.output.count(reports) == 1, f"{what}: {reports!r} not printed once:\n{worker.output}"
    weights = []
    for rank in range(2):
        with np.load(weights_dir / f"weights-rank{rank}.npz") as saved:
            weights.append([saved[f"arr_{i}"] for i in range(len(saved.files))])
    assert weights[0], f"{what}: no weights saved"
    check_training(weights, weights[0], what, tolerance=0.0)


def test_keras_example_under_launcher(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    worker = run_launcher(KERAS, ["--epochs", "1", "--warmup-epochs", "1", "--save-weights", str(tmp_path),
                                  "--checkpoint-dir", str(checkpoints)], env=base_env(), timeout=TIMEOUT)
    _check_job(worker, tmp_path, "examples/keras under hostreduce run", "test accuracy:")
    assert "finished gradual learning rate warmup" in worker.output, worker.output
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-1.keras"]


@pytest.mark.mpi
@needs_mpi
def test_keras_example_with_variables_on_host_under_mpirun(tmp_path: Path) -> None:
    worker = run_mpirun(KERAS, ["--epochs", "1", "--warmup-epochs", "1", "--variables-on-host",
                                "--save-weights", str(tmp_path)], env=base_env(), timeout=TIMEOUT)
    _check_job(worker, tmp_path, "examples/keras --variables-on-host under mpirun", "test accuracy:")


def test_custom_loop_example_with_variables_on_host_under_launcher(tmp_path: Path) -> None:
    timeline = tmp_path / "timeline"
    worker = run_launcher(CUSTOM_LOOP, ["--epochs", "1", "--variables-on-host", "--timeline", str(timeline),
                                        "--save-weights", str(tmp_path)], env=base_env(), timeout=TIMEOUT)
    _check_job(worker, tmp_path, "examples/custom_loop --variables-on-host under hostreduce run",
               "test accuracy:")
    assert sorted(p.name for p in timeline.iterdir()) == ["timeline-rank0.json", "timeline-rank1.json"]
    assert '"cat": "reduce"' in (timeline / "timeline-rank1.json").read_text()


@pytest.mark.mpi
@needs_mpi
def test_custom_loop_example_under_mpirun(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    worker = run_mpirun(CUSTOM_LOOP, ["--epochs", "1", "--save-weights", str(tmp_path),
                                      "--checkpoint-dir", str(checkpoints)], env=base_env(), timeout=TIMEOUT)
    _check_job(worker, tmp_path, "examples/custom_loop under mpirun", "test accuracy:")
    assert (checkpoints / "checkpoint").is_file(), sorted(checkpoints.iterdir())


def test_npu_custom_loop_under_launcher(tmp_path: Path) -> None:
    worker = run_launcher(NPU_LOOP, ["20", str(tmp_path)], env=base_env(), timeout=TIMEOUT)
    _check_job(worker, tmp_path, "TF Adapter-style loop under hostreduce run", "RESULT rank 1/2")


@pytest.mark.mpi
@needs_mpi
def test_npu_custom_loop_under_mpirun(tmp_path: Path) -> None:
    worker = run_mpirun(NPU_LOOP, ["20", str(tmp_path)], env=base_env(), timeout=TIMEOUT)
    _check_job(worker, tmp_path, "TF Adapter-style loop under mpirun", "RESULT rank 1/2")


def test_npu_script_renamed_import_under_launcher(tmp_path: Path) -> None:
    worker = run_launcher(NPU_AS_IS, ["6", str(tmp_path)], env=base_env(), timeout=TIMEOUT)
    _check_job(worker, tmp_path, "TF Adapter script (import renamed) under hostreduce run", "RESULT rank 1/2")


@pytest.mark.mpi
@needs_mpi
def test_npu_script_renamed_import_under_mpirun(tmp_path: Path) -> None:
    worker = run_mpirun(NPU_AS_IS, ["6", str(tmp_path)], env=base_env(), timeout=TIMEOUT)
    _check_job(worker, tmp_path, "TF Adapter script (import renamed) under mpirun", "RESULT rank 1/2")
