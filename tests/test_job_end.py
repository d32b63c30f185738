"""A job always ends: workers that never call close() exit 0, and a worker that raises
makes every worker exit non-zero, with the failed rank named; the ``perf`` tests check
that this happens promptly, and within timeout_s. Run as real scripts: hand-started
TF_CONFIG processes, under the launcher, and under mpirun with the 'mpi' reducer."""
from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mpi_workers.mpi_launch import mpi_skip_reason
from tests.script_jobs import Job, Worker, base_env, run_by_hand, run_launcher, run_mpirun

SCRIPT = Path(__file__).resolve().parent / "job_workers" / "job_end.py"
TIMEOUT_S = 5.0      # the job's timeout_s
# The perf tests' bounds: a finished worker that never called close() exits within
# EXIT_AFTER_S; a raise ends every worker within timeout_s and SLACK_S, a margin for
# interpreter start and teardown on a loaded two-core machine. The other tests check
# that the job ends (before its harness's timeout), and how.
EXIT_AFTER_S = 10.0
SLACK_S = 3.0


def _env(marks: Path, transport: str = "auto") -> dict[str, str]:
    env = {k: v for k, v in base_env().items() if not k.startswith("HOSTREDUCE_")}
    env["HOSTREDUCE_TIMEOUT_S"] = str(TIMEOUT_S)
    env["HOSTREDUCE_TRANSPORT"] = transport
    env["PYTHONUNBUFFERED"] = "1"
    env["JOB_END_MARKS"] = str(marks)
    return env


@pytest.fixture
def job():
    """The test's job: every process of it is killed when the test ends, however it ends."""
    with Job() as j:
        yield j


def _stamp(text: str, word: str) -> dict[int, float]:
    return {int(r): float(t) for r, t in re.findall(rf"{word} (\d+) ([0-9.]+)", text)}


def _hand_started(job: Job, tmp_path: Path, size: int, *args: str, transport: str = "auto") -> list[Worker]:
    return run_by_hand(SCRIPT, ["ring", *args], np=size, timeout=60, env=_env(tmp_path, transport), job=job)


def _failure_plan(size: int) -> tuple[int, int, str]:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    return rng.randrange(size), rng.randrange(1, 30), f"seed={seed}"


# --------------------------------------------------------------------------- TF_CONFIG


def _never_close(job: Job, tmp_path: Path, size: int) -> tuple[list[Worker], dict[int, float]]:
    workers = _hand_started(job, tmp_path, size, "noclose", "20")
    finished = {}
    for rank, w in enumerate(workers):
        assert w.returncode == 0, f"rank {rank} exited {w.returncode}:\n{w.stderr[-3000:]}"
        finished.update(_stamp(w.output, "FINISHED"))
    assert sorted(finished) == list(range(size)), [w.output for w in workers]
    assert not job.leftovers()
    return workers, finished


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 4])
def test_workers_that_never_close_exit_zero_promptly(job, tmp_path, size):
    _never_close(job, tmp_path, size)


@pytest.mark.perf
@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 4])
def test_workers_that_never_close_exit_within_seconds_of_finishing(job, tmp_path, size):
    workers, finished = _never_close(job, tmp_path, size)
    lag = max(workers[r].ended_at - finished[r] for r in range(size))
    assert lag < EXIT_AFTER_S, f"a worker took {lag:.1f} s to exit after finishing"


def _raise(job: Job, tmp_path: Path, size: int, mode: str, transport: str = "auto"
           ) -> tuple[list[Worker], dict[int, float], int, str]:
    victim, step, seed = _failure_plan(size)
    workers = _hand_started(job, tmp_path, size, mode, "40", str(victim), str(step), transport=transport)
    raised = _stamp(workers[victim].output, "RAISING")
    assert victim in raised, (seed, workers[victim].stderr[-3000:])
    assert "ValueError: boom" in workers[victim].stderr, seed
    for rank, w in enumerate(workers):
        out = w.output
        assert w.returncode != 0, f"{seed}: rank {rank} exited 0:\n{out[-3000:]}"
        if rank != victim:
            assert "PeerLostError" in out and f"rank {victim} " in out, (seed, rank, out[-3000:])
            assert "ValueError: boom" in out, (seed, rank, out[-3000:])
    assert not job.leftovers()
    return workers, raised, victim, seed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["raise", "catch"])
@pytest.mark.parametrize("size", [2, 4])
def test_a_worker_that_raises_ends_every_worker_non_zero(job, tmp_path, size, mode):
    _raise(job, tmp_path, size, mode)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 4])
def test_a_worker_that_raises_tells_every_worker_why_on_the_tcp_data_path(job, tmp_path, size):
    # The failure report over gRPC, not the end of the data connection, names the cause.
    _raise(job, tmp_path, size, "raise", transport="tcp")


@pytest.mark.perf
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["raise", "catch"])
@pytest.mark.parametrize("size", [2, 4])
def test_a_worker_that_raises_ends_every_worker_within_timeout_s(job, tmp_path, size, mode):
    workers, raised, victim, seed = _raise(job, tmp_path, size, mode)
    for rank, w in enumerate(workers):
        took = w.ended_at - raised[victim]
        assert took < TIMEOUT_S + SLACK_S, f"{seed}: rank {rank} exited {took:.1f} s after the raise"


# --------------------------------------------------------------------------- launcher


def _launched(job: Job, tmp_path: Path, size: int, *args: str) -> Worker:
    return run_launcher(SCRIPT, ["ring", *args], np=size, timeout=60, env=_env(tmp_path), job=job)


def _launched_never_close(job: Job, tmp_path: Path) -> tuple[Worker, dict[int, float]]:
    w = _launched(job, tmp_path, 2, "noclose", "20")
    assert w.returncode == 0, w.stderr[-3000:]
    finished = _stamp(w.output, r"\] FINISHED")
    assert sorted(finished) == [0, 1], w.output
    assert not job.leftovers()
    return w, finished


@pytest.mark.timeout(90)
def test_launcher_workers_that_never_close_exit_zero(job, tmp_path):
    _launched_never_close(job, tmp_path)


@pytest.mark.perf
@pytest.mark.timeout(90)
def test_launcher_workers_that_never_close_exit_within_seconds_of_finishing(job, tmp_path):
    w, finished = _launched_never_close(job, tmp_path)
    assert w.ended_at - max(finished.values()) < EXIT_AFTER_S


def _launched_raise(job: Job, tmp_path: Path) -> tuple[Worker, dict[int, float], int, str]:
    victim, step, seed = _failure_plan(2)
    w = _launched(job, tmp_path, 2, "catch", "40", str(victim), str(step))
    assert w.returncode != 0, (seed, w.stderr[-3000:])
    raised = _stamp(w.output, r"\] RAISING")
    assert victim in raised, (seed, w.output[-3000:])
    # The launcher names the first worker to exit: the one that raised, or a peer that
    # learned of it first (whose error names the one that raised).
    assert re.search(r"worker \d exited with code 1( \(.*\))?; the other workers were stopped\n?$", w.stderr), \
        (seed, w.stderr[-3000:])
    assert "ValueError: boom" in w.stderr, seed
    assert not job.leftovers()
    return w, raised, victim, seed


@pytest.mark.timeout(90)
def test_launcher_a_worker_that_raises_ends_the_job(job, tmp_path):
    _launched_raise(job, tmp_path)


@pytest.mark.perf
@pytest.mark.timeout(90)
def test_launcher_a_worker_that_raises_ends_the_job_within_timeout_s(job, tmp_path):
    w, raised, victim, seed = _launched_raise(job, tmp_path)
    assert w.ended_at - raised[victim] < TIMEOUT_S + SLACK_S, seed


# --------------------------------------------------------------------------- mpirun


_MPI_SKIP = mpi_skip_reason()


def _mpirun(job: Job, tmp_path: Path, *args: str) -> Worker:
    return run_mpirun(SCRIPT, ["mpi", *args], np=2, timeout=90, env=_env(tmp_path), job=job)


def _mpi_never_close(job: Job, tmp_path: Path) -> tuple[Worker, dict[int, float]]:
    w = _mpirun(job, tmp_path, "noclose", "20")
    assert w.returncode == 0, w.output[-3000:]
    finished = _stamp(w.output, "FINISHED")
    assert sorted(finished) == [0, 1], w.output
    assert not job.leftovers()
    return w, finished


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.skipif(_MPI_SKIP is not None, reason=_MPI_SKIP or "")
def test_mpi_workers_that_never_close_exit_zero(job, tmp_path):
    _mpi_never_close(job, tmp_path)


@pytest.mark.mpi
@pytest.mark.perf
@pytest.mark.timeout(120)
@pytest.mark.skipif(_MPI_SKIP is not None, reason=_MPI_SKIP or "")
def test_mpi_workers_that_never_close_exit_within_seconds_of_finishing(job, tmp_path):
    w, finished = _mpi_never_close(job, tmp_path)
    assert w.ended_at - max(finished.values()) < EXIT_AFTER_S


def _mpi_raise(job: Job, tmp_path: Path) -> tuple[Worker, dict[int, float], int, str]:
    victim, step, seed = _failure_plan(2)
    w = _mpirun(job, tmp_path, "raise", "40", str(victim), str(step))
    assert w.returncode != 0, (seed, w.output[-3000:])
    raised = _stamp(w.output, "RAISING")
    assert victim in raised, (seed, w.output[-3000:])
    assert "ValueError: boom" in w.stderr and "MPI_Abort" in w.stderr, (seed, w.stderr[-3000:])
    assert not job.leftovers()
    return w, raised, victim, seed


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.skipif(_MPI_SKIP is not None, reason=_MPI_SKIP or "")
def test_mpi_a_rank_that_raises_aborts_the_job(job, tmp_path):
    _mpi_raise(job, tmp_path)


@pytest.mark.mpi
@pytest.mark.perf
@pytest.mark.timeout(120)
@pytest.mark.skipif(_MPI_SKIP is not None, reason=_MPI_SKIP or "")
def test_mpi_a_rank_that_raises_aborts_the_job_within_timeout_s(job, tmp_path):
    w, raised, victim, seed = _mpi_raise(job, tmp_path)
    assert w.ended_at - raised[victim] < TIMEOUT_S + SLACK_S, seed


# --------------------------------------------------------------------------- the hook


class _Recorder:
    """A minimal reducer that records how it was closed."""

    @staticmethod
    def make():
        from hostreduce.reducers.base import Reducer

        class Recorder(Reducer):
            name = "recorder"
            rank, size = 0, 1
            allreduce_async = broadcast_async = allgather_async = barrier = None  # type: ignore[assignment]

            def __init__(self) -> None:
                super().__init__()
                self.how: list[str] = []
                self._register_live()

            def _close(self) -> None:
                self.how.append("close")

            def _close_failed(self, reason: str) -> None:
                self.how.append(f"abort: {reason}")

        Recorder.__abstractmethods__ = frozenset()
        return Recorder()


def test_exit_hook_runs_before_the_thread_pools_are_joined_and_closes_live_reducers(monkeypatch):
    import concurrent.futures.thread as cft
    import threading

    from hostreduce.reducers import job_end

    kept, ended, failed = _Recorder.make(), _Recorder.make(), _Recorder.make()
    ended.close()
    with pytest.raises(ValueError):
        with failed:
            raise ValueError("boom")
    names = [getattr(getattr(f, "func", f), "__name__", "") for f in threading._threading_atexits]
    # threading runs these in reverse order: ours must come after the pools' join in the list.
    assert names.index("_close_live_at_exit") > names.index(cft._python_exit.__name__), names
    monkeypatch.delattr(sys, "last_value", raising=False)
    job_end._close_live_at_exit()
    assert kept.how == ["close"] and ended.how == ["close"] and failed.how == ["abort: ValueError: boom"]
    again = _Recorder.make()
    monkeypatch.setattr(sys, "last_value", KeyError("k"), raising=False)
    job_end._close_live_at_exit()
    assert again.how == ["abort: KeyError: 'k'"] and kept.how == ["close"]


def test_python_sets_last_value_before_threading_exit_hooks():
    code = ("import sys, threading\n"
            "threading._register_atexit(lambda: print('HOOK', repr(getattr(sys, 'last_value', None)), flush=True))\n"
            "raise ValueError('boom')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert res.returncode == 1 and "HOOK ValueError('boom')" in res.stdout, (res.stdout, res.stderr)
