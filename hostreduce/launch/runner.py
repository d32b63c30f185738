"""Start N local workers of one job, relay their output, and stop them all together.

Each worker gets a ``TF_CONFIG`` describing a cluster of loopback addresses (written by
``hostreduce.cluster``) and a shared ``HOSTREDUCE_SECRET``; the workers of a job without
``ps`` or evaluator tasks also get the variables ``horovodrun`` sets (``HOROVOD_RANK``,
``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``/``SIZE``, ``HOROVOD_CROSS_RANK``/``SIZE``), which
agree with their ``TF_CONFIG``. Every worker runs in its own session, so stopping a
worker stops everything it started. The first worker that fails stops the job.
"""
from __future__ import annotations

import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from typing import BinaryIO, Callable, Mapping, Sequence

from ..cluster import TF_CONFIG, format_tf_config
from ..cluster.mpi_env import HOROVOD_VARIABLES, horovod_env
from ..cluster.tf_config import parse_tf_config
from ..errors import ConfigError
from ..processes import exit_code, free_ports, job_tasks, tf_config
from ._output import error_summary, is_startup_notice

__all__ = [
    "run_workers",
    "free_ports",
    "tf_config",
    "worker_env",
    "exit_code",
    "GRACE_PERIOD_S",
    "TIMEOUT_EXIT_CODE",
    "STOP_SIGNALS",
    "Relay",
    "message",
    "merge_env",
]

GRACE_PERIOD_S = 5.0
TIMEOUT_EXIT_CODE = 124
_SECRET_VAR = "HOSTREDUCE_SECRET"
STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
_CHUNK = 64 * 1024


def worker_env(
    base: Mapping[str, str], addresses: Sequence[str], index: int, secret: str
) -> dict[str, str]:
    """The environment of worker ``index`` of a cluster of ``addresses``: ``base`` plus
    its ``TF_CONFIG``, the secret and the Horovod variables that agree with them.

    A ``HOSTREDUCE_SECRET`` already present in ``base`` is kept.
    """
    return _task_env(base, format_tf_config(addresses, index), base.get(_SECRET_VAR) or secret, horovod=True)


def _task_env(base: Mapping[str, str], tf_config_json: str, secret: str, horovod: bool) -> dict[str, str]:
    """``base`` with a task's ``TF_CONFIG`` and the secret; with ``horovod``, the
    variables ``horovodrun`` would set for it, else none (inherited ones are dropped, so
    that they cannot contradict the ``TF_CONFIG``)."""
    env = {k: v for k, v in base.items() if k not in HOROVOD_VARIABLES}
    env[TF_CONFIG] = tf_config_json
    env[_SECRET_VAR] = secret
    if horovod:
        env.update(horovod_env(parse_tf_config(tf_config_json)))
    return env


def merge_env(env: Mapping[str, str | None] | None) -> dict[str, str]:
    merged = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = str(value)
    return merged


def _binary(stream: object) -> BinaryIO | None:
    buf = getattr(stream, "buffer", None)
    if buf is not None:
        return buf
    return None


class Relay:
    """Copies one worker pipe to a destination stream, prefixing every line.

    With ``quiet``, TensorFlow's known start-up notices are dropped. ``last_error`` is
    the last line that named an exception (a traceback's last line).
    """

    def __init__(self, src: BinaryIO, dest: object, prefix: bytes, lock: threading.Lock,
                 quiet: bool = False) -> None:
        self._src = src
        self._dest = dest
        self._prefix = prefix
        self._lock = lock
        self._quiet = quiet
        self.last_error: str | None = None
        self.thread = threading.Thread(target=self._run, name=f"relay{prefix!r}", daemon=True)

    def _write(self, data: bytes) -> None:
        with self._lock:
            try:
                out = _binary(self._dest)
                if out is not None:
                    out.write(data)
                    out.flush()
                else:
                    self._dest.write(data.decode("utf-8", "replace"))  # type: ignore[attr-defined]
                    self._dest.flush()  # type: ignore[attr-defined]
            except (OSError, ValueError):
                pass  # The destination is gone (closed terminal); keep draining the pipe.

    def _run(self) -> None:
        at_line_start = True
        try:
            while True:
                chunk = self._src.readline(_CHUNK)
                if not chunk:
                    break
                if at_line_start:
                    if self._quiet and is_startup_notice(chunk):
                        at_line_start = chunk.endswith(b"\n")
                        continue
                    self.last_error = error_summary(chunk) or self.last_error
                self._write((self._prefix if at_line_start else b"") + chunk)
                at_line_start = chunk.endswith(b"\n")
            if not at_line_start:
                self._write(b"\n")  # Terminate a partial last line so ranks do not run together.
        except (OSError, ValueError):
            pass
        finally:
            try:
                self._src.close()
            except OSError:
                pass


class _Job:
    """The running workers of one ``run_workers`` call."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.relays: list[Relay] = []
        self.errors: dict[int, Relay] = {}
        self.exits: queue.Queue[tuple[int, int]] = queue.Queue()

    def watch(self, index: int, proc: subprocess.Popen[bytes]) -> None:
        def wait() -> None:
            self.exits.put((index, proc.wait()))

        threading.Thread(target=wait, name=f"watch{index}", daemon=True).start()

    def _signal_groups(self, sig: int) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _groups_alive(self) -> bool:
        """Whether any process of any worker's group is still running (zombies excluded)."""
        groups = {proc.pid for proc in self.procs}
        try:
            entries = os.listdir("/proc")
        except OSError:
            entries = None
        if entries is None:  # No procfs: ask the kernel, counting zombies as alive.
            for pgid in groups:
                try:
                    os.killpg(pgid, 0)
                    return True
                except (ProcessLookupError, PermissionError):
                    continue
            return False
        for entry in entries:
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if len(fields) > 2 and fields[0] != b"Z" and int(fields[2]) in groups:
                return True
        return False

    def stop(self, grace: float, hurry: Callable[[], bool] = lambda: False) -> None:
        """SIGTERM every worker's process group, then SIGKILL what is left.

        SIGKILL follows after ``grace`` seconds, or as soon as ``hurry()`` is true (for
        example after a second Ctrl-C).
        """
        self._signal_groups(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not hurry():
            for proc in self.procs:
                if proc.poll() is None:
                    break
            else:
                if not self._groups_alive():
                    break
            time.sleep(0.02)
        self._signal_groups(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        # Every worker's group is gone, so the pipes reach EOF as soon as they are drained;
        # the bound only matters for a descendant that left its group but kept a pipe.
        deadline = time.monotonic() + 5.0
        for relay in self.relays:
            relay.thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def error_of(self, index: int, wait: float = 2.0) -> str | None:
        """The exception worker ``index`` reported last, once its stderr is drained."""
        relay = self.errors.get(index)
        if relay is None:
            return None
        relay.thread.join(timeout=wait)
        return relay.last_error


def message(text: str) -> None:
    try:
        sys.stderr.write(f"hostreduce run: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def run_workers(
    command: list[str],
    num_workers: int,
    env: Mapping[str, str | None] | None = None,
    timeout: float | None = None,
    prefix: bool = True,
    *,
    host: str = "127.0.0.1",
    grace_period: float = GRACE_PERIOD_S,
    verbose: bool = False,
    num_ps: int = 0,
    evaluator: bool = False,
) -> int:
    """Run ``command`` as ``num_workers`` local workers of one job and wait for them.

    Args:
        command: program and arguments every worker runs.
        num_workers: number of workers, >= 1.
        env: variables added to this process's environment for the workers; a value of
            None removes the variable. A ``HOSTREDUCE_SECRET`` given here or already in
            the environment is used instead of a fresh random secret.
        timeout: optional wall-clock limit in seconds; when it passes every worker is
            stopped and 124 is returned.
        prefix: prefix every output line with ``[rank] ``.
        host: address the workers' cluster addresses use.
        grace_period: seconds between SIGTERM and SIGKILL when stopping workers.
        verbose: keep TensorFlow's start-up notices (no CUDA driver, ``cuInit``, CPU
            instructions, oneDNN) in the relayed output; they are dropped otherwise.
        num_ps, evaluator: also start this many ``ps`` tasks and an ``evaluator`` (a
            parameter-server job, ``hostreduce.processes.job_tasks``), labelled ``[ps0]``, ``[evaluator]``.

    Returns:
        0 when every worker succeeded; otherwise the exit status of the first worker
        that failed (128 + signal number when it was killed by a signal), 124 on
        timeout, or 128 + signal number when this process was interrupted.
    """
    if isinstance(command, (str, bytes)) or not isinstance(command, Sequence) or not command:
        raise ConfigError(f"`command` must be a non-empty list of strings. Received: command={command!r}")
    if not all(isinstance(part, str) for part in command):
        raise ConfigError(f"`command` must be a non-empty list of strings. Received: command={command!r}")
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
        raise ConfigError(f"`num_workers` must be an integer >= 1. Received: num_workers={num_workers!r}")
    if timeout is not None and (
        not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0
    ):
        raise ConfigError(f"`timeout` must be a number > 0 or None. Received: timeout={timeout!r}")
    if not isinstance(grace_period, (int, float)) or grace_period < 0:
        raise ConfigError(f"`grace_period` must be a number >= 0. Received: grace_period={grace_period!r}")

    base = merge_env(env)
    base.setdefault("PYTHONUNBUFFERED", "1")
    secret = base.get(_SECRET_VAR) or secrets.token_hex(32)
    tasks = job_tasks(host, num_workers, num_ps, evaluator)

    job = _Job()
    received: list[int] = []
    previous: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for name in STOP_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is None or signal.getsignal(signum) is signal.SIG_IGN:
                continue  # Keep a signal the user chose to ignore (nohup, background jobs).
            previous[signum] = signal.signal(signum, lambda s, _f: received.append(s))

    out_lock, err_lock = threading.Lock(), threading.Lock()
    pipe = subprocess.PIPE if prefix else None
    code = 0
    final = ""
    try:
        for index, (label, tf_config_json) in enumerate(tasks):
            if received:
                break
            try:
                proc = subprocess.Popen(
                    list(command),
                    env=_task_env(base, tf_config_json, secret, horovod=not num_ps and not evaluator),
                    stdin=subprocess.DEVNULL,
                    stdout=pipe,
                    stderr=pipe,
                    start_new_session=True,
                )
            except OSError as exc:
                message(f"cannot start worker {index}: {command[0]!r}: {exc.strerror or exc}")
                code = 127 if isinstance(exc, FileNotFoundError) else 126
                return code
            job.procs.append(proc)
            if prefix:
                tag = f"[{label}] ".encode()
                for src, dest, lock in ((proc.stdout, sys.stdout, out_lock), (proc.stderr, sys.stderr, err_lock)):
                    relay = Relay(src, dest, tag, lock, quiet=not verbose)  # type: ignore[arg-type]
                    job.relays.append(relay)
                    relay.thread.start()
                job.errors[index] = relay
            job.watch(index, proc)

        deadline = None if timeout is None else time.monotonic() + timeout
        remaining = len(job.procs)
        while remaining and not received:
            wait = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if wait <= 0:
                message(f"timed out after {timeout:g} s; stopping all {len(tasks)} tasks")
                code = TIMEOUT_EXIT_CODE
                return code
            try:
                index, returncode = job.exits.get(timeout=wait)
            except queue.Empty:
                continue
            remaining -= 1
            if returncode != 0:
                code = exit_code(returncode)
                how = (
                    f"was killed by {signal.Signals(-returncode).name}"
                    if returncode < 0 and -returncode in signal.valid_signals()
                    else f"exited with code {returncode}"
                )
                error = job.error_of(index)
                if error:
                    how += f" ({error})"
                # Said once the others are stopped, so that it is the job's last line and
                # not lost among the other workers' tracebacks.
                name = tasks[index][0]
                final = f"{'worker ' if name.isdigit() else ''}{name} {how}" + (
                    "; the other workers were stopped" if remaining else "")
                return code
        if received:
            code = 128 + received[0]
            message(f"received {signal.Signals(received[0]).name}; stopping all workers")
        return code
    finally:
        seen = len(received)
        job.stop(grace_period, hurry=lambda: len(received) > seen)
        if final:
            message(final)
        for signum, handler in previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
