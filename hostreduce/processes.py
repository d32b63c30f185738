"""Local processes of a job: free ports, the ``TF_CONFIG`` of every task of a job on one
host, and how a process's end reads as an exit status. The launcher (``hostreduce run``),
the test harness (``hostreduce.testing``), the tests' script jobs and the benchmarks
start their processes on these."""
from __future__ import annotations

import os
import socket
from typing import Sequence

from .cluster import format_tf_config
from .errors import ConfigError

__all__ = ["free_ports", "format_address", "tf_config", "job_tasks", "exit_code", "alive"]


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
    """Whether process ``pid`` exists (also when it belongs to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
