"""Rank bodies for the ring's process-group and new-collective tests
(``test_ring_collectives.py``); top-level so that spawned ranks can import them."""
from __future__ import annotations

import os
import signal
import time

import numpy as np

from tests import collectives_check
from tests.marks import mark, wait_for_marks
from tests.ring_workers import make_reducer


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # the test inspects the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def check_everything(rank: int, size: int, transport: str) -> str:
    """The engine-agnostic check of every collective on the world and on groups."""
    with make_reducer(transport, chunk_bytes=4096) as r:
        digests = collectives_check.check_all(r, reorder=True)
        collectives_check.agree(r, digests)
        return r.transport


def group_mismatch(rank: int, size: int, transport: str, marks: str) -> dict:
    """Ranks 0-1 submit "x" on group [0, 1, 2], ranks 2-3 on [1, 2, 3] (ranks 0 and 3
    late, after ranks 1 and 2 found the clash); then the job goes on."""
    with make_reducer(transport) as r:
        g = r.create_group([0, 1, 2] if rank < 2 else [1, 2, 3])
        if rank in (0, 3):
            wait_for_marks(marks, ["clash1", "clash2"])
        error = _error(lambda: r.allreduce("x", np.ones(3, np.float32), group=g))
        if rank in (1, 2):
            mark(marks, f"clash{rank}")
        out = {"error": error, "after": float(r.allreduce("after", np.ones(2, np.float32))[0])}
        r.barrier()
        return out


def p2p_mismatch(rank: int, size: int, transport: str) -> dict:
    """Rank 0 sends a (3,) float32 array; rank 1 expects (4,) float32, then (2,) int32
    that arrives as (2,) float64."""
    with make_reducer(transport) as r:
        if rank == 0:
            a = _error(lambda: r.send("p", np.zeros(3, np.float32), dst=1))
            b = _error(lambda: r.send("q", np.zeros(2, np.float64), dst=1))
        elif rank == 1:
            a = _error(lambda: r.recv("p", 0, (4,), np.float32))
            b = _error(lambda: r.recv("q", 0, (2,), np.int32))
        else:
            a = b = "not involved"
        ok = r.allreduce("after", np.ones(2, np.float32))
        return {"shape": a, "dtype": b, "after": float(ok[0])}


def die_in_new_collectives(rank: int, size: int, transport: str, victim: int) -> str:
    """The victim dies while every rank loops over reduce-scatter, reduce, all-to-all
    and send/receive; the survivors fail with PeerLostError naming it."""
    r = make_reducer(transport, timeout_s=10.0)
    r.allreduce("warmup", np.ones(1000, np.float32))
    r.barrier()
    start = time.monotonic()
    x = np.ones((size * 5000, 4), np.float32)
    try:
        for i in range(1000):
            r.reduce_scatter(f"rs{i}", x)
            r.reduce(f"r{i}", x, root=i % size)
            r.alltoall(f"a{i}", x)
            if rank == victim:  # its all-to-all is done: every survivor is in the loop
                os.kill(os.getpid(), signal.SIGKILL)
            hs = [r.send_async(f"p{i}", x, dst=(rank + 1) % size),
                  r.recv_async(f"p{i}/in", (rank - 1) % size, x.shape, x.dtype)]
            for h in hs:
                h.wait()
        return "no error"
    except Exception as e:
        return f"{type(e).__name__} after {time.monotonic() - start:.1f}s: {e}"
    finally:
        r.close()


def prod_on_every_path(rank: int, size: int, transport: str) -> dict:
    """prod through the blocking all-reduce (the fast lane on one host), a small
    all-reduce (reduced by rank 0 over gRPC), a large one, reduce-scatter and reduce."""
    with make_reducer(transport) as r:
        small, large = np.full(7, rank + 2, np.int64), np.full(100_000, 1.0 + rank / 8, np.float64)
        got = [r.allreduce(f"lane{i}", small, "prod") for i in range(5)]
        got.append(r.allreduce_async("small", small, "prod").wait())
        big = r.allreduce_async("large", large, "prod").wait()
        rs = r.reduce_scatter("rs", large, "prod")
        red = r.reduce("red", small, root=size - 1, op="prod")
        expect = float(np.prod([1.0 + q / 8 for q in range(size)]))
        return {"ints": [int(g[0]) for g in got] + ([int(red[0])] if red is not None else []),
                "floats": [float(big[0]), float(rs[0])], "expect": expect, "stats": r.stats()}


def group_waits(rank: int, size: int, transport: str, case: str, marks: str) -> str:
    """``stall``: only rank 0 submits on group [0, 1]; ``unmatched``: groups [0, 1] and
    [2, 3] each submit a different name per rank. Neither may hang."""
    with make_reducer(transport, timeout_s=2.0) as r:
        g = r.create_group([0, 1] if rank < 2 else [2, 3])
        start = time.monotonic()
        if case == "stall":
            if rank == 0:
                err = _error(lambda: r.allreduce("lonely", np.ones(3, np.float32), group=g))
                mark(marks, "lonely-ended")
            else:  # not waiting on anything meanwhile (then all would be blocked: unmatched)
                wait_for_marks(marks, ["lonely-ended"])
                err = "idle"
        else:
            err = _error(lambda: r.allreduce(f"n{rank}", np.ones(3, np.float32), group=g))
        took = time.monotonic() - start
        r.barrier()
        return f"{took:.1f} s: {err}"
