"""Local processes of a job: free ports, the ``TF_CONFIG`` of every task of a job on one
host, how a process's end reads as an exit status, and stopping a job's process groups.
The launcher (``hostreduce run``), the test harness (``hostreduce.testing``), the tests'
script jobs and the benchmarks start and stop their processes with these."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from typing import Iterable, Sequence

from .cluster import format_tf_config
from .errors import ConfigError

__all__ = ["free_ports", "format_address", "tf_config", "job_tasks", "exit_code", "alive", "stop_groups"]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Return ``count`` distinct TCP ports on ``host`` that were free a moment ago.

    All sockets stay bound until every port is chosen, so the ports are distinct; they
    are closed just before returning, which keeps the window for another process to
    take one as short as possible.
    """
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ConfigError(f"`count` must be an integer >= 1. Received: count={count!r}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            try:
                sock.bind((host, 0))
            except OSError as exc:
                raise ConfigError(f"`host` must be a local address to bind to. Received: host={host!r} ({exc})") from None
        return [s.getsockname()[1] for s in socks]
    finally:
        for sock in socks:
            sock.close()


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def tf_config(addresses: Sequence[str], index: int) -> str:
    """The ``TF_CONFIG`` JSON for worker ``index`` of a cluster of ``addresses``."""
    return format_tf_config(addresses, index)


def job_tasks(host: str, num_workers: int, num_ps: int = 0, evaluator: bool = False) -> list[tuple[str, str]]:
    """``(label, TF_CONFIG)`` of every task on free ports of ``host``: workers are
    labelled by rank (worker 0 is the chief), then ``ps0``.., ``evaluator``."""
    if not isinstance(num_ps, int) or isinstance(num_ps, bool) or num_ps < 0:
        raise ConfigError(f"`num_ps` must be an integer >= 0. Received: num_ps={num_ps!r}")
    ports = free_ports(num_workers + num_ps + int(evaluator), host)
    addresses = [format_address(host, p) for p in ports]
    workers = addresses[:num_workers]
    if not num_ps and not evaluator:
        return [(str(i), format_tf_config(workers, i)) for i in range(num_workers)]
    cluster = {"worker": workers, "ps": addresses[num_workers:num_workers + num_ps],
               "evaluator": addresses[-1:] if evaluator else []}
    tasks = [("worker", i, str(i)) for i in range(num_workers)] + [("ps", m, f"ps{m}") for m in range(num_ps)]
    tasks += [("evaluator", 0, "evaluator")] if evaluator else []
    return [(label, format_tf_config(cluster, i, t)) for t, i, label in tasks]


def exit_code(returncode: int) -> int:
    """A shell-style exit status: negative return codes (signals) become 128 + signal."""
    return 128 - returncode if returncode < 0 else returncode


def alive(pid: int) -> bool:
    """Whether process ``pid`` is running (also when it belongs to another user); a
    zombie, dead but not yet reaped, is not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return True


def stop_groups(procs: Iterable[subprocess.Popen], pids: Iterable[int] = (), grace_s: float = 3.0) -> None:
    """Stop every process of a job: SIGTERM to the process group of each of ``procs``
    (started with ``start_new_session=True``) and to ``pids`` (processes that may live in
    other groups), then SIGKILL to what is still alive after ``grace_s``; reaps ``procs``."""
    procs, pids = list(procs), set(pids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (any(p.poll() is None for p in procs) or any(map(alive, pids))):
            time.sleep(0.05)
        if all(p.poll() is not None for p in procs) and not any(map(alive, pids)):
            break
    for p in procs:
        try:
            p.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
