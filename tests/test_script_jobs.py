"""The script-job harness (``tests/script_jobs.py``): a job that overruns its timeout
fails with every thread's stack of each of its processes, as they were before the kill,
whether its workers were started by hand, by the launcher or by mpirun."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.mpi_workers.mpi_launch import mpi_skip_reason
from tests.script_jobs import Job, base_env, run_by_hand, run_launcher, run_mpirun

HUNG = """
import json, os, threading

def waits_here_for_ever():
    rank = os.environ.get("OMPI_COMM_WORLD_RANK") or json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    with open(os.path.join(os.environ["TEST_MARKS"], str(rank)), "w"):
        pass  # from now on this function is on the worker's stack, whenever the time is up
    threading.Event().wait()

waits_here_for_ever()
"""


def _timeout_of_a_hung_job(tmp_path: Path, start) -> str:
    """The ``TimeoutError`` message of ``start(script, env, timeout)``'s job of two hung
    workers: with a short timeout, and again with a long one if a loaded machine had
    not even brought both workers into the function they hang in when it was up."""
    script = tmp_path / "hung.py"
    script.write_text(HUNG)
    marks = tmp_path / "marks"
    for timeout in (5, 60):
        marks.mkdir(exist_ok=True)
        for old in marks.iterdir():
            old.unlink()
        with Job() as job:
            with pytest.raises(TimeoutError) as info:
                start(script, base_env(TEST_MARKS=str(marks)), timeout, job)
            assert not job.leftovers()
        if len(list(marks.iterdir())) == 2:
            return str(info.value)
    pytest.fail("the workers never reached the function they hang in")


@pytest.mark.timeout(180)
def test_a_hung_job_by_hand_fails_with_every_workers_stack(tmp_path: Path) -> None:
    message = _timeout_of_a_hung_job(
        tmp_path, lambda script, env, timeout, job: run_by_hand(script, np=2, timeout=timeout, env=env, job=job))
    for worker in ("--- worker 0 ---", "--- worker 1 ---"):
        section = message.split(worker, 1)[1].split("--- worker", 1)[0]
        assert "most recent call first" in section and "in waits_here_for_ever" in section, message


@pytest.mark.timeout(180)
def test_a_hung_job_under_the_launcher_fails_with_every_ranks_stack(tmp_path: Path) -> None:
    message = _timeout_of_a_hung_job(
        tmp_path, lambda script, env, timeout, job: run_launcher(script, np=2, timeout=timeout, env=env, job=job))
    for rank in (0, 1):  # the launcher passes each rank's output on, prefixed with its rank
        assert f"[{rank}] Current thread" in message or f"[{rank}] Thread" in message, message
        assert re.search(rf'^\[{rank}\]   File ".*hung.py", line \d+ in waits_here_for_ever$', message, re.M), message


@pytest.mark.mpi
@pytest.mark.timeout(180)
@pytest.mark.skipif(mpi_skip_reason() is not None, reason=mpi_skip_reason() or "")
def test_a_hung_job_under_mpirun_fails_with_every_ranks_stack(tmp_path: Path) -> None:
    message = _timeout_of_a_hung_job(
        tmp_path, lambda script, env, timeout, job: run_mpirun(script, np=2, timeout=timeout, env=env, job=job))
    assert message.count("in waits_here_for_ever") == 2, message
