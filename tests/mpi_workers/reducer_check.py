"""One rank of an MPI-launched check of an MPI-based reducer.

Usage: mpirun -np N python reducer_check.py {mpi|horovod}

Checks all-reduce (every dtype and op, ``out=``, in place, non-contiguous input, async
handles waited out of order) against numpy, broadcast, all-gather with a different first
dimension per rank, barrier, and that every result is bitwise identical on every rank.
With several ranks it checks the collective timeout, for ``mpi`` all-gather mismatch
detection, and runs ``collectives_worker.run_all`` (the rest of the collective set, on
groups too) in the same launch.
Prints ``OK rank R/N`` and exits 0 on success; raises (non-zero exit) otherwise. Prints
``TIMING <check> rank R: <s> s`` for each timeout it provokes, for the perf tests.
Needs the repository root on ``PYTHONPATH`` (``mpi_launch.run_mpi`` gives it).
"""
from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
import time

import numpy as np

from hostreduce.config import Config
from hostreduce.errors import CollectiveTimeoutError, HostReduceError, TensorMismatchError
from hostreduce.reducers.base import SUPPORTED_DTYPES as ALL_DTYPES, Reducer
# The engines' wide dtypes, which these checks sweep; the 8- and 16-bit integers and bool are
# covered through the Horovod API (tests/test_horovod_dtypes.py).
SUPPORTED_DTYPES = tuple(d for d in ALL_DTYPES if d.name in ("float16", "float32", "float64", "int32", "int64",
                                                              "bfloat16"))
from tests.marks import mark, wait_for_marks

OPS = ("sum", "mean", "min", "max")
SHAPES = ((), (7,), (3, 5), (100_003,))
RTOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-6, "float64": 1e-6}


def make(reducer_name: str, **config: object) -> Reducer:
    cfg = Config(reducer=reducer_name, **config)  # explicit: ignore HOSTREDUCE_* in the environment
    if reducer_name == "mpi":
        from hostreduce.reducers.mpi.reducer import MPIReducer

        return MPIReducer(config=cfg)
    from hostreduce.reducers.horovod import HorovodReducer

    return HorovodReducer(config=cfg)


def data(rank: int, dtype: np.dtype, shape: tuple[int, ...], salt: int) -> np.ndarray:
    rng = np.random.default_rng([rank, salt, int(np.prod(shape, dtype=np.int64))])
    if dtype.kind == "i":
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    # Positive values: no cancellation, so a relative tolerance is meaningful.
    return rng.uniform(0.5, 1.5, size=shape).astype(dtype)


def reference(arrays: list[np.ndarray], op: str) -> np.ndarray:
    stack = np.stack([a.astype(np.float64) if a.dtype.kind == "f" or a.dtype.name == "bfloat16"
                      else a.astype(np.int64) for a in arrays])
    if op == "sum":
        return stack.sum(0)
    if op == "mean":
        return np.floor_divide(stack.sum(0), len(arrays)) if stack.dtype.kind == "i" else stack.mean(0)
    return stack.min(0) if op == "min" else stack.max(0)


def check_close(name: str, got: np.ndarray, want: np.ndarray, dtype: np.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape, (name, got.dtype, got.shape, want.shape)
    if dtype.kind == "i":
        np.testing.assert_array_equal(got.astype(np.int64), want, err_msg=name)
    else:
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=RTOL[dtype.name], atol=0, err_msg=name)


def marks_dir(r: Reducer) -> str:
    """A directory for ``tests.marks`` events between the ranks (all on this host): rank 0
    makes it and broadcasts its name; rank 0 removes it with :func:`remove_marks_dir`."""
    name = tempfile.mkdtemp(prefix="hostreduce-marks-").encode() if r.rank == 0 else b""
    raw = np.zeros(512, np.int64)
    raw[:len(name)] = list(name)
    got = r.broadcast("marks-dir", raw, root=0)
    return bytes(int(b) for b in got if b).decode()


def remove_marks_dir(r: Reducer, marks: str) -> None:
    r.barrier()  # every rank is done with it
    if r.rank == 0:
        shutil.rmtree(marks, ignore_errors=True)


def timing(check: str, rank: int, seconds: float) -> None:
    print(f"TIMING {check} rank {rank}: {seconds:.2f} s", flush=True)


def main() -> None:
    reducer_name = sys.argv[1]
    r = make(reducer_name, timeout_s=60.0)
    rank, size = r.rank, r.size
    digest = hashlib.sha256()
    n_checked = 0

    # --- all-reduce: every dtype x op x shape, fresh result.
    for dtype in SUPPORTED_DTYPES:
        for op in OPS:
            for shape in SHAPES:
                name = f"ar.{dtype.name}.{op}.{len(shape)}.{int(np.prod(shape, dtype=np.int64))}"
                inputs = [data(q, dtype, shape, 1) for q in range(size)]
                got = r.allreduce(name, inputs[rank].copy(), op)
                check_close(name, got, reference(inputs, op), dtype)
                digest.update(np.ascontiguousarray(got).tobytes())
                n_checked += 1

    # --- out= (separate), in place, non-contiguous input.
    for dtype in SUPPORTED_DTYPES:
        inputs = [data(q, dtype, (4, 6), 2) for q in range(size)]
        want = reference(inputs, "sum")
        out = np.empty((4, 6), dtype)
        got = r.allreduce(f"out.{dtype.name}", inputs[rank], "sum", out=out)
        assert got is out
        check_close(f"out.{dtype.name}", out, want, dtype)
        inplace = inputs[rank].copy()
        got = r.allreduce(f"inplace.{dtype.name}", inplace, "mean", out=inplace)
        assert got is inplace
        check_close(f"inplace.{dtype.name}", inplace, reference(inputs, "mean"), dtype)
        transposed = [a.T for a in inputs]
        got = r.allreduce(f"noncontig.{dtype.name}", transposed[rank], "max")
        check_close(f"noncontig.{dtype.name}", got, reference(transposed, "max"), dtype)
        for arr in (out, inplace, got):
            digest.update(np.ascontiguousarray(arr).tobytes())

    # --- async: many in flight, waited in reverse order.
    inputs = {i: [data(q, np.dtype(np.float32), (1000 + i,), 3) for q in range(size)] for i in range(16)}
    handles = [r.allreduce_async(f"async.{i}", inputs[i][rank], "sum") for i in range(16)]
    for i in reversed(range(16)):
        check_close(f"async.{i}", handles[i].wait(), reference(inputs[i], "sum"), np.dtype(np.float32))

    # --- broadcast: every dtype, from the last rank.
    root = size - 1
    for dtype in SUPPORTED_DTYPES:
        mine = data(rank, dtype, (5, 3), 4)
        got = r.broadcast(f"bc.{dtype.name}", mine, root=root)
        want = data(root, dtype, (5, 3), 4)
        assert got.dtype == dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes(), f"broadcast {dtype.name}"
        assert mine.tobytes() == data(rank, dtype, (5, 3), 4).tobytes(), "broadcast modified its input"
        digest.update(got.tobytes())
    scalar = r.broadcast("bc.scalar", np.array(rank * 2.5), root=root)
    assert scalar.shape == () and float(scalar) == root * 2.5, f"0-d broadcast: {scalar!r}"

    # --- all-gather: first dimension differs per rank (rank 0 contributes none when size > 1).
    for dtype in SUPPORTED_DTYPES:
        rows = rank if size > 1 else 2
        parts = [data(q, dtype, (q if size > 1 else 2, 3, 2), 5) for q in range(size)]
        got = r.allgather(f"ag.{dtype.name}", parts[rank])
        want = np.concatenate(parts, axis=0)
        assert got.dtype == dtype and got.shape == want.shape, (got.shape, want.shape, rows)
        assert got.tobytes() == want.tobytes(), f"allgather {dtype.name}"
        digest.update(got.tobytes())
    scalars = r.allgather("ag.scalar", np.int64(rank))
    np.testing.assert_array_equal(scalars, np.arange(size))

    if reducer_name == "mpi" and size > 1:
        # Trailing dimensions disagree: every rank raises, and the reducer stays usable.
        try:
            r.allgather("ag.bad", np.zeros((2, 3 + rank), np.float32))
        except TensorMismatchError:
            pass
        else:
            raise AssertionError("all-gather with mismatched trailing dimensions did not raise")

    # --- barrier, then every rank's results must be bitwise identical.
    r.barrier()
    digests = r.allgather("digest", np.frombuffer(digest.digest(), np.int64).reshape(1, -1))
    assert digests.shape == (size, 4), digests.shape
    assert (digests == digests[0]).all(), f"results differ across ranks: {digests[:, 0]}"

    if size > 1:  # the full collective set, batched into this launch (starting ranks is slow)
        from tests.mpi_workers.collectives_worker import run_all

        marks = marks_dir(r)
        run_all(r, reducer_name, marks)
        check_timeout(reducer_name, rank, marks)
        remove_marks_dir(r, marks)

    if reducer_name == "horovod":
        check_shared_libmpi(rank, size)
    r.close()
    r.close()  # idempotent
    print(f"OK rank {rank}/{size}: {n_checked} all-reduce cases", flush=True)


def check_shared_libmpi(rank: int, size: int) -> None:
    """mpi4py imported next to Horovod shares Horovod's MPI library instead of loading another."""
    from hostreduce.reducers.mpi.select import horovod_libmpi, loaded_libmpi
    from hostreduce.reducers.mpi.reducer import MPIReducer

    m = MPIReducer(config=Config(reducer="mpi", timeout_s=60.0))
    assert loaded_libmpi() == [str(horovod_libmpi())], loaded_libmpi()
    assert (m.rank, m.size) == (rank, size)
    got = m.allreduce("shared", np.full(3, rank + 1, np.int64))
    np.testing.assert_array_equal(got, np.full(3, size * (size + 1) // 2))
    m.close()


def check_timeout(reducer_name: str, rank: int, marks: str) -> None:
    """Rank 0 enters a barrier long before the others: it must time out, not hang."""
    t = make(reducer_name, timeout_s=0.5)
    if rank == 0:
        start = time.monotonic()
        try:
            t.barrier()
        except CollectiveTimeoutError:
            timing("barrier_timeout", rank, time.monotonic() - start)
        else:
            raise AssertionError("barrier did not time out")
        try:  # unusable afterwards: fails at once
            t.allreduce("after-timeout", np.ones(3, np.float32))
        except HostReduceError as exc:
            assert "unusable" in str(exc), exc
        else:
            raise AssertionError("collective after a timeout did not fail")
        mark(marks, "barrier-timed-out")
    else:
        wait_for_marks(marks, ["barrier-timed-out"])
        t.barrier()  # matches rank 0's abandoned barrier
    t.close()


if __name__ == "__main__":
    main()
