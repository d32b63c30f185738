"""A worker lost or failing in the middle of parameter-server training, each task its
own process started by hand (2 ps, a chief, workers):

- ``sync=True``: worker 1 is killed; the chief's next step fails with an error naming
  worker rank 1 (nothing of that step is applied), and the job ends non-zero (that the
  error comes within ``timeout_s`` of the loss: the ``perf`` test);
- ``sync=False``: worker 1 is killed (SIGKILL) and worker 2 raises at the same step; the
  chief goes on to its last step, logs the lost and the failed worker, ends the job, and
  it and the ps exit 0; the ps log both.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.script_jobs import base_env, run_ps_by_hand

pytestmark = [pytest.mark.tf, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parent / "ps_scripts" / "estimator_ps.py"
PS_SCRIPT = Path(__file__).resolve().parent / "ps_scripts" / "serve_ps.py"  # a ps without TensorFlow
TIMEOUT_S = 4.0
STEPS, FAIL_AT = 40, 5
# The perf test: the chief's step that waits for the lost worker starts at most one
# step (a few hundredths of a second; a second on a loaded machine) after the loss.
STEP_MARGIN_S = 1.5


def _output(tasks: dict[str, Any]) -> str:
    return "\n".join(f"--- {name} (exit {w.returncode}) ---\n{w.output}" for name, w in tasks.items())


def _run(tmp_path: Path, mode: str, how: str, sleep: float, workers: int = 2) -> dict[str, Any]:
    args = ["--out", str(tmp_path), "--steps", str(STEPS), "--fail-at", str(FAIL_AT), "--fail-how", how,
            "--step-sleep", str(sleep), "--save-steps", "1000"] + (["--async"] if mode == "async" else [])
    return run_ps_by_hand(SCRIPT, args, timeout=150, ps_script=PS_SCRIPT, workers=workers,
                          env=base_env(HOSTREDUCE_TIMEOUT_S=str(TIMEOUT_S), TEST_PS_MODE=mode))


def _sync_lost_worker(tmp_path: Path) -> tuple[dict[str, Any], float, float, str]:
    tasks = _run(tmp_path, "sync", "kill", 0.0)
    output = _output(tasks)
    lost_at = tasks["worker1"].first("FAILING rank 1")
    assert lost_at is not None and tasks["worker1"].returncode == -9, output
    said = tasks["chief"].first("waiting for worker rank(s) [1]")
    assert said is not None, output
    assert "CollectiveTimeoutError" in tasks["chief"].output and tasks["chief"].returncode not in (0, None), output
    print(f"chief: error naming worker 1 {said - lost_at:.2f} s after it was lost (timeout_s={TIMEOUT_S:g})")
    assert f"DONE rank 0: step {STEPS}" not in output
    for ps in ("ps0", "ps1"):  # the job failed
        assert tasks[ps].returncode == 1 and "JobFailedError" in tasks[ps].output, output
    return tasks, lost_at, said, output


@pytest.mark.timeout(240)
def test_sync_a_lost_worker_fails_the_chief_in_time_naming_it(tmp_path: Path) -> None:
    _sync_lost_worker(tmp_path)


@pytest.mark.perf
@pytest.mark.timeout(240)
def test_sync_a_lost_worker_fails_the_chief_within_timeout_s(tmp_path: Path) -> None:
    _, lost_at, said, output = _sync_lost_worker(tmp_path)
    assert said - lost_at <= TIMEOUT_S + STEP_MARGIN_S, output


@pytest.mark.timeout(240)
def test_async_the_others_go_on_without_a_lost_or_a_failed_worker(tmp_path: Path) -> None:
    # The chief's 40 steps last at least 40 x 0.15 = 6 s: it is still training when
    # worker 1 has been silent for timeout_s, and ends the job only after that. (A
    # slower machine only makes the steps longer: the sleep is the chief's simulated
    # work, and what matters is only that it outlasts timeout_s.)
    tasks = _run(tmp_path, "async", "both", 0.15, workers=3)
    output = _output(tasks)
    assert tasks["worker1"].first("FAILING rank 1") is not None, output
    assert tasks["worker2"].first("FAILING rank 2") is not None, output
    assert tasks["worker1"].returncode == -9 and tasks["worker2"].returncode == 1, output
    assert {n: tasks[n].returncode for n in ("chief", "ps0", "ps1")} == dict.fromkeys(("chief", "ps0", "ps1"), 0), \
        output
    assert f"DONE rank 0: step {STEPS}" in tasks["chief"].output, output
    # the killed worker: lost when it has not called the ps for timeout_s
    assert "worker 1 was lost: it did not call the ps" in tasks["chief"].output, output
    for ps in ("ps0", "ps1"):
        assert "worker 1 has not called for" in tasks[ps].output and "async training goes on without it" \
            in tasks[ps].output, output
    # the raising worker: failed, with its error
    said = "worker 2 failed: RuntimeError: worker 2 fails on purpose after step 5"
    assert said in tasks["chief"].output and said in tasks["ps0"].output, output
