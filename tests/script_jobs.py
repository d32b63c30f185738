"""Run a user script as a real multi-process job, the way a user starts one: by hand
with ``TF_CONFIG`` (one ``python script.py`` per worker), under ``hostreduce run``, or
under ``mpirun``. Every line is time-stamped (``time.monotonic()``) as it arrives, and
the exit of every process is noticed within 20 ms, so tests can measure how long a
worker took to exit after it printed its result or after a peer failed.

Every process of a job, down to the ranks mpirun or the launcher starts, carries the
job's marker in its environment (``TEST_JOB_MARKER``): :meth:`Job.leftovers` finds any
that outlived the job, and :meth:`Job.kill` ends them all. A job that overruns its
timeout is killed and raises ``TimeoutError`` with its output so far, which ends with
every thread's stack of each of its Python processes, taken just before the kill.
"""
from __future__ import annotations

import os
import resource
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Sequence

from hostreduce.cluster import format_tf_config
from hostreduce.processes import alive, free_ports, stop_groups, tf_config

ROOT = Path(__file__).resolve().parents[1]
MARKER_VAR = "TEST_JOB_MARKER"


@dataclass
class Worker:
    """One process of a job: its exit status, output lines with arrival times, exit time."""

    returncode: int | None = None
    lines: list[tuple[float, str]] = field(default_factory=list)  # stdout and stderr, as they arrived
    stderr_lines: list[str] = field(default_factory=list)
    ended_at: float = 0.0

    @property
    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    @property
    def stderr(self) -> str:
        return "".join(self.stderr_lines)

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


class Job:
    """The processes of one job, each started in a session of its own."""

    def __init__(self) -> None:
        self.marker = f"job-{uuid.uuid4().hex[:12]}"
        self._procs: list[subprocess.Popen[str]] = []
        self._workers: list[Worker] = []
        self._readers: list[threading.Thread] = []

    def start(self, cmd: Sequence[str], env: dict[str, str]) -> Worker:
        # PYTHONFAULTHANDLER: every Python process of the job prints every thread's stack
        # on SIGABRT, which a timeout sends before the kill (see _dump_stacks).
        proc = subprocess.Popen(list(cmd), env={**env, MARKER_VAR: self.marker, "PYTHONFAULTHANDLER": "1"},
                                cwd=str(ROOT), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        worker = Worker()
        self._procs.append(proc)
        self._workers.append(worker)
        for stream, also in ((proc.stdout, None), (proc.stderr, worker.stderr_lines)):
            reader = threading.Thread(target=_pump, args=(stream, worker, also), daemon=True)
            reader.start()
            self._readers.append(reader)
        return worker

    def wait(self, timeout: float) -> list[Worker]:
        """Wait until every process started so far has exited; kill them all and raise
        ``TimeoutError`` if one runs past ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        running = set(range(len(self._procs)))
        while running:
            for i in sorted(running):
                code = self._procs[i].poll()
                if code is not None:
                    self._workers[i].returncode, self._workers[i].ended_at = code, time.monotonic()
                    running.discard(i)
            if running and time.monotonic() > deadline:
                self._dump_stacks()
                self.kill()
                raise TimeoutError(
                    f"job did not end within {timeout} s (workers {sorted(running)} still running); output so far, "
                    "ending with every thread's stack of each Python process that was still running (its "
                    "'Fatal Python error: Aborted' is the SIGABRT that had it print them):\n"
                    + "\n".join(f"--- worker {i} ---\n{w.output}" for i, w in enumerate(self._workers)))
            time.sleep(0.02)
        self._join_readers()
        return list(self._workers)

    def signal(self, index: int, sig: int = signal.SIGKILL) -> float:
        """Send ``sig`` to the process started ``index``-th (its whole session); the
        time it was sent (``time.monotonic()``)."""
        os.killpg(self._procs[index].pid, sig)
        return time.monotonic()

    def running(self, index: int) -> bool:
        return self._procs[index].poll() is None

    def leftovers(self) -> list[int]:
        """Live processes of this job (a rank or helper that outlived its parent)."""
        tag = f"{MARKER_VAR}={self.marker}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if tag in (entry / "environ").read_bytes().split(b"\0"):
                        pids.append(int(entry.name))
                except OSError:  # gone, or not ours
                    continue
        return pids

    def _dump_stacks(self) -> None:
        """Have every Python process of the job still running print every thread's stack
        to its standard error (faulthandler's answer to SIGABRT, after which it ends).
        The ranks under a launcher or mpirun go first, while the processes above them
        are held stopped (a launcher would stop the other ranks as soon as one ends, and
        drop what they print); once resumed, those pass the ranks' output on and end.
        Then the processes the job started itself."""
        python = os.path.realpath(sys.executable)
        ours = {proc.pid for proc in self._procs}
        pids = self.leftovers()
        inner = [p for p in pids if p not in ours and _executable(p) == python]
        if inner:
            held = [p for p in pids if p not in inner]
            _send(held, signal.SIGSTOP)
            _abort(inner)
            _wait_gone(inner, 10.0)
            _send(held, signal.SIGCONT)
            _wait_gone(ours, 5.0)
        _abort([p for p in pids if p in ours and _executable(p) == python and alive(p)])
        _wait_gone(pids, 10.0)

    def kill(self) -> None:
        """Stop every process of the job still alive (its process groups, then what
        was left outside them); safe to call more than once."""
        stop_groups(self._procs, self.leftovers(), grace_s=0.0)
        self._join_readers()

    def _join_readers(self) -> None:
        # A leftover process may hold a pipe open: never wait for it for long.
        for reader in self._readers:
            reader.join(5)

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def _executable(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


def _send(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _abort(pids: Sequence[int]) -> None:
    """SIGABRT each process, without a core dump (it only has to print its stacks)."""
    for pid in pids:
        try:
            resource.prlimit(pid, resource.RLIMIT_CORE, (0, resource.prlimit(pid, resource.RLIMIT_CORE)[1]))
        except OSError:
            pass
    _send(pids, signal.SIGABRT)


def _wait_gone(pids: Sequence[int] | set[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


def _pump(stream: IO[str], worker: Worker, also: list[str] | None) -> None:
    for line in stream:
        worker.lines.append((time.monotonic(), line))
        if also is not None:
            also.append(line)


def _run(starts: Sequence[tuple[Sequence[str], dict[str, str]]], timeout: float, job: Job | None) -> list[Worker]:
    if job is not None:  # the caller checks job.leftovers() and kills the job itself
        for cmd, env in starts:
            job.start(cmd, env)
        return job.wait(timeout)
    with Job() as own:
        for cmd, env in starts:
            own.start(cmd, env)
        return own.wait(timeout)


def run_by_hand(script: str | Path, args: Sequence[str] = (), np: int = 2, timeout: float = 180.0,
                env: dict[str, str] | None = None, job: Job | None = None) -> list[Worker]:
    """Start ``np`` workers as separate ``python script`` processes, each with its own
    ``TF_CONFIG`` and a shared ``HOSTREDUCE_SECRET``, as a user does in ``np`` terminals."""
    addresses = [f"127.0.0.1:{p}" for p in free_ports(np)]
    secret = secrets.token_hex(16)
    return _run([([sys.executable, str(script), *args],
                  dict(env or base_env(), TF_CONFIG=tf_config(addresses, i), HOSTREDUCE_SECRET=secret))
                 for i in range(np)], timeout, job)


def run_launcher(script: str | Path, args: Sequence[str] = (), np: int = 2, timeout: float = 180.0,
                 env: dict[str, str] | None = None, job: Job | None = None, extra: Sequence[str] = ()) -> Worker:
    """``hostreduce run -np NP [extra] -- python script args``: one process, rank-prefixed output."""
    cmd = [sys.executable, "-m", "hostreduce", "run", "-np", str(np), *extra, "--", sys.executable, str(script),
           *args]
    return _run([(cmd, env or base_env())], timeout, job)[0]


def run_mpirun(script: str | Path, args: Sequence[str] = (), np: int = 2, timeout: float = 180.0,
               env: dict[str, str] | None = None, reducer: str = "mpi", job: Job | None = None) -> Worker:
    """``mpirun -np NP python script args`` with the mpirun that ``reducer`` needs."""
    from hostreduce.reducers.mpi.select import mpirun_command

    env = dict(env or base_env(), HOSTREDUCE_REDUCER=reducer)
    env.pop("MPI4PY_LIBMPI", None)
    cmd = mpirun_command(reducer, np, [sys.executable, str(script), *args])
    return _run([(cmd, env)], timeout, job)[0]


def run_reference(script: str | Path, args: Sequence[str] = (), timeout: float = 180.0
                  ) -> subprocess.CompletedProcess:
    """Run ``python script *args`` as one process outside any job (no ``TF_CONFIG``): a
    test's one-process reference run. It runs in a rank of ``hostreduce.testing``, forked
    from the server that imported TensorFlow once when the suite preloads it, so it does
    not pay TensorFlow's import; the script runs as ``__main__`` with its own
    ``sys.argv``, its output captured. Returns its exit status and output."""
    from hostreduce.testing import run_ranks

    code, out, err = run_ranks(_script_rank, 1, args=(str(script), list(args)), timeout=timeout,
                               env={"TF_CONFIG": None, "HOSTREDUCE_SECRET": None}, transport_env=False)[0]
    return subprocess.CompletedProcess([sys.executable, str(script), *args], code, out, err)


def _script_rank(rank: int, size: int, script: str, args: list[str]) -> tuple[int, str, str]:
    import contextlib
    import io
    import runpy
    import traceback

    sys.argv = [script, *args]
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - reported as the script's own failure
            traceback.print_exc()
            code = 1
    return code, out.getvalue(), err.getvalue()


def ps_cluster(ps: int, workers: int, evaluator: bool = False) -> dict[str, list[str]]:
    """A ``TF_CONFIG`` cluster of ``ps`` parameter servers, a chief and ``workers - 1``
    workers (and an evaluator) on free loopback ports."""
    ports = iter(free_ports(ps + workers + int(evaluator)))
    cluster = {"chief": [f"127.0.0.1:{next(ports)}"],
               "worker": [f"127.0.0.1:{next(ports)}" for _ in range(workers - 1)],
               "ps": [f"127.0.0.1:{next(ports)}" for _ in range(ps)]}
    if evaluator:
        cluster["evaluator"] = [f"127.0.0.1:{next(ports)}"]
    return {k: v for k, v in cluster.items() if v}


def run_ps_by_hand(script: str | Path, args: Sequence[str] = (), ps: int = 2, workers: int = 2,
                   evaluator: bool = False, timeout: float = 180.0, env: dict[str, str] | None = None,
                   job: Job | None = None, cluster: dict[str, list[str]] | None = None,
                   ps_script: str | Path | None = None) -> dict[str, Worker]:
    """Start every task of a parameter-server job as its own ``python script`` process
    with its ``TF_CONFIG`` and a shared ``HOSTREDUCE_SECRET``, as a user does (one
    terminal per task); the processes by task (``chief``, ``worker1``, ``ps0``, ...,
    ``evaluator``), started in the order ps, chief, workers, evaluator. ``cluster``: the
    addresses (default: :func:`ps_cluster` of ``ps``, ``workers``, ``evaluator``);
    ``ps_script``: what the ps tasks run instead (without ``args``)."""
    cluster = cluster or ps_cluster(ps, workers, evaluator)
    secret = secrets.token_hex(16)
    tasks = [(t, i) for t in ("ps", "chief", "worker", "evaluator") for i in range(len(cluster.get(t, [])))]
    starts = [([sys.executable, str(ps_script)] if ps_script and t == "ps" else [sys.executable, str(script), *args],
               dict(env or base_env(), HOSTREDUCE_SECRET=secret,
                    TF_CONFIG=format_tf_config(cluster, i, t)))
              for t, i in tasks]
    done = _run(starts, timeout, job)
    names = [t if t in ("chief", "evaluator") else f"{t}{i + (t == 'worker')}" for t, i in tasks]
    return dict(zip(names, done))
