"""The tasks ``hostreduce run`` starts: N workers, and with ``--ps M`` / ``--evaluator``
the ps and evaluator tasks of a parameter-server job, each with its ``TF_CONFIG``."""
from __future__ import annotations

import json

from ..cluster import format_tf_config

__all__ = ["job_tasks"]


def job_tasks(host: str, num_workers: int, num_ps: int = 0, evaluator: bool = False) -> list[tuple[str, str]]:
    """``(label, TF_CONFIG)`` of every task on free ports of ``host``: workers are
    labelled by rank (worker 0 is the chief), then ``ps0``.., ``evaluator``."""
    from .runner import _format_address, free_ports

    if not isinstance(num_ps, int) or isinstance(num_ps, bool) or num_ps < 0:
        raise ValueError(f"`num_ps` must be an integer >= 0. Received: num_ps={num_ps!r}")
    ports = free_ports(num_workers + num_ps + int(evaluator), host)
    addresses = [_format_address(host, p) for p in ports]
    workers = addresses[:num_workers]
    if not num_ps and not evaluator:
        return [(str(i), format_tf_config(workers, i)) for i in range(num_workers)]
    cluster = {"worker": workers, "ps": addresses[num_workers:num_workers + num_ps]}
    if evaluator:
        cluster["evaluator"] = addresses[-1:]
    tasks = [("worker", i, str(i)) for i in range(num_workers)] + [("ps", m, f"ps{m}") for m in range(num_ps)]
    tasks += [("evaluator", 0, "evaluator")] if evaluator else []
    return [(label, json.dumps({"cluster": {k: v for k, v in cluster.items() if v}, "task": {"type": t, "index": i}}))
            for t, i, label in tasks]
