"""Every collective of the reducer contract, on the world and on process groups, checked
against numpy: written once, run by every engine at every world size.

``check_all(reducer)`` runs, in phases separated by world barriers: the world group;
a group of the first and last rank (non-consecutive at N >= 3); two disjoint groups
at once that use the same collective names (N >= 4); within each, all-reduce of every
dtype and op (prod included, and bfloat16 wire compression), reduce-scatter with even
and uneven counts, reduce to a root, all-to-all with per-rank splits (zeros included),
broadcast, all-gather of rank-dependent lengths, send/receive around the group, and a
barrier. Every rank can compute every rank's input (seeded by world rank), so each
checks its own results against numpy and returns their digests, which the caller
compares across ranks (bitwise identical where every member holds the result).

``reorder``: submit each phase's collectives in a rank-dependent order (engines that
match by name: the ring); position-matched engines (MPI, Horovod) submit in one order.

Usage under mpirun: ``python tests/collectives_check.py {mpi|horovod}`` prints
``OK rank R/N`` and exits 0, or raises.
"""
from __future__ import annotations

import hashlib
import sys
from typing import Any, Callable

import numpy as np

from hostreduce.reducers.base import SUPPORTED_DTYPES as ALL_DTYPES, Group, Reducer
# The engines' wide dtypes, which these checks sweep; the 8- and 16-bit integers and bool are
# covered through the Horovod API (tests/test_horovod_dtypes.py).
SUPPORTED_DTYPES = tuple(d for d in ALL_DTYPES if d.name in ("float16", "float32", "float64", "int32", "int64",
                                                              "bfloat16"))

OPS = ("sum", "mean", "min", "max", "prod")
RTOL = {"float16": 4e-3, "bfloat16": 3.2e-2, "float32": 2e-6, "float64": 1e-12}
_Check = Callable[[Any], None]


def data(world_rank: int, dtype: np.dtype, shape: tuple[int, ...], salt: str) -> np.ndarray:
    seed = int(hashlib.sha256(f"{world_rank}/{dtype}/{shape}/{salt}".encode()).hexdigest()[:8], 16)
    rng = np.random.default_rng(seed)
    if dtype.kind == "i":
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    return rng.uniform(0.5, 1.5, size=shape).astype(dtype)  # positive: relative tolerances hold


def reference(arrays: list[np.ndarray], op: str) -> np.ndarray:
    dtype = arrays[0].dtype
    if dtype.kind == "i":  # integers wrap around as the engines' do
        stack = np.stack(arrays)
        if op in ("sum", "mean"):
            total = stack.sum(0, dtype=dtype)
            return total if op == "sum" else np.floor_divide(total, dtype.type(len(arrays)))
        return {"min": stack.min(0), "max": stack.max(0), "prod": stack.prod(0, dtype=dtype)}[op]
    stack = np.stack([a.astype(np.float64) for a in arrays])
    return {"sum": stack.sum(0), "mean": stack.mean(0), "min": stack.min(0), "max": stack.max(0),
            "prod": stack.prod(0)}[op]


def assert_close(what: str, got: np.ndarray, arrays: list[np.ndarray], op: str, rtol: float | None = None) -> None:
    expected = reference(arrays, op)
    if got.shape != expected.shape:
        raise AssertionError(f"{what}: shape {got.shape}, expected {expected.shape}")
    dtype = arrays[0].dtype
    if dtype.kind == "i" or op in ("min", "max"):
        if not np.array_equal(got.astype(np.float64) if dtype.kind != "i" else got, expected):
            raise AssertionError(f"{what}: differs from numpy")
        return
    tol = (RTOL[dtype.name] if rtol is None else rtol) * len(arrays)
    err = np.abs(got.astype(np.float64) - expected) / np.maximum(np.abs(expected), 1e-30)
    if err.size and err.max() > tol:
        raise AssertionError(f"{what}: relative error {err.max():.3g} > {tol:.3g}")


def digest(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return "+".join(digest(v) for v in value)
    return hashlib.sha256(np.ascontiguousarray(value).tobytes() + str(value.dtype).encode()).hexdigest()[:16]


def _cases(r: Reducer, g: Group, tag: str) -> list[tuple[str, Callable[[], Any], _Check, bool]]:
    """(name, start, check, shared): ``shared`` results are the same on every member."""
    me, n, ranks = g.rank, g.size, g.ranks
    cases: list[tuple[str, Callable[[], Any], _Check, bool]] = []

    def add(name: str, start: Callable[[], Any], check: _Check, shared: bool = True) -> None:
        cases.append((f"{tag}/{name}", start, check, shared))

    for dtype in SUPPORTED_DTYPES:
        for op in OPS:
            for length in (5, 4099):
                name = f"ar/{dtype.name}/{op}/{length}"
                ins = [data(w, dtype, (length,), name) for w in ranks]
                add(name, lambda nm=f"{tag}/{name}", x=ins[me], o=op: r.allreduce_async(nm, x, o, group=g),
                    lambda got, nm=name, a=ins, o=op: assert_close(nm, got, a, o))
    f32, i32 = np.dtype(np.float32), np.dtype(np.int32)
    ins = [data(w, f32, (3000,), "bf16") for w in ranks]
    add("ar/bf16-wire", lambda x=ins[me]: r.allreduce_async(f"{tag}/ar/bf16-wire", x, "sum", group=g,
                                                             compression="bf16"),
        lambda got, a=ins: assert_close("bf16-wire", got, a, "sum", rtol=RTOL["bfloat16"]))
    for dtype in (f32, i32):
        for op in OPS:
            rows = 3 * n + 1
            even = [rows // n + (1 if i < rows % n else 0) for i in range(n)]
            uneven = [2 if i % 2 == 0 else 0 for i in range(n - 1)]
            uneven.append(rows - sum(uneven))
            for label, counts in (("even", None), ("uneven", uneven)):
                name = f"rs/{dtype.name}/{op}/{label}"
                ins = [data(w, dtype, (rows, 3), name) for w in ranks]
                cnt = even if counts is None else counts
                lo = sum(cnt[:me])
                add(name, lambda nm=f"{tag}/{name}", x=ins[me], o=op, c=counts: r.reduce_scatter_async(
                    nm, x, o, counts=c, group=g),
                    lambda got, nm=name, a=ins, o=op, lo=lo, hi=lo + cnt[me]: assert_close(
                        nm, got, [x[lo:hi] for x in a], o), shared=False)
        root = n - 1
        name = f"reduce/{dtype.name}"
        ins = [data(w, dtype, (7, 2), name) for w in ranks]
        add(name, lambda nm=f"{tag}/{name}", x=ins[me]: r.reduce_async(nm, x, root=root, op="sum", group=g),
            (lambda got, a=ins: assert_close("reduce", got, a, "sum")) if me == root else _is_none, shared=False)
    # All-to-all: rank i sends (i + 2j + 1) % 3 rows to rank j (zeros included).
    splits = [[(i + 2 * j + 1) % 3 for j in range(n)] for i in range(n)]
    ins = [data(w, f32, (sum(splits[i]), 4), "a2a") for i, w in enumerate(ranks)]

    def a2a_check(got: Any) -> None:
        out, received = got
        parts = [ins[i][sum(splits[i][:me]):sum(splits[i][:me + 1])] for i in range(n)]
        if list(np.asarray(received)) != [splits[i][me] for i in range(n)]:
            raise AssertionError(f"alltoall: received splits {received}")
        if not np.array_equal(out, np.concatenate(parts)):
            raise AssertionError("alltoall: data differs")
    add("a2a", lambda: r.alltoall_async(f"{tag}/a2a", ins[me], splits[me], group=g), a2a_check, shared=False)
    bc_root = 1 % n
    bc = [data(w, f32, (33,), "bc") for w in ranks]
    add("bc", lambda: r.broadcast_async(f"{tag}/bc", bc[me], root=bc_root, group=g),
        lambda got: _equal("broadcast", got, bc[bc_root]))
    ag = [data(w, i32, (i + 1, 2), "ag") for i, w in enumerate(ranks)]
    add("ag", lambda: r.allgather_async(f"{tag}/ag", ag[me], group=g),
        lambda got: _equal("allgather", got, np.concatenate(ag)))
    return cases


def _equal(what: str, got: np.ndarray, expected: np.ndarray) -> None:
    if not np.array_equal(got, expected):
        raise AssertionError(f"{what}: differs from the expected array")


def _is_none(got: Any) -> None:
    if got is not None:
        raise AssertionError(f"reduce: a rank other than the root got {type(got).__name__}, not None")


def _p2p(r: Reducer, g: Group, tag: str) -> dict[str, str]:
    """Each member sends to the next member and receives from the previous one (even
    ranks send first, so engines that block in a send cannot deadlock)."""
    if g.size < 2:
        return {}
    me, n = g.rank, g.size
    nxt, prev = (me + 1) % n, (me - 1) % n
    mine = data(g.ranks[me], np.dtype(np.float64), (me + 2, 3), "p2p")
    theirs = data(g.ranks[prev], np.dtype(np.float64), (prev + 2, 3), "p2p")
    send = lambda: r.send_async(f"{tag}/p2p/{me}", mine, nxt, group=g)  # noqa: E731
    recv = lambda: r.recv_async(f"{tag}/p2p/{prev}", prev, theirs.shape, theirs.dtype, group=g)  # noqa: E731
    first, second = (send, recv) if me % 2 == 0 else (recv, send)
    h1, h2 = first(), second()
    got = (h2 if me % 2 == 0 else h1).wait(60)
    (h1 if me % 2 == 0 else h2).wait(60)
    _equal("recv", got, theirs)
    return {}


def _phase(r: Reducer, g: Group, tag: str, reorder: bool) -> dict[str, str]:
    cases = _cases(r, g, tag)
    order = list(range(len(cases)))
    if reorder and g.rank % 2:
        order.reverse()
    handles = {i: cases[i][1]() for i in order}
    out: dict[str, str] = {}
    for i in range(len(cases)):
        name, _, check, shared = cases[i]
        got = handles[i].wait(120)
        check(got)
        if shared:
            out[name] = digest(got)
    _p2p(r, g, tag)
    r.barrier(group=g)
    return out


def groups_to_check(size: int) -> list[list[list[int]]]:
    """Phases: each a list of disjoint groups that run at once."""
    phases = [[list(range(size))]]
    if size >= 2:
        phases.append([[0, size - 1]])
    if size >= 4:
        phases.append([[0, 1], [2, 3]])
    elif size == 3:
        phases.append([[0, 2], [1]])
    return phases


def check_all(r: Reducer, reorder: bool = False) -> dict[str, dict[str, str]]:
    """Run every phase on ``r``; return, per group this rank is a member of, the
    digests of the results every member shares (``agree`` compares them)."""
    digests: dict[str, dict[str, str]] = {}
    for p, phase in enumerate(groups_to_check(r.size)):
        for ranks in phase:  # every rank creates every group of the phase (Horovod's rule)
            g = r.create_group(ranks)
            if g.is_member:
                tag = f"p{p}" if len(phase) > 1 else f"p{p}/{g.key}"  # disjoint groups share names
                digests[g.key] = _phase(r, g, tag, reorder)
        r.barrier()
    return digests


def agree(r: Reducer, digests: dict[str, dict[str, str]]) -> None:
    """Raise unless every member of each group holds the same shared results."""
    for phase in groups_to_check(r.size):
        for ranks in phase:
            g = r.create_group(ranks)
            if not g.is_member:
                continue
            mine = hashlib.sha256(repr(sorted(digests[g.key].items())).encode()).digest()
            rows = r.allgather(f"agree/{g.key}", np.frombuffer(mine, np.int32).reshape(1, 8).copy(), group=g)
            if len({row.tobytes() for row in rows}) != 1:
                raise AssertionError(f"results differ between the ranks of {g}")
        r.barrier()


def main(engine: str) -> int:
    from hostreduce.config import Config
    from hostreduce.reducers import create_reducer

    with create_reducer(engine, config=Config(reducer=engine)) as r:
        digests = check_all(r)
        agree(r, digests)
        print(f"OK rank {r.rank}/{r.size}: {sum(map(len, digests.values()))} shared results", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
