"""A job always ends: workers that never call close() exit 0 promptly, and a worker that
raises makes every worker exit non-zero within timeout_s, with the failed rank named.
Run as real scripts: hand-started TF_CONFIG processes, under the launcher, and under
mpirun with the 'mpi' reducer."""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hostreduce.launch.runner import free_ports, tf_config

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi_workers"))
from mpi_launch import mpi_skip_reason  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "job_workers" / "job_end.py"
TIMEOUT_S = 5.0      # the job's timeout_s
EXIT_AFTER_S = 10.0  # a finished worker that never called close() exits within this
# Margin for interpreter start and teardown on a loaded two-core machine.
SLACK_S = 3.0


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTREDUCE_") and k != "TF_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env["HOSTREDUCE_TIMEOUT_S"] = str(TIMEOUT_S)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _leftovers(marker: str) -> list[int]:
    """Processes whose command line carries ``marker`` (the processes of one test run)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


class Job:
    """Processes started for one test, each in its own session; every one is killed
    (with its whole group) when the test ends, however it ends."""

    def __init__(self) -> None:
        self.marker = f"job-end-{uuid.uuid4().hex[:12]}"
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        proc = subprocess.Popen([*cmd, "--", self.marker], env=env, cwd=str(ROOT), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.procs.append(proc)
        return proc

    def wait(self, timeout: float) -> list[tuple[int, float, str, str]]:
        """(exit code, time.time() at exit, stdout, stderr) of every process; kills all
        and fails the test if any runs past ``timeout``."""
        deadline, ended = time.monotonic() + timeout, {}
        while len(ended) < len(self.procs):
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"processes still running after {timeout} s: "
                            f"{[i for i in range(len(self.procs)) if i not in ended]}")
            for i, p in enumerate(self.procs):
                if i not in ended and p.poll() is not None:
                    ended[i] = time.time()
            time.sleep(0.02)
        outs = [p.communicate(timeout=10) for p in self.procs]
        return [(p.returncode, ended[i], *outs[i]) for i, p in enumerate(self.procs)]

    def kill(self) -> None:
        for p in self.procs:
            for kill in (os.killpg, os.kill):
                try:
                    kill(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for pid in _leftovers(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in self.procs:
            try:
                p.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass


@pytest.fixture
def job():
    j = Job()
    try:
        yield j
    finally:
        j.kill()


def _stamp(text: str, word: str) -> dict[int, float]:
    return {int(r): float(t) for r, t in re.findall(rf"{word} (\d+) ([0-9.]+)", text)}


def _hand_started(job: Job, size: int, *args: str) -> list[tuple[int, float, str, str]]:
    addresses = [f"127.0.0.1:{p}" for p in free_ports(size)]
    secret = uuid.uuid4().hex
    for rank in range(size):
        job.start([sys.executable, str(SCRIPT), "ring", *args],
                  _env(TF_CONFIG=tf_config(addresses, rank), HOSTREDUCE_SECRET=secret))
    return job.wait(60)


def _failure_plan(size: int) -> tuple[int, int, str]:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    return rng.randrange(size), rng.randrange(1, 30), f"seed={seed}"


# --------------------------------------------------------------------------- TF_CONFIG


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 4])
def test_workers_that_never_close_exit_zero_promptly(job, size):
    outs = _hand_started(job, size, "noclose", "20")
    finished = {}
    for rank, (code, _, out, err) in enumerate(outs):
        assert code == 0, f"rank {rank} exited {code}:\n{err[-3000:]}"
        finished.update(_stamp(out, "FINISHED"))
    assert sorted(finished) == list(range(size)), outs
    lag = max(outs[r][1] - finished[r] for r in range(size))
    assert lag < EXIT_AFTER_S, f"a worker took {lag:.1f} s to exit after finishing"
    assert not _leftovers(job.marker)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["raise", "catch"])
@pytest.mark.parametrize("size", [2, 4])
def test_a_worker_that_raises_ends_every_worker_non_zero(job, size, mode):
    victim, step, seed = _failure_plan(size)
    outs = _hand_started(job, size, mode, "40", str(victim), str(step))
    raised = _stamp(outs[victim][2], "RAISING")
    assert victim in raised, (seed, outs[victim][3][-3000:])
    assert "ValueError: boom" in outs[victim][3], seed
    for rank, (code, ended, out, err) in enumerate(outs):
        assert code != 0, f"{seed}: rank {rank} exited 0:\n{out}\n{err[-3000:]}"
        took = ended - raised[victim]
        assert took < TIMEOUT_S + SLACK_S, f"{seed}: rank {rank} exited {took:.1f} s after the raise"
        if rank != victim:
            assert "PeerLostError" in out + err and f"rank {victim} " in out + err, (seed, rank, out, err[-3000:])
            assert "ValueError: boom" in out + err, (seed, rank, err[-3000:])
    assert not _leftovers(job.marker)


# --------------------------------------------------------------------------- launcher


def _launched(job: Job, size: int, *args: str) -> tuple[int, float, str, str]:
    cmd = [sys.executable, "-m", "hostreduce", "run", "-np", str(size), "--",
           sys.executable, str(SCRIPT), "ring", *args]
    job.start(cmd, _env())
    return job.wait(60)[0]


@pytest.mark.timeout(90)
def test_launcher_workers_that_never_close_exit_zero(job):
    code, ended, out, err = _launched(job, 2, "noclose", "20")
    assert code == 0, err[-3000:]
    finished = _stamp(out, r"\] FINISHED")
    assert sorted(finished) == [0, 1], out
    assert ended - max(finished.values()) < EXIT_AFTER_S
    assert not _leftovers(job.marker)


@pytest.mark.timeout(90)
def test_launcher_a_worker_that_raises_ends_the_job(job):
    victim, step, seed = _failure_plan(2)
    code, ended, out, err = _launched(job, 2, "catch", "40", str(victim), str(step))
    assert code != 0, (seed, err[-3000:])
    raised = _stamp(out, r"\] RAISING")
    assert victim in raised, (seed, out, err[-3000:])
    assert ended - raised[victim] < TIMEOUT_S + SLACK_S, seed
    # The launcher names the first worker to exit: the one that raised, or a peer that
    # learned of it first (whose error names the one that raised).
    assert re.search(r"worker \d exited with code 1; stopping the other workers", err), (seed, err[-3000:])
    assert "ValueError: boom" in err, seed
    assert not _leftovers(job.marker)


# --------------------------------------------------------------------------- mpirun


_MPI_SKIP = mpi_skip_reason()


def _mpirun(job: Job, *args: str) -> tuple[int, float, str, str]:
    from hostreduce.reducers._mpi_select import mpirun_command

    cmd = mpirun_command("mpi", 2, [sys.executable, str(SCRIPT), "mpi", *args])
    env = _env()
    env.pop("MPI4PY_LIBMPI", None)
    job.start(cmd, env)
    return job.wait(90)[0]


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.skipif(_MPI_SKIP is not None, reason=_MPI_SKIP or "")
def test_mpi_workers_that_never_close_exit_zero(job):
    code, ended, out, err = _mpirun(job, "noclose", "20")
    assert code == 0, (out, err[-3000:])
    finished = _stamp(out, "FINISHED")
    assert sorted(finished) == [0, 1], out
    assert ended - max(finished.values()) < EXIT_AFTER_S
    assert not _leftovers(job.marker)


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.skipif(_MPI_SKIP is not None, reason=_MPI_SKIP or "")
def test_mpi_a_rank_that_raises_aborts_the_job(job):
    victim, step, seed = _failure_plan(2)
    code, ended, out, err = _mpirun(job, "raise", "40", str(victim), str(step))
    assert code != 0, (seed, out, err[-3000:])
    raised = _stamp(out, "RAISING")
    assert victim in raised, (seed, out, err[-3000:])
    assert ended - raised[victim] < TIMEOUT_S + SLACK_S, seed
    assert "ValueError: boom" in err and "MPI_Abort" in err, (seed, err[-3000:])
    assert not _leftovers(job.marker)


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

    from hostreduce.reducers import base

    kept, ended, failed = _Recorder.make(), _Recorder.make(), _Recorder.make()
    ended.close()
    with pytest.raises(ValueError):
        with failed:
            raise ValueError("boom")
    names = [getattr(getattr(f, "func", f), "__name__", "") for f in threading._threading_atexits]
    # threading runs these in reverse order: ours must come after the pools' join in the list.
    assert names.index("_close_live_at_exit") > names.index(cft._python_exit.__name__), names
    monkeypatch.delattr(sys, "last_value", raising=False)
    base._close_live_at_exit()
    assert kept.how == ["close"] and ended.how == ["close"] and failed.how == ["abort: ValueError: boom"]
    again = _Recorder.make()
    monkeypatch.setattr(sys, "last_value", KeyError("k"), raising=False)
    base._close_live_at_exit()
    assert again.how == ["abort: KeyError: 'k'"] and kept.how == ["close"]


def test_python_sets_last_value_before_threading_exit_hooks():
    code = ("import sys, threading\n"
            "threading._register_atexit(lambda: print('HOOK', repr(getattr(sys, 'last_value', None)), flush=True))\n"
            "raise ValueError('boom')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert res.returncode == 1 and "HOOK ValueError('boom')" in res.stdout, (res.stdout, res.stderr)
