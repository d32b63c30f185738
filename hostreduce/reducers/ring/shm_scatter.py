"""One host's reduce-scatter and all-to-all of the whole job, on ``ShmGroup``'s shared
memory (its segments, its single-copy reads and its counters; see ``shm.py``).

Reduce-scatter is the shared-memory all-reduce's reduce phase without the gather: every
rank publishes its input, then rank r reduces slice r of every rank's input into its
result (its own slice first, then the peers' in rank order, the first reduction
writing the result), reading the peers' buffers directly where it may (``_cma.py``),
else from their shared regions. Each slice is read once by one rank: (N - 1)/N of the
data per rank, half an all-reduce. All-to-all: every rank writes its input into its region and,
after a barrier, copies its pieces out of every rank's region.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ...errors import PeerLostError
from ..base import ReduceOp
from .algorithm import finalize, reduce_into, reduce_pair
from .shm import BLOCK_BYTES, ShmGroup
from .shm_sync import Waiter

__all__ = ["reduce_scatter", "alltoall"]


def reduce_scatter(shm: ShmGroup, flat: np.ndarray, bounds: Sequence[int], op: ReduceOp,
                   out: np.ndarray) -> None:
    """Reduce slice ``bounds[r]:bounds[r + 1]`` of every rank's flat input into ``out``
    (flat, on rank r)."""
    if flat.size == 0:
        return
    if shm.direct_available():
        _direct(shm, np.ascontiguousarray(flat), bounds, op, out)
    else:
        _segments(shm, flat, bounds, op, out)


def _published(shm: ShmGroup, what: str) -> None:
    """Post this rank's input as published and wait until every rank's is."""
    w = shm.control.words
    target = shm._copied_base + 1
    shm.control.post("copied", target)
    waiter = Waiter(shm.control, what)
    while int(w["copied"].min()) < target:
        waiter.idle(lambda: [j for j in range(shm.size) if int(w["copied"][j]) < target])
    shm._copied_base = target


def _direct(shm: ShmGroup, flat: np.ndarray, bounds: Sequence[int], op: ReduceOp, out: np.ndarray) -> None:
    from . import _cma

    w = shm.control.words
    rank, size = shm.rank, shm.size
    shm._direct_ops += 1
    seq = shm._direct_ops
    w["addr"][rank] = flat.ctypes.data
    _published(shm, "a direct reduce-scatter (buffers published)")
    addrs = [int(a) for a in w["addr"]]
    item = flat.dtype.itemsize
    lo, hi = bounds[rank], bounds[rank + 1]
    block = max(1, BLOCK_BYTES // item)
    tmp = shm._scratch(flat.dtype, min(block, max(hi - lo, 1)), 0)
    j = rank
    try:
        for a in range(lo, hi, block):
            b = min(hi, a + block)
            acc, t, first = out[a - lo:b - lo], tmp[:b - a], True
            for j in range(size):
                if j != rank:
                    _cma.read_into(shm._pids[j], addrs[j] + a * item, t)
                    # The first reduction writes the result: one pass less than a copy.
                    if first:
                        reduce_pair(acc, flat[a:b], t, op)
                    else:
                        reduce_into(acc, t, op)
                    first = False
    except OSError as e:
        raise PeerLostError(f"Rank {rank}: reading rank {j}'s buffer failed ({e}); rank {j} has probably "
                            "exited") from None
    finalize(out, op, size)
    shm.control.post("done", seq)
    waiter = Waiter(shm.control, "the end of a direct reduce-scatter")
    while int(w["done"].min()) < seq:  # peers may still be reading this rank's input
        waiter.idle(lambda: [k for k in range(size) if int(w["done"][k]) < seq])


def _segments(shm: ShmGroup, flat: np.ndarray, bounds: Sequence[int], op: ReduceOp, out: np.ndarray) -> None:
    rank, size, n = shm.rank, shm.size, flat.size
    region = shm._prepare([n * flat.dtype.itemsize] * size)
    shm._region(rank, region, flat.dtype, n)[:] = flat
    _published(shm, "a shared-memory reduce-scatter")
    lo, hi = bounds[rank], bounds[rank + 1]
    peers = [shm._region(j, region, flat.dtype, n)[lo:hi] for j in range(size) if j != rank]
    reduce_pair(out, flat[lo:hi], peers[0], op)
    for view in peers[1:]:
        reduce_into(out, view, op)
    finalize(out, op, size)


def alltoall(shm: ShmGroup, flat: np.ndarray, splits: Sequence[Sequence[int]], out: np.ndarray) -> None:
    """``splits[i][j]`` elements go from rank i to rank j; ``out`` (flat) receives every
    rank's piece for this rank, in rank order."""
    rank, item = shm.rank, flat.dtype.itemsize
    totals = [sum(row) for row in splits]
    if not sum(totals):
        return
    region = shm._prepare([t * item for t in totals])
    if flat.size:
        shm._region(rank, region, flat.dtype, flat.size)[:] = flat
    shm.barrier()
    off = 0
    for i, row in enumerate(splits):
        c = row[rank]
        if c:
            start = sum(row[:rank])
            out[off:off + c] = shm._region(i, region, flat.dtype, start + c)[start:]
        off += c
