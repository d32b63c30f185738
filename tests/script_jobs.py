"""Run a user script as a real multi-process job, the way a user starts one: by hand
with ``TF_CONFIG`` (one ``python script.py`` per worker), under ``hostreduce run``, or
under ``mpirun``. Every line is time-stamped as it arrives, so tests can measure how
long a worker took to exit after it printed its result or after a peer failed; every
process is killed when the job overruns its timeout."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Worker:
    """One process of a job: its exit status, output lines with arrival times, exit time."""

    returncode: int | None = None
    lines: list[tuple[float, str]] = field(default_factory=list)
    ended_at: float = 0.0

    @property
    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def first(self, marker: str) -> float | None:
        """Arrival time of the first line containing ``marker``."""
        return next((t for t, line in self.lines if marker in line), None)


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TF_CONFIG", "HOSTREDUCE_SECRET") and not k.startswith(("OMPI_", "PMI_", "PMIX_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.update(extra)
    return env


def _pump(proc: subprocess.Popen, worker: Worker) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        worker.lines.append((time.monotonic(), line))


def _wait_all(procs: Sequence[subprocess.Popen], workers: Sequence[Worker], timeout: float,
              readers: Sequence[threading.Thread]) -> None:
    deadline = time.monotonic() + timeout
    try:
        for proc, worker in zip(procs, workers):
            try:
                worker.returncode = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                worker.ended_at = time.monotonic()
            except subprocess.TimeoutExpired:
                raise TimeoutError(
                    f"job did not end within {timeout} s; output so far:\n"
                    + "\n".join(f"--- worker {i} ---\n{w.output}" for i, w in enumerate(workers))) from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                proc.wait()
        for reader in readers:
            reader.join(5)


def _start(cmd: Sequence[str], env: dict[str, str]) -> tuple[subprocess.Popen, Worker, threading.Thread]:
    proc = subprocess.Popen(list(cmd), env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    worker = Worker()
    reader = threading.Thread(target=_pump, args=(proc, worker), daemon=True)
    reader.start()
    return proc, worker, reader


def run_by_hand(script: str | Path, args: Sequence[str] = (), np: int = 2, timeout: float = 180.0,
                env: dict[str, str] | None = None) -> list[Worker]:
    """Start ``np`` workers as separate ``python script`` processes, each with its own
    ``TF_CONFIG`` and a shared ``HOSTREDUCE_SECRET``, as a user does in ``np`` terminals."""
    from hostreduce.launch.runner import free_ports, tf_config

    addresses = [f"127.0.0.1:{p}" for p in free_ports(np)]
    secret = secrets.token_hex(16)
    started = [_start([sys.executable, str(script), *args],
                      dict(env or base_env(), TF_CONFIG=tf_config(addresses, i), HOSTREDUCE_SECRET=secret))
               for i in range(np)]
    procs, workers, readers = zip(*started)
    _wait_all(procs, workers, timeout, readers)
    return list(workers)


def run_launcher(script: str | Path, args: Sequence[str] = (), np: int = 2, timeout: float = 180.0,
                 env: dict[str, str] | None = None) -> Worker:
    """``hostreduce run -np NP -- python script args``: one process, rank-prefixed output."""
    proc, worker, reader = _start([sys.executable, "-m", "hostreduce", "run", "-np", str(np), "--",
                                   sys.executable, str(script), *args], env or base_env())
    _wait_all([proc], [worker], timeout, [reader])
    return worker


def run_mpirun(script: str | Path, args: Sequence[str] = (), np: int = 2, timeout: float = 180.0,
               env: dict[str, str] | None = None, reducer: str = "mpi") -> Worker:
    """``mpirun -np NP python script args`` with the mpirun that ``reducer`` needs."""
    from hostreduce.reducers._mpi_select import mpirun_command

    env = dict(env or base_env(), HOSTREDUCE_REDUCER=reducer)
    env.pop("MPI4PY_LIBMPI", None)
    cmd = mpirun_command(reducer, np, [sys.executable, str(script), *args])
    proc, worker, reader = _start(cmd, env)
    _wait_all([proc], [worker], timeout, [reader])
    return worker
