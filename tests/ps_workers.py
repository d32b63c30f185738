"""Process bodies of tests/test_ps_cluster.py: ranks 0..M-1 are ps tasks, the rest workers."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np

from hostreduce.errors import PeerLostError
from hostreduce.ps.client import PSClient
from hostreduce.ps.server import ParameterServer
from tests.marks import mark, wait_for_marks
from tests.ps_helpers import model_values, worker_grads


def sync_training(rank, world, addrs, num_ps, secret, config, steps, marks):
    num_workers = world - num_ps
    if rank < num_ps:
        ParameterServer(rank, addrs, num_workers, secret, timeout_s=10.0).serve()
        return "served"
    w = rank - num_ps
    c = PSClient(addrs, w, num_workers, secret, timeout_s=10.0, connect_timeout_s=30.0)
    if w == 0:
        c.register(model_values(), config, shard_bytes=20_000)
    else:
        c.wait_ready(30.0)
    for step in range(1, steps + 1):
        dense, rows = worker_grads(w, step)
        c.pull_rows({"emb": rows["emb"][0]})
        c.push(dense, rows, step=step)
    out = c.pull()
    # every worker has its final values; the chief ends the job once the others are done
    if w == 0:
        wait_for_marks(marks, [f"pulled{q}" for q in range(1, num_workers)])
        c.shutdown()
    else:
        mark(marks, f"pulled{w}")
    return {n: v.tobytes() for n, v in out.items()}


def _kill_self_once(marks, names):
    wait_for_marks(marks, names)
    os.kill(os.getpid(), signal.SIGKILL)


def killed_ps(rank, world, addrs, num_ps, secret, timeout_s, marks):
    num_workers = world - num_ps
    if rank < num_ps:
        server = ParameterServer(rank, addrs, num_workers, secret, mode="async", timeout_s=timeout_s)
        if rank == 1:  # killed in the middle of training: once every worker has pushed and pulled
            threading.Thread(target=_kill_self_once, args=(marks, [f"trained{q}" for q in range(num_workers)]),
                             daemon=True).start()
        server.serve()
        return "served"
    w = rank - num_ps
    c = PSClient(addrs, w, num_workers, secret, timeout_s=timeout_s, connect_timeout_s=30.0)
    if w == 0:
        c.register(model_values(), {"name": "sgd", "learning_rate": 0.1}, shard_bytes=20_000)
    else:
        c.wait_ready(30.0)
    last_ok, trained = time.monotonic(), False
    try:
        while True:
            c.push(*worker_grads(w, 1))
            c.pull()
            if not trained:
                mark(marks, f"trained{w}")
                trained = True
            last_ok = time.monotonic()
    except PeerLostError as e:
        out = {"error": str(e), "after_s": time.monotonic() - last_ok}
    mark(marks, f"lost{w}")
    if w == 0:
        wait_for_marks(marks, [f"lost{q}" for q in range(1, num_workers)])  # the others meet the lost ps too
        out["shutdown_lost"] = c.shutdown()
    return out
