"""One rank of an MPI-launched check of the full collective set of an MPI-based reducer.

Usage: mpirun -np N python collectives_worker.py {mpi|horovod} [timeouts]   (N >= 2)
(``timeouts``: only the checks that provoke a timeout, which the perf tests time.)
(``reducer_check.py`` also runs these checks, on its reducer, within its own launch.)

Runs the engine-agnostic ``tests/collectives_check.py`` (when present), then what it
does not cover: prod of 16-bit floats, wire compression (the result equals the float32
result rounded through 16 bits, bitwise the same on every rank), two disjoint groups at
once and a group of non-consecutive ranks using every new collective, sends in both
directions at once, a send/receive shape mismatch (raised on both ends), a
reduce-scatter whose peer does not come within the timeout and (mpi, N >= 3) a group
whose member never calls create_group (both a clear ``CollectiveTimeoutError`` within
seconds, not a hang). Prints ``OK rank R/N``, and ``TIMING <check> rank R: <s> s``
for each timeout it provoked. Needs the repository root on ``PYTHONPATH``.
"""
from __future__ import annotations

import hashlib
import sys
import time

import numpy as np

from hostreduce.config import Config
from hostreduce.errors import CollectiveTimeoutError, TensorMismatchError
from hostreduce.reducers.base import Reducer
from tests.marks import mark, wait_for_marks
from tests.mpi_workers.reducer_check import check_timeout, make, marks_dir, remove_marks_dir, timing

F32 = np.dtype(np.float32)


def data(world_rank: int, shape: tuple[int, ...], salt: str, dtype: np.dtype = F32) -> np.ndarray:
    rng = np.random.default_rng([world_rank, int(hashlib.sha256(salt.encode()).hexdigest()[:8], 16)])
    return rng.uniform(0.5, 1.5, size=shape).astype(dtype)


def close(what: str, got: np.ndarray, want: np.ndarray, rtol: float) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=0, err_msg=what)


def check_group(r: Reducer, g, tag: str, digest: "hashlib._Hash") -> None:
    """Every new collective on ``g`` (names shared with a disjoint group running at once)."""
    me, n, ranks = g.rank, g.size, g.ranks
    rows = 2 * n + 1
    counts = [0] * (n - 1) + [rows] if n > 1 else [rows]
    ins = [data(w, (rows, 3), "rs") for w in ranks]
    for op, fn in (("sum", np.sum), ("max", np.max), ("prod", np.prod), ("mean", np.mean)):
        got = r.reduce_scatter(f"{tag}.rs.{op}", ins[me], op, counts=counts, group=g)
        lo = sum(counts[:me])
        close(f"{tag} rs {op}", got, fn(np.stack(ins), 0)[lo:lo + counts[me]], 1e-5)
        got = r.reduce_scatter(f"{tag}.rs.even.{op}", ins[me], op, group=g)
        even = [rows // n + (1 if i < rows % n else 0) for i in range(n)]
        lo = sum(even[:me])
        close(f"{tag} rs even {op}", got, fn(np.stack(ins), 0)[lo:lo + even[me]], 1e-5)
    ints = [np.arange(6, dtype=np.int64) * (w + 1) - 7 for w in ranks]
    got = r.reduce(f"{tag}.reduce", ints[me], root=n - 1, op="mean", group=g)
    if me == n - 1:
        np.testing.assert_array_equal(got, np.floor_divide(np.sum(ints, 0), n))
    else:
        assert got is None, got
    splits = [[(i + j) % 2 + 1 for j in range(n)] for i in range(n)]
    a2a = [data(w, (sum(splits[i]), 2), "a2a", np.dtype(np.float16)) for i, w in enumerate(ranks)]
    out, received = r.alltoall(f"{tag}.a2a", a2a[me], splits[me], group=g)
    assert received.dtype == np.int32 and list(received) == [splits[i][me] for i in range(n)], received
    want = np.concatenate([a2a[i][sum(splits[i][:me]):sum(splits[i][:me + 1])] for i in range(n)])
    assert out.dtype == np.float16 and out.tobytes() == want.tobytes(), f"{tag} alltoall"
    bc = r.broadcast(f"{tag}.bc", data(ranks[me], (4,), "bc"), root=n - 1, group=g)
    assert bc.tobytes() == data(ranks[-1], (4,), "bc").tobytes()
    ar = r.allreduce(f"{tag}.ar", data(ranks[me], (9,), "ar"), "sum", group=g)
    digest.update(ar.tobytes())
    if n > 1:  # every member sends to every other at once, then receives
        sends = [r.send_async(f"{tag}.p2p.{me}.{j}", np.full((j + 1, 2), ranks[me], np.int32), j, group=g)
                 for j in range(n) if j != me]
        for j in range(n):
            if j != me:
                got = r.recv(f"{tag}.p2p.{j}.{me}", j, (me + 1, 2), np.int32, group=g)
                assert (got == ranks[j]).all() and got.shape == (me + 1, 2), got
        for h in sends:
            h.wait(30)
    r.barrier(group=g)


def check_compression(r: Reducer, digest: "hashlib._Hash") -> None:
    import ml_dtypes

    size, rank = r.size, r.rank
    ins = [data(q, (5000,), "wire") for q in range(size)]
    for wire, dtype, rtol in (("fp16", np.float16, 2e-3), ("bf16", ml_dtypes.bfloat16, 1.6e-2)):
        for op in ("sum", "mean", "max", "prod"):
            got = r.allreduce(f"wire.{wire}.{op}", ins[rank], op, compression=wire)
            ref = r.allreduce(f"wire32.{wire}.{op}", ins[rank].astype(dtype).astype(np.float32), op)
            assert got.dtype == np.float32
            close(f"compressed {wire} {op}", got, ref.astype(dtype).astype(np.float32), rtol * size)
            digest.update(got.tobytes())
        # 16-bit data reduced in 16 bits: prod and min of native 16-bit arrays.
        x = [a.astype(dtype) for a in ins]
        got = r.allreduce(f"native.{wire}.prod", x[rank], "prod")
        assert got.dtype == dtype
        close(f"{wire} prod", got, np.prod(np.stack(x).astype(np.float64), 0), rtol * size)
        got = r.allreduce(f"native.{wire}.min", x[rank], "min")
        assert got.tobytes() == np.min(np.stack(x).astype(np.float32), 0).astype(dtype).tobytes()
        digest.update(got.tobytes())
        rs = r.reduce_scatter(f"rs.{wire}", ins[rank][:4 * size].reshape(size * 2, 2), "sum", compression=wire)
        assert rs.dtype == np.float32 and rs.shape == (2, 2)


def check_mismatch(r: Reducer) -> None:
    """A receive that expects another shape: both ends raise, and the reducer stays usable."""
    if r.rank == 0:
        h = r.send_async("bad.p2p", np.zeros((3, 4), np.float32), 1)
        try:
            h.wait(30)
        except TensorMismatchError as exc:
            assert "(4, 3)" in str(exc) and "(3, 4)" in str(exc), exc
        else:
            raise AssertionError("send with a mismatched receive did not raise")
    elif r.rank == 1:
        try:
            r.recv("bad.p2p", 0, (4, 3), np.float32)
        except TensorMismatchError:
            pass
        else:
            raise AssertionError("receive with a mismatched send did not raise")
    got = r.allreduce("after.mismatch", np.ones(2, np.float32))
    assert (got == r.size).all()


def check_dead_peer(engine: str, rank: int, size: int, marks: str) -> None:
    """The last rank does not come: the others' reduce-scatter ends with
    CollectiveTimeoutError (of timeout_s), the collective queued behind it as unusable
    (never issued). The late rank comes after that: on an engine that agrees on each
    collective first (mpi) it matches that exchange, then waits alone and times out as
    well; on one without (horovod) it matches the reduce-scatter. Either way the job
    then ends cleanly."""
    t = make(engine, timeout_s=0.5)
    if rank != size - 1:
        start = time.monotonic()
        handles = [t.reduce_scatter_async("dead.rs", np.ones((size, 2), np.float32)),
                   t.allreduce_async("dead.after", np.ones(2, np.float32))]
        for h in handles:
            try:
                h.wait(30)
            except CollectiveTimeoutError as exc:
                assert "timeout_s=0.5" in str(exc), exc
            except Exception as exc:  # noqa: BLE001 - unusable after the first timeout
                assert "unusable" in str(exc) or "timeout" in str(exc), exc
            else:
                raise AssertionError("collective with an absent peer did not time out")
        timing("dead_peer", rank, time.monotonic() - start)
        mark(marks, f"dead-peer-timed-out{rank}")
    else:
        wait_for_marks(marks, [f"dead-peer-timed-out{q}" for q in range(size - 1)])
        try:
            t.reduce_scatter("dead.rs", np.ones((size, 2), np.float32))
        except CollectiveTimeoutError as exc:
            assert engine == "mpi" and "timeout_s=0.5" in str(exc), exc
    t.close()


def check_absent_member(engine: str, rank: int, size: int) -> None:
    """A member that never calls create_group (mpi: only members call): the other's
    create_group ends with CollectiveTimeoutError (of timeout_s) instead of blocking in
    MPI_Comm_create_group."""
    t = make(engine, timeout_s=0.5)
    if rank == 0:
        start = time.monotonic()
        try:
            t.create_group([0, size - 1])
        except CollectiveTimeoutError as exc:
            assert "create_group" in str(exc) and "timeout_s=0.5" in str(exc), exc
        else:
            raise AssertionError("create_group with an absent member did not time out")
        timing("absent_member", rank, time.monotonic() - start)
    t.close()


def run_timeouts(r: Reducer, engine: str, marks: str) -> None:
    """The checks that provoke a timeout (the end of :func:`run_all`, and of reducer_check)."""
    check_dead_peer(engine, r.rank, r.size, marks)
    if engine == "mpi" and r.size >= 3:  # at 2 ranks [0, 1] is the world, made without MPI
        check_absent_member(engine, r.rank, r.size)
    check_timeout(engine, r.rank, marks)


def run_all(r: Reducer, engine: str, marks: str) -> None:
    """Every check on ``r`` (of ``engine``; at least two ranks; ``marks``: see
    ``reducer_check.marks_dir``); leaves ``r`` open."""
    rank, size = r.rank, r.size
    try:
        from tests import collectives_check
    except ImportError:
        collectives_check = None
    if collectives_check is not None:
        collectives_check.agree(r, collectives_check.check_all(r))
    t0 = time.monotonic()
    digest = hashlib.sha256()
    check_group(r, r.world, "world", digest)
    t1 = time.monotonic()
    check_compression(r, digest)
    t2 = time.monotonic()
    groups = [[0, size - 1]] + ([[0, 1], [2, 3]] if size >= 4 else [])
    if size >= 4:
        groups.append([1, 3])
    for ranks in groups:  # Horovod: every rank creates every group
        r.create_group(ranks)
    mine = [r.create_group(g) for g in ([[0, 1], [2, 3]] if size >= 4 else [[0, size - 1]])]
    for g in mine:  # two disjoint groups at once, with the same names
        if g.is_member:
            check_group(r, g, "pair", hashlib.sha256())
    r.barrier()
    g = r.create_group([1, 3] if size >= 4 else [0, size - 1])  # non-consecutive
    if g.is_member:
        check_group(r, g, "gap", hashlib.sha256())
    r.barrier()
    for ranks in groups:
        if len(ranks) < size:
            r.destroy_group(r.create_group(ranks))
    check_mismatch(r)
    rows = r.allgather("digest", np.frombuffer(digest.digest(), np.int64).reshape(1, -1))
    assert (rows == rows[0]).all(), "results differ across ranks"
    r.barrier()
    check_dead_peer(engine, rank, size, marks)
    if engine == "mpi" and size >= 3:  # at 2 ranks [0, 1] is the world, made without MPI
        check_absent_member(engine, rank, size)
    print(f"rank {rank}/{size}: collectives checked (world {t1 - t0:.1f} s, compression {t2 - t1:.1f} s, "
          f"total {time.monotonic() - t0:.1f} s)", flush=True)


def main() -> None:
    engine = sys.argv[1]
    r = make(engine, timeout_s=60.0)
    marks = marks_dir(r)
    if sys.argv[2:] == ["timeouts"]:
        run_timeouts(r, engine, marks)
    else:
        run_all(r, engine, marks)
    remove_marks_dir(r, marks)
    r.close()
    print(f"OK rank {r.rank}/{r.size}", flush=True)


if __name__ == "__main__":
    main()
