"""Jobs: the worker processes of one measurement, started together, watched, and
always stopped.

A job is one command per process (each with its own environment) or a single
launcher command (``mpirun``) that starts the ranks itself. Every process is started
in its own session with the source tree on its ``PYTHONPATH``, its output in a log
file of the job's work directory; the job fails as soon as one process exits non-zero
or its wall-clock limit passes, and then every process of it is killed: the sessions
we started and every pid the workers recorded (a launcher's ranks can live elsewhere).

The worker side (:func:`run_worker`) records that pid, arms a watchdog that dumps every
thread's stack and exits past the plan's ``worker_timeout_s``, and turns an exception
into an ``error.<rank>`` file with its traceback. Workers write their results as JSON
lines, one file per rank, read back with :func:`records`.

Standard library only: a benchmark's coordinating process stays light.
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from hostreduce.processes import stop_groups

__all__ = ["REPO_ROOT", "base_env", "WorkerJob", "JobResult", "run_job", "read_jsonl",
           "records", "records_by_rank", "worker_argv", "write_plan", "workroot", "file_barrier", "run_worker",
           "PeakRss"]

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """What every worker process gets on top of this process's environment: the source
    tree first on ``PYTHONPATH`` (hostreduce need not be installed), unbuffered output,
    TensorFlow's start-up notices off."""
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2", **(extra or {})}


# --------------------------------------------------------------------------- the coordinator's side


@dataclass
class WorkerJob:
    """One multi-process run: one command per process (``argvs``), each with its own
    extra environment, or a single launcher command (``argvs`` of length 1, e.g.
    mpirun) that starts the ranks itself."""

    name: str
    argvs: list[list[str]]
    envs: list[dict[str, str]]
    workdir: Path
    timeout_s: float


_EXC_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b.*$", re.M)


@dataclass
class JobResult:
    name: str
    ok: bool
    seconds: float
    returncodes: list[int | None]
    workdir: Path
    error: str | None = None
    logs: dict[str, str] = field(default_factory=dict)

    def worker_error(self, limit: int = 3000) -> str | None:
        """The first ``error.<rank>`` file a worker wrote (its exception and traceback)."""
        errors = sorted(self.workdir.glob("error.*"))
        return errors[0].read_text()[-limit:] if errors else None

    def cause(self) -> str | None:
        """The last exception line of the first failing process's output: the one-line cause."""
        texts = [self.worker_error()] + [_tail(p, limit=None) for p in sorted(self.workdir.glob("log.*"))]
        for text in texts:
            found = _EXC_LINE.findall(text or "")
            if found:
                return found[-1].strip()[:300]
        if any("Timeout (" in (t or "") for t in texts):  # faulthandler's watchdog fired
            return "a worker hung past its watchdog (its threads' stacks end log_tail; --keep-workdir keeps whole logs)"
        return None

    def failure(self, tail: int = 2000, cause: bool = False) -> dict[str, Any]:
        """What the run record of a failed job says: the error, the worker's exception
        (with ``cause``, also its one-line cause), and the tails of the logs."""
        out: dict[str, Any] = {"error": self.error, "worker_error": self.worker_error()}
        if cause:
            out["cause"] = self.cause()
        out["log_tail"] = {k: v[-tail:] for k, v in self.logs.items() if v.strip()}
        return out


def _tail(path: Path, limit: int | None = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return (data[-limit:] if limit else data).decode("utf-8", "replace")


def _kill_job(procs: list[subprocess.Popen], workdir: Path) -> None:
    """Every process of a job: the sessions we started, then any pid a rank recorded."""
    pids: set[int] = set()
    for pidfile in workdir.glob("pid.*"):
        try:
            pids.add(int(pidfile.read_text().strip()))
        except (OSError, ValueError):
            pass
    stop_groups(procs, pids)


def run_job(job: WorkerJob, poll_s: float = 0.05) -> JobResult:
    """Start every process of ``job``, wait for all of them, and never hang.

    The job fails as soon as one process exits non-zero or the wall-clock timeout
    passes; the rest are then killed. stdout/stderr go to files in the workdir, whose
    tails are returned for the error report.
    """
    job.workdir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    start = time.monotonic()
    error = None
    try:
        for i, (argv, extra) in enumerate(zip(job.argvs, job.envs)):
            log = job.workdir / f"log.{i}"
            logs.append(log)
            with open(log, "wb") as fh:
                procs.append(subprocess.Popen(argv, env={**os.environ, **extra}, stdout=fh, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(REPO_ROOT)))
        while True:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                error = f"process {bad[0][0]} exited with code {bad[0][1]}"
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() - start > job.timeout_s:
                error = f"timed out after {job.timeout_s:.0f} s"
                break
            time.sleep(poll_s)
    except BaseException as exc:  # KeyboardInterrupt included: never leave workers behind
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        if error is not None:
            _kill_job(procs, job.workdir)
    return JobResult(name=job.name, ok=error is None, seconds=time.monotonic() - start,
                     returncodes=[p.poll() for p in procs], workdir=job.workdir, error=error,
                     logs={log.name: _tail(log) for log in logs})


def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSON-lines file; a torn last line (writer killed) is skipped."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass
    except FileNotFoundError:
        pass
    return out


def records(workdir: Path, kind: str | None = None) -> list[dict]:
    """Every record the ranks of a job wrote (``rank*.jsonl``), of ``kind`` if given."""
    out = []
    for f in sorted(workdir.glob("rank*.jsonl")):
        out += [r for r in read_jsonl(f) if kind is None or r.get("kind") == kind]
    return out


def records_by_rank(workdir: Path, kind: str | None = None) -> dict[int, list[dict]]:
    """:func:`records` grouped by their ``rank`` field."""
    out: dict[int, list[dict]] = {}
    for r in records(workdir, kind):
        out.setdefault(r["rank"], []).append(r)
    return out


def worker_argv(script: str | Path, *args: str, plan: Path, workdir: Path, rank: int | None = None) -> list[str]:
    """The command of one worker process: ``script`` run again with ``--worker``."""
    argv = [sys.executable, str(Path(script).resolve()), "--worker", *args, "--plan", str(plan),
            "--workdir", str(workdir)]
    return argv + (["--rank", str(rank)] if rank is not None else [])


def write_plan(path: Path, plan: Mapping[str, Any]) -> Path:
    """The plan file the workers of a job read (``--plan``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan))
    return path


@contextlib.contextmanager
def workroot(prefix: str, keep: bool = False) -> Iterator[Path]:
    """A fresh directory for the jobs' work directories, removed afterwards unless ``keep``."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield root
    finally:
        if keep:
            print(f"worker files kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


class PeakRss:
    """Peak VmRSS (MB) of every process that wrote a ``pid.<label>`` file in ``workdir``,
    sampled every ``interval_s`` until :meth:`stop`."""

    def __init__(self, workdir: Path, interval_s: float = 0.5) -> None:
        self.workdir, self.peak_mb, self._interval = workdir, {}, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            for f in self.workdir.glob("pid.*"):
                try:
                    pid = int(f.read_text())
                    with open(f"/proc/{pid}/status") as status:
                        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
                except (OSError, ValueError, StopIteration):
                    continue
                label = f.name[4:]
                self.peak_mb[label] = max(self.peak_mb.get(label, 0.0), round(rss / 1024, 1))

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(5)
        return dict(sorted(self.peak_mb.items()))


# --------------------------------------------------------------------------- the worker's side


def file_barrier(workdir: Path, tag: str, rank: int, size: int, timeout_s: float = 300.0) -> None:
    """Independent processes (no communicator) start a phase together: each writes
    ``barrier.<tag>.<rank>`` in ``workdir`` and waits for ``size`` of them."""
    (workdir / f"barrier.{tag}.{rank}").write_text("")
    deadline = time.monotonic() + timeout_s
    while sum(1 for _ in workdir.glob(f"barrier.{tag}.*")) < size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {tag!r}: not every process arrived in {timeout_s:.0f} s")
        time.sleep(0.02)


def run_worker(args: argparse.Namespace, body: Callable[[dict, Path], Any], label: str | None = None,
               watchdog: bool = True) -> int:
    """Run one worker process of a job: ``body(plan, workdir)``.

    Records the pid as ``pid.<label>`` (default: the rank, from mpirun's environment
    where it started the process, else ``--rank``); with ``watchdog``, a rank stuck past
    the plan's ``worker_timeout_s`` dumps every thread's stack and exits. An exception
    is written to ``error.<label>`` with its traceback and gives exit code 3; a
    ``SystemExit`` of 0 is a normal end.
    """
    plan = json.loads(Path(args.plan).read_text())
    workdir = Path(args.workdir)
    if label is None:
        rank = getattr(args, "rank", None)
        label = os.environ.get("OMPI_COMM_WORLD_RANK") or (str(rank) if rank is not None else str(os.getpid()))
    if watchdog:
        faulthandler.dump_traceback_later(plan["worker_timeout_s"], exit=True)
    (workdir / f"pid.{label}").write_text(str(os.getpid()))
    try:
        body(plan, workdir)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            (workdir / f"error.{label}").write_text(f"SystemExit: {exc.code}\n\n{traceback.format_exc()}")
            return 3
    except BaseException as exc:
        (workdir / f"error.{label}").write_text(f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}")
        return 3
    if watchdog:
        faulthandler.cancel_dump_traceback_later()
    return 0
