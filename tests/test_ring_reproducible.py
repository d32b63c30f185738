"""Reproducibility: the same 4-rank one-host job, launched twice, gives the same bits on
every rank and in both runs, on each data path (single-copy shared memory, shared
segments, TCP). Bursts of asynchronous all-reduces are fused into buckets whose make-up
depends on timing, and blocking ones may take the fast lane, so an engine whose
operand order depends on where a tensor lands in its bucket fails here (the ring between hosts
lays buckets out segment by segment for this)."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from hostreduce.reducers.base import SUPPORTED_DTYPES as ALL_DTYPES
# The engines' wide dtypes, which these checks sweep; the 8- and 16-bit integers and bool are
# covered through the Horovod API (tests/test_horovod_dtypes.py).
SUPPORTED_DTYPES = tuple(d for d in ALL_DTYPES if d.name in ("float16", "float32", "float64", "int32", "int64",
                                                              "bfloat16"))
from hostreduce.testing import run_ranks

SIZE = 4
PATHS = ("shm", "shm-copy", "tcp")
# Around the ring's chunk (64 KiB here), the shared-memory block (1 MiB) and the segment
# edges of a fused bucket; the small ones are gathered by rank 0 with their announcements.
LENGTHS = (1, 3, 1000, 16_383, 16_385, 70_001, 262_145, 1_048_579)
_DTYPES = {d.name: d for d in SUPPORTED_DTYPES}
TENSORS = ([(f"f32/{n}", "float32", n) for n in LENGTHS]
           + [(f"{d}/{n}", d, n) for d in ("float16", "bfloat16") for n in (3, 70_001)])


def _input(rank: int, dtype: str, n: int, k: int) -> np.ndarray:
    return np.random.default_rng([2024, k, rank]).standard_normal(n).astype(_DTYPES[dtype])


def _digest(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def _job(rank: int, size: int) -> dict:
    """Each data path in turn: two bursts of asynchronous all-reduces (submitted in a
    rank-dependent order), then the same tensors as blocking calls (the fast lane on one
    host). Returns the digest of every result."""
    from tests import ring_workers as w

    got: dict[str, str] = {}
    for path in PATHS:
        with w.make_reducer(path, chunk_bytes=64 * 1024) as r:
            for burst in range(2):
                order = list(enumerate(TENSORS))
                if rank % 2:
                    order.reverse()
                handles = {name: r.allreduce_async(f"{name}/{burst}", _input(rank, dt, n, k))
                           for k, (name, dt, n) in order}
                for name, h in handles.items():
                    got[f"{path}/async{burst}/{name}"] = _digest(h.wait(60))
            for k, (name, dt, n) in enumerate(TENSORS):
                got[f"{path}/blocking/{name}"] = _digest(r.allreduce(name, _input(rank, dt, n, k)))
            got[f"{path}/single_copy"] = str(bool(getattr(r, "_shm", None) and r._shm.direct_available()))
            r.barrier()
    return got


def _rank_order_sum(dt: str, n: int, k: int) -> str:
    acc = _input(0, dt, n, k)
    for j in range(1, SIZE):
        acc = acc + _input(j, dt, n, k)
    return _digest(acc)


def _on_the_ring(dt: str, n: int) -> bool:
    """An all-reduce between hosts of this tensor alone goes around the ring (not through rank 0)."""
    itemsize = 4 if dt == "float32" else 2
    return n * itemsize * (SIZE - 1) > 256 * 1024


@pytest.mark.timeout(90)
def test_two_runs_give_the_same_bits_on_every_rank_and_path():
    runs = [run_ranks(_job, SIZE, timeout=80) for _ in range(2)]
    first = runs[0][0]
    assert first["shm/single_copy"] == "True" and first["shm-copy/single_copy"] == "False"
    for run, outs in enumerate(runs):
        for rank, out in enumerate(outs):
            differ = sorted(key for key in first if out[key] != runs[run][0][key])
            assert not differ, f"run {run}: rank {rank} differs from rank 0 in {differ}"
    varied = sorted(key for key in first if runs[1][0][key] != first[key])
    assert varied == [], f"the two runs differ in {varied}"
    # A fused bucket is laid out segment by segment, so each tensor in it is summed as
    # when it goes around the ring alone.
    for name, dt, n in TENSORS:
        if _on_the_ring(dt, n):
            for burst in range(2):
                assert first[f"tcp/async{burst}/{name}"] == first[f"tcp/blocking/{name}"], f"{name} fused"
    # On shared memory every element is reduced in rank order, whoever reduces it.
    for k, (name, dt, n) in enumerate(TENSORS):
        want = _rank_order_sum(dt, n, k)
        for path in ("shm", "shm-copy"):
            assert first[f"{path}/blocking/{name}"] == want, f"{path}/{name}"
