"""The seed's four-command launch pattern in parameter-server mode: one seed-shaped
Estimator script (TF1 Adam, ``compute_gradients``, ``tf.compat.v1.metrics``, no
``close()``) started by hand once per task of a cluster of 2 ps, a chief, a worker and
an evaluator, each with its ``TF_CONFIG``. Every process must end by itself with
status 0, and the evaluator must print the metrics of the final checkpoint."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.script_jobs import Job, base_env, run_ps_by_hand

pytestmark = [pytest.mark.tf, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parent / "seed_workers" / "estimator_ps.py"
STEPS = 100
_RESULT = re.compile(r"RESULT evaluator: accuracy=([0-9.]+) keras_accuracy=([0-9.]+) loss=([0-9.]+) step=(\d+)")


@pytest.mark.timeout(400)
def test_ps_workers_and_evaluator_by_hand(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    with Job() as job:
        tasks = run_ps_by_hand(SCRIPT, ["--num-steps", str(STEPS), "--model-dir", str(model_dir)], evaluator=True,
                               timeout=300, env=base_env(HOSTREDUCE_TIMEOUT_S="30"), job=job)
        leftovers = job.leftovers()
    output = "\n".join(f"--- {name} ---\n{w.output}" for name, w in tasks.items())
    assert sorted(tasks) == ["chief", "evaluator", "ps0", "ps1", "worker1"]
    assert {name: w.returncode for name, w in tasks.items()} == dict.fromkeys(tasks, 0), output
    assert leftovers == [], output
    for name in ("ps0", "ps1"):
        assert "the chief ended the job" in tasks[name].output, output
    assert f"DONE chief 0: step {STEPS}" in tasks["chief"].output, output
    assert f"DONE worker 0: step {STEPS}" in tasks["worker1"].output, output
    found = _RESULT.findall(tasks["evaluator"].output)
    assert len(found) == 1, output
    accuracy, keras_accuracy, _, step = found[0]
    assert int(step) == STEPS, output   # the final checkpoint's
    assert float(accuracy) == pytest.approx(float(keras_accuracy), abs=1e-6), output
    assert float(accuracy) >= 0.8, output
    assert f"Saving dict for global step {STEPS}" in tasks["evaluator"].output, output
    # the evaluator wrote its metrics for TensorBoard, and the ps shards sit beside the chief's checkpoint
    assert any(p.name.startswith("events") for p in (model_dir / "eval").iterdir()), output
    from hostreduce.ps import checkpoint

    assert checkpoint.read_index(str(model_dir / "ps"))["step"] == STEPS


@pytest.mark.timeout(400)
def test_ps_job_under_the_launcher(tmp_path: Path) -> None:
    from tests.script_jobs import run_launcher

    cmd_args = ["--num-steps", "20", "--model-dir", str(tmp_path / "model")]
    worker = run_launcher(SCRIPT, cmd_args, np=2, timeout=300, env=base_env(HOSTREDUCE_TIMEOUT_S="30"),
                          extra=["--ps", "2", "--evaluator"])
    assert worker.returncode == 0, worker.output
    assert "[evaluator] RESULT evaluator:" in worker.output and "step=20" in worker.output, worker.output
    for label in ("[ps0]", "[ps1]"):
        assert f"{label} INFO:tensorflow:ps task {label[3]}: the chief ended the job" in worker.output, worker.output
