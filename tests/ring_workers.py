"""Rank bodies for the multi-process ring tests (top-level so that spawned ranks can
import them). Each takes (rank, world_size, ...) and returns something picklable."""
from __future__ import annotations

import hashlib
import os
import signal
import time

import numpy as np

from hostreduce.cluster import resolve_cluster
from hostreduce.config import Config
from hostreduce.reducers import create_reducer
from hostreduce.reducers.base import SUPPORTED_DTYPES as ALL_DTYPES
# The engines' wide dtypes, which these checks sweep; the 8- and 16-bit integers and bool are
# covered through the Horovod API (tests/test_horovod_dtypes.py).
SUPPORTED_DTYPES = tuple(d for d in ALL_DTYPES if d.name in ("float16", "float32", "float64", "int32", "int64",
                                                              "bfloat16"))
from tests.marks import mark, wait_for_marks


def make_reducer(transport: str = "auto", **overrides):
    if transport == "shm-copy":  # the shared-segment path, without single-copy reads
        transport, overrides = "shm", {"single_copy": False, **overrides}
    config = Config.from_env(transport=transport, **overrides)
    return create_reducer("ring", cluster=resolve_cluster(), config=config)


def rank_input(rank: int, dtype: np.dtype, n: int, salt: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * salt + rank)
    if dtype.kind in "iu":
        return rng.integers(-10_000, 10_000, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def digest(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def allreduce_everything(rank: int, size: int, transport: str) -> dict:
    """Every dtype and op, sizes around chunk and segment edges, submitted in a
    rank-dependent order; returns results and digests."""
    cases = []
    for d, dtype in enumerate(SUPPORTED_DTYPES):
        for o, op in enumerate(("sum", "mean", "min", "max")):
            for n in (0, 1, 3, 1000, 70_001):
                cases.append((f"{dtype.name}/{op}/{n}", dtype, op, n, d * 100 + o * 10 + n % 7))
    order = list(range(len(cases)))
    if rank % 2:
        order.reverse()
    with make_reducer(transport, chunk_bytes=64 * 1024, fusion_threshold_bytes=256 * 1024) as r:
        handles = {}
        for i in order:
            name, dtype, op, n, salt = cases[i]
            handles[name] = r.allreduce_async(name, rank_input(rank, dtype, n, salt), op)
        out = {name: h.wait(60) for name, h in handles.items()}
        r.barrier()
        shm = getattr(r, "_shm", None)
        return {"transport": r.transport, "single_copy": bool(shm and shm.direct_available()),
                "results": {k: (v.dtype.name, v.tobytes()) for k, v in out.items()},
                "digests": {k: digest(v) for k, v in out.items()}}


def inplace_and_out(rank: int, size: int, transport: str) -> bool:
    with make_reducer(transport) as r:
        x = np.full((3, 5), rank + 1, np.float32)
        same = r.allreduce("inplace", x, out=x)
        assert same is x and np.all(x == size * (size + 1) / 2)
        y = np.empty((3, 5), np.float32)
        r.allreduce("out", np.ones((3, 5), np.float32), op="mean", out=y)
        assert np.all(y == 1.0)
        return True


def broadcast_and_allgather(rank: int, size: int, transport: str) -> dict:
    with make_reducer(transport, chunk_bytes=4096) as r:
        root = size - 1
        b = r.broadcast("b", np.arange(10_000, dtype=np.float64) * (rank + 1), root=root)
        g = r.allgather("g", np.full((rank + 1, 3), rank, np.int32))
        empty = r.allgather("e", np.zeros((0 if rank else 2, 2), np.float32))
        r.barrier()
        return {"b": digest(b), "b_ok": bool(np.all(b == np.arange(10_000) * (root + 1))),
                "g": g.tolist(), "e_shape": empty.shape}


def many_small_tensors(rank: int, size: int, transport: str) -> list[float]:
    """Gradient-like traffic: 200 tensors, several steps, names reused each step."""
    with make_reducer(transport) as r:
        sums = []
        for step in range(3):
            hs = [r.allreduce_async(f"grad/{i}", np.full(37 + i, float(rank + step + i), np.float32), "mean")
                  for i in range(200)]
            sums.append(float(sum(h.wait(60).sum() for h in hs)))
        stats = r.stats()
        assert stats["allreduce_tensors"] == 600, stats
        assert stats["allreduce_buckets"] < 300, f"tensors submitted together were not fused: {stats}"
        return sums


def mismatch(rank: int, size: int, transport: str) -> str:
    with make_reducer(transport) as r:
        shape = (4,) if rank == 0 else (5,)
        try:
            r.allreduce("w", np.zeros(shape, np.float32))
        except Exception as e:  # the test inspects the type and message
            out = f"{type(e).__name__}: {e}"
        else:
            out = "no error"
        # The ring stays usable after a mismatch.
        ok = r.allreduce("after", np.ones(2, np.float32))
        assert np.all(ok == size), ok
        return out


def die_mid_job(rank: int, size: int, transport: str, victim: int) -> str:
    r = make_reducer(transport, timeout_s=10.0)
    r.allreduce("warmup", np.ones(1000, np.float32))
    r.barrier()  # every rank is past the warm-up before the victim dies
    start = time.monotonic()
    try:
        for i in range(1000):
            r.allreduce(f"t{i}", np.ones(100_000, np.float32))
            if rank == victim and i == 2:  # t2 is done: every survivor is in its traffic
                os.kill(os.getpid(), signal.SIGKILL)
        return "no error"
    except Exception as e:
        return f"{type(e).__name__} after {time.monotonic() - start:.1f}s: {e}"
    finally:
        r.close()


def connect_with_secret(rank: int, size: int, secrets: list[str]) -> str:
    os.environ["HOSTREDUCE_SECRET"] = secrets[rank]
    start = time.monotonic()
    try:
        # A rank whose peer refused it and left at once waits for its connect timeout (a
        # stranger claiming a rank must not end a start-up), whose error names the refusal.
        with make_reducer("grpc", connect_timeout_s=4.0) as r:
            r.allreduce("x", np.ones(3, np.float32))
        return "connected"
    except Exception as e:
        return f"{type(e).__name__} after {time.monotonic() - start:.1f}s: {e}"


def config_disagreement(rank: int, size: int, field: str) -> str:
    value = {"chunk_bytes": 65536 * (rank + 1), "fast_lane": rank == 0, "single_copy": rank == 0}[field]
    try:
        make_reducer("grpc" if field == "chunk_bytes" else "shm", connect_timeout_s=10.0, **{field: value}).close()
        return "no error"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def fused_across_blocks(rank: int, size: int, transport: str) -> list[str]:
    """Tensors fused into one bucket whose boundaries fall inside shared-memory blocks."""
    sizes = [70_001, 3, 150_000, 99_999, 1]
    with make_reducer(transport) as r:
        r.barrier()  # all ranks submit the batch while the others are ready, so it fuses
        hs = [r.allreduce_async(f"f{i}", np.arange(n, dtype=np.float64) * (rank + 1) + i, "sum")
              for i, n in enumerate(sizes)]
        outs = [h.wait(60) for h in hs]
        tri = size * (size + 1) / 2
        for i, (n, o) in enumerate(zip(sizes, outs)):
            np.testing.assert_array_equal(o, np.arange(n, dtype=np.float64) * tri + i * size)
        return [digest(o) for o in outs]


def intruders_are_refused(rank: int, size: int) -> dict:
    """A process without the secret is refused; nothing listens beyond the spec's address."""
    import socket

    import grpc

    with make_reducer("grpc") as r:
        peer = r._cluster.addresses[(rank + 1) % size]
        host, port = peer.rsplit(":", 1)
        channel = grpc.insecure_channel(peer)
        stream = channel.stream_unary("/hostreduce.Peer/Stream")
        frames = iter([b"\x01" + bytes(8) + b"forged data"])
        try:
            stream(frames, metadata=(("hr-rank", str(rank)), ("hr-nonce", "00"), ("hr-proof", "forged")), timeout=10)
            refused = "accepted"
        except grpc.RpcError as e:
            refused = e.code().name
        channel.close()
        other_loopback = None
        try:
            socket.create_connection(("127.0.0.2", int(port)), timeout=5).close()
            other_loopback = "connected"
        except OSError as e:
            other_loopback = type(e).__name__
        ok = r.allreduce("still-works", np.ones(4, np.float32))
        r.barrier()
        return {"refused": refused, "other_loopback": other_loopback, "ok": bool(np.all(ok == size))}


def one_rank_closes_early(rank: int, size: int, leaver: int, marks: str, transport: str = "auto") -> str:
    """A rank that closes its reducer makes the others' next collective fail fast."""
    r = make_reducer(transport, timeout_s=20.0)
    r.allreduce("together", np.ones(8, np.float32))
    r.barrier()
    if rank == leaver:
        r.close()
        mark(marks, "closed")
        return "left"
    wait_for_marks(marks, ["closed"])
    start = time.monotonic()
    try:
        r.allreduce("alone", np.ones(100_000, np.float32))
        return "no error"
    except Exception as e:
        return f"{type(e).__name__} after {time.monotonic() - start:.1f}s: {e}"
    finally:
        r.close()


def lane_mixed(rank: int, size: int, transport: str, fast_lane: bool) -> dict:
    """Blocking all-reduces (the one-host fast lane) interleaved with collectives that
    go through rank 0: async ones submitted in rank-dependent orders, steps where one
    rank submits async what the others submit blocking, broadcasts and barriers."""
    with make_reducer(transport, fast_lane=fast_lane) as r:
        results = []
        for step in range(40):
            x = np.arange(1000, dtype=np.int64) * (rank + 1) + step
            if step % 5 == 1:
                names = [f"a{step}/{i}" for i in range(4)]
                if rank % 2:
                    names.reverse()
                hs = {n: r.allreduce_async(n, x + int(n[-1]), "sum") for n in names}
                results.append([int(hs[n].wait(60).sum()) for n in sorted(hs)])
            elif step % 5 == 2 and rank == size - 1:
                results.append(int(r.allreduce_async(f"b{step}", x, "max").wait(60).sum()))
            elif step % 5 == 2:
                results.append(int(r.allreduce(f"b{step}", x, "max").sum()))
            elif step % 5 == 3:
                results.append(int(r.broadcast(f"c{step}", x, root=step % size).sum()))
            elif step == 24:
                r.barrier()
            else:
                out = np.empty_like(x)
                got = r.allreduce(f"d{step}", x, "sum", out=out)
                assert got is out
                results.append(int(out.sum()))
        return {"results": results, "fast": r.stats().get("fast_lane", 0)}


def lane_stall_then_recover(rank: int, size: int, marks: str) -> list[str]:
    """Rank 0 submits a blocking all-reduce that rank 1 never submits: rank 0 gets a
    timeout naming rank 1, and the next collectives still run on both ranks."""
    with make_reducer("shm", timeout_s=2.0) as r:
        r.allreduce("warm", np.ones(4, np.float32))
        out = []
        if rank == 0:
            start = time.monotonic()
            try:
                r.allreduce("only-rank-0", np.ones(4, np.float32))
                out.append("no error")
            except Exception as e:  # the test inspects the type and message
                out.append(f"{type(e).__name__} after {time.monotonic() - start:.1f}s: {e}")
            mark(marks, "timed-out")
        else:  # in no collective meanwhile: the late rank, not a blocked one
            wait_for_marks(marks, ["timed-out"])
        for i in range(3):
            out.append(str(r.allreduce(f"after{i}", np.full(4, rank + 1.0, np.float32))[0]))
        return out


def lane_after_async_bursts(rank: int, size: int) -> dict:
    """A training-like loop: a burst of async all-reduces, then a blocking one, each step.
    Ranks drift in time (rank-dependent sleeps). Returns the lane count and the slowest
    step, so the test can check that blocking calls take the lane and nothing stalls."""
    with make_reducer("shm") as r:
        worst, total = 0.0, 0.0
        for step in range(30):
            time.sleep(0.002 * ((rank + step) % 3))  # the drift (simulated work), not an ordering
            start = time.monotonic()
            hs = [r.allreduce_async(f"g{i}", np.full(100, float(rank), np.float32)) for i in range(3)]
            for h in hs:
                h.wait(30)
            loss = r.allreduce("loss", np.full(4, rank + 1.0, np.float32))
            assert float(loss[0]) == size * (size + 1) / 2
            took = time.monotonic() - start
            worst, total = max(worst, took), total + took
        return {"fast": r.stats().get("fast_lane", 0), "worst_s": worst, "total_s": total}


def _fix_token(token: str) -> None:
    """Rank 0 names the job's shared-memory entries with ``token`` (so that a test can
    find exactly this job's entries among those of other jobs on the host)."""
    import types

    from hostreduce.reducers.ring import negotiation

    negotiation.secrets = types.SimpleNamespace(token_hex=lambda n: token)


def killed_while_growing(rank: int, size: int, victim: int, delay: float, token: str) -> str:
    """All-reduces and all-gathers of growing sizes (shared segments grow) until the
    victim SIGKILLs itself ``delay`` s after it starts, in start-up or in the loop."""
    import threading

    if rank == victim:
        killer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL))
        killer.daemon = True
        killer.start()
    if rank == 0:
        _fix_token(token)
    try:
        with make_reducer("shm", timeout_s=3.0, connect_timeout_s=3.0) as r:
            for i in range(10_000):
                n = 1 << (8 + i % 15)
                r.allreduce(f"a{i}", np.ones(n, np.float32))
                r.allgather(f"g{i}", np.ones(n, np.float32))
        return "no error"
    except Exception as e:  # the test inspects the type and message
        return f"{type(e).__name__}: {e}"


def short_shm_job(rank: int, size: int, token: str) -> bool:
    if rank == 0:
        _fix_token(token)
    with make_reducer("shm") as r:
        return bool(np.all(r.allreduce("x", np.ones(4, np.float32)) == size))


def different_names(rank: int, size: int, transport: str, marks: str) -> dict:
    """First a collective that rank 1 submits late while the others wait for it (not an
    error: rank 1 is not waiting meanwhile); then blocking all-reduces under a different
    name on every rank, which must fail at once on every rank; then the ring still works."""
    with make_reducer(transport, timeout_s=20.0) as r:
        r.allreduce("warm", np.ones(4, np.float32))
        r.barrier()
        if rank == 1:
            later = r.allreduce_async("later", np.ones(4, np.float32))
            wait_for_marks(marks, [f"waiting{q}" for q in range(size) if q != 1])
            # Rank 1 works elsewhere for a while, the others waiting in "first": the
            # behaviour under test, far shorter than timeout_s.
            time.sleep(1.5)
            mark(marks, "rank1-ready")
            first = r.allreduce("first", np.ones(4, np.float32))
            later.wait(30)
        else:
            mark(marks, f"waiting{rank}")
            first = r.allreduce("first", np.ones(4, np.float32))
            r.allreduce("later", np.ones(4, np.float32))
        waited = os.path.exists(os.path.join(marks, "rank1-ready"))  # "first" ended only once rank 1 came
        r.barrier()
        start = time.monotonic()
        try:
            r.allreduce(f"n{rank}", np.ones(4, np.float32))
            err = "no error"
        except Exception as e:  # the test inspects the type and message
            err = f"{type(e).__name__}: {e}"
        took = time.monotonic() - start
        after = r.allreduce("after", np.full(4, rank + 1.0, np.float32))
        return {"first": float(first[0]), "waited": waited, "error": err, "took": took,
                "is_timeout": "CollectiveTimeoutError" in err or "UnmatchedCollectiveError" in err,
                "after": float(after[0])}


def freeze_mid_job(rank: int, size: int, transport: str, victim: int, timeout_s: float, marks: str) -> str:
    """The victim stops itself (SIGSTOP) while every rank runs all-reduces; each survivor
    reports its error and how long after the freeze it came, and the last one to do so
    kills the victim."""
    with make_reducer(transport, timeout_s=timeout_s) as r:
        pids = [int(p) for p in r.allgather("pids", np.array([os.getpid()], np.int64))]
        r.barrier()
        try:
            for i in range(100_000):
                r.allreduce(f"t{i}", np.ones(10_000 if i % 2 else 100, np.float32))
                if rank == victim and i == 3:  # t3 is done: every survivor is in the loop
                    frozen_at = time.time()
                    with open(os.path.join(marks, "frozen"), "w") as f:
                        f.write(repr(frozen_at))
                    os.kill(os.getpid(), signal.SIGSTOP)  # stopped here until killed
                    return "resumed"
            out = "no error"
        except Exception as e:  # the test inspects the type and message
            with open(os.path.join(marks, "frozen")) as f:
                frozen_at = float(f.read())
            out = f"{type(e).__name__} after {time.time() - frozen_at:.1f}s: {e}"
        with open(os.path.join(marks, f"done{rank}"), "w"):
            pass
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len([n for n in os.listdir(marks) if n.startswith("done")]) < size - 1:
            time.sleep(0.05)
        try:
            os.kill(pids[victim], signal.SIGKILL)
        except ProcessLookupError:
            pass
        return out
