"""A parameter server killed mid-training (SIGKILL), as the ps fault criteria ask:

- every other task of the job (chief, worker, the other ps) exits non-zero within
  ``timeout_s`` with an error naming the lost ps, and a restart of the whole job on the
  same ``model_dir`` resumes from the last complete checkpoint to exactly the variables
  of an uninterrupted job (2 ps + 2 workers, each task its own process started by hand);
- ps killed at 10 moments, saves included, never leave a corrupt checkpoint: after each
  kill the checkpoint a restart uses holds chief variables and ps shards of one step,
  and the run, restarted after every kill, ends bitwise where an uninterrupted one does.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from script_jobs import Job, base_env, run_ps_by_hand  # noqa: E402

pytestmark = [pytest.mark.tf, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parent / "ps_scripts" / "estimator_ps.py"
TIMEOUT_S = 10.0          # HOSTREDUCE_TIMEOUT_S of the jobs
EXIT_MARGIN_S = 5.0       # a process's own teardown after its error (TensorFlow, gRPC, the ring)
TASKS = ("ps0", "ps1", "chief", "worker1")  # run_ps_by_hand's start order


def _latest_step(model_dir: Path) -> int:
    steps = [int(p.name[5:]) for p in model_dir.glob("ckpt-*") if (p / "meta.json").is_file()]
    return max(steps, default=-1)


def _job_in_background(args: list[str], job: Job, timeout: float) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["tasks"] = run_ps_by_hand(SCRIPT, args, timeout=timeout, job=job,
                                             env=base_env(HOSTREDUCE_TIMEOUT_S=str(TIMEOUT_S)))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


@pytest.mark.timeout(400)
def test_a_killed_ps_fails_every_task_in_time_and_a_restart_resumes_exactly(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    steps, save_steps, kill_after = 40, 5, 10
    common = ["--optimizer", "adam", "--steps", str(steps), "--save-steps", str(save_steps), "--model-dir"]
    (tmp_path / "killed").mkdir()
    with Job() as job:
        thread, result = _job_in_background(["--out", str(tmp_path / "killed"), *common, str(model_dir)], job, 200)
        deadline = time.monotonic() + 180
        while _latest_step(model_dir) < kill_after:
            assert thread.is_alive() and time.monotonic() < deadline, result
            time.sleep(0.005)
        assert all(job.running(i) for i in range(len(TASKS))), "a task ended before the kill"
        killed_at = job.signal(TASKS.index("ps1"))
        thread.join(200)
    assert "tasks" in result, result
    tasks = result["tasks"]
    output = "\n".join(f"--- {name} ---\n{w.output}" for name, w in tasks.items())
    print(output)
    for name in ("chief", "worker1", "ps0"):
        print(name, tasks[name].returncode, tasks[name].ended_at - killed_at)
