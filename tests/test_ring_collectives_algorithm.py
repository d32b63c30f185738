"""The ring's reduce-scatter, reduce, all-to-all and point-to-point, and every ring
algorithm on process groups, over the in-memory transport against numpy
(property-based); the coordinator's rules for groups and sends/receives; the new plan
steps through the codec."""
from __future__ import annotations

import queue
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hostreduce.reducers.base import ReduceOp
from hostreduce.reducers.ring import algorithm, collectives
from hostreduce.reducers.ring import messages as m
from hostreduce.reducers.ring.negotiation import Coordinator
from tests.test_ring_algorithm import DTYPES, OPS, MemLink, make_inputs, numpy_reduce, tolerance

# Products of float16 values fall into its subnormals, where one rounding step is
# 2**-24 whatever the value: an absolute slack of that per input on top of the relative one.
_SUBNORMAL_STEP = {"float16": 2.0 ** -24, "bfloat16": 2.0 ** -133, "float32": 2.0 ** -149}


def run_groups(world: int, groups: list[list[int]], fn) -> dict[int, object]:
    """Run ``fn(group_index, group_rank, link)`` on every member of each (disjoint)
    group at once, over one in-memory mesh of ``world`` ranks; results by world rank."""
    inboxes = [[queue.Queue() for _ in range(world)] for _ in range(world)]
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def body(gi: int, me: int) -> None:
        try:
            w = groups[gi][me]
            results[w] = fn(gi, me, collectives.GroupLink(MemLink(inboxes, w), groups[gi], me))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(gi, me)) for gi, g in enumerate(groups) for me in range(len(g))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert all(q.empty() for row in inboxes for q in row), "messages left undelivered"
    return results


@st.composite
def world_and_groups(draw, disjoint: int = 1):
    """A world of 1-4 ranks and up to ``disjoint`` disjoint random groups of it."""
    world = draw(st.integers(1, 4))
    ranks = draw(st.permutations(range(world)))
    groups, start = [], 0
    for _ in range(disjoint):
        if start >= world:
            break
        n = draw(st.integers(1, world - start))
        groups.append(sorted(ranks[start:start + n]))
        start += n
    return world, groups


def assert_reduced(got: np.ndarray, inputs: list[np.ndarray], op: ReduceOp) -> None:
    expected = numpy_reduce(inputs, op)
    dtype = inputs[0].dtype
    wide = got.astype(np.float64) if dtype.kind == "f" or dtype.name == "bfloat16" else got
    if tolerance(dtype) == 0.0 or op in (ReduceOp.MIN, ReduceOp.MAX):
        np.testing.assert_array_equal(wide, expected.astype(wide.dtype))
    else:
        ref = np.abs(np.prod([x.astype(np.float64) for x in inputs], axis=0)) if op is ReduceOp.PROD else \
            np.sum([np.abs(x.astype(np.float64)) for x in inputs], axis=0)
        bound = (tolerance(dtype) * np.maximum(np.maximum(np.abs(expected), ref), 1e-30) * 1.0001
                 + _SUBNORMAL_STEP.get(dtype.name, 0.0)) * len(inputs)
        assert np.all(np.abs(wide - expected) <= bound)


@settings(max_examples=50, deadline=None)
@given(wg=world_and_groups(disjoint=2), rows=st.integers(0, 40), inner=st.integers(1, 3), dtype=DTYPES, op=OPS,
       chunk=st.integers(1, 50), seed=st.integers(0, 2**16), data=st.data())
def test_reduce_scatter_gives_each_rank_its_rows_of_the_reduction(wg, rows, inner, dtype, op, chunk, seed, data):
    world, groups = wg
    # Random counts per group rank (zeros included) adding up to ``rows``.
    counts = []
    for g in groups:
        cuts = sorted(data.draw(st.lists(st.integers(0, rows), min_size=len(g) - 1, max_size=len(g) - 1)))
        counts.append([b - a for a, b in zip([0] + cuts, cuts + [rows])])
    inputs = {gi: make_inputs(len(g), rows * inner, dtype, seed + gi) for gi, g in enumerate(groups)}

    def fn(gi, me, link):
        src = inputs[gi][me].copy()
        bounds = collectives.offsets([c * inner for c in counts[gi]])
        out = np.empty(bounds[me + 1] - bounds[me], dtype)
        collectives.ring_reduce_scatter(src, out, bounds, me, len(groups[gi]), link, op, chunk, tag=5)
        assert src.tobytes() == inputs[gi][me].tobytes()  # the input is not written
        return out

    got = run_groups(world, groups, fn)
    for gi, g in enumerate(groups):
        bounds = collectives.offsets([c * inner for c in counts[gi]])
        for me, w in enumerate(g):
            assert_reduced(got[w], [x[bounds[me]:bounds[me + 1]] for x in inputs[gi]], op)


@settings(max_examples=40, deadline=None)
@given(wg=world_and_groups(disjoint=2), n=st.integers(0, 300), dtype=DTYPES, op=OPS, chunk=st.integers(1, 60),
       seed=st.integers(0, 2**16), data=st.data())
def test_reduce_leaves_the_reduction_on_the_root_only(wg, n, dtype, op, chunk, seed, data):
    world, groups = wg
    roots = [data.draw(st.integers(0, len(g) - 1)) for g in groups]
    inputs = {gi: make_inputs(len(g), n, dtype, seed + gi) for gi, g in enumerate(groups)}

    def fn(gi, me, link):
        out = np.empty(n, dtype) if me == roots[gi] else None
        collectives.ring_reduce(inputs[gi][me], out, roots[gi], me, len(groups[gi]), link, op, chunk, tag=9)
        return out

    got = run_groups(world, groups, fn)
    for gi, g in enumerate(groups):
        for me, w in enumerate(g):
            if me == roots[gi]:
                assert_reduced(got[w], inputs[gi], op)
            else:
                assert got[w] is None


@settings(max_examples=40, deadline=None)
@given(wg=world_and_groups(disjoint=2), inner=st.integers(1, 3), chunk=st.integers(1, 20), data=st.data())
def test_alltoall_delivers_every_piece_in_rank_order(wg, inner, chunk, data):
    world, groups = wg
    splits = [[[data.draw(st.integers(0, 6)) for _ in g] for _ in g] for g in groups]

    def piece(gi, i, j):  # what group rank i sends group rank j: recognisable values
        return np.full(splits[gi][i][j] * inner, 1000 * gi + 10 * i + j, np.int64)

    def fn(gi, me, link):
        n = len(groups[gi])
        send = np.concatenate([piece(gi, me, j) for j in range(n)])
        recv = [splits[gi][i][me] * inner for i in range(n)]
        out = np.empty(sum(recv), np.int64)
        collectives.alltoallv(send, [c * inner for c in splits[gi][me]], out, recv, me, n, link, chunk, tag=2)
        return out

    got = run_groups(world, groups, fn)
    for gi, g in enumerate(groups):
        for me, w in enumerate(g):
            np.testing.assert_array_equal(got[w], np.concatenate([piece(gi, i, me) for i in range(len(g))]))


@settings(max_examples=40, deadline=None)
@given(wg=world_and_groups(disjoint=2), n=st.integers(0, 2000), dtype=DTYPES, op=OPS, chunk=st.integers(1, 300),
       seed=st.integers(0, 2**16))
def test_ring_algorithms_on_groups_match_numpy_and_agree_bitwise(wg, n, dtype, op, chunk, seed):
    """All-reduce (the pair exchange at 2), broadcast and all-gather over a group's link,
    two disjoint groups at once with the same tags: every member holds the same bytes."""
    world, groups = wg
    inputs = {gi: make_inputs(len(g), n, dtype, seed + gi) for gi, g in enumerate(groups)}

    def fn(gi, me, link):
        size = len(groups[gi])
        buf = inputs[gi][me].copy()
        if size == 2:
            algorithm.pair_allreduce(buf, me, link, op, chunk, tag=1)
        else:
            algorithm.ring_allreduce(buf, me, size, link, op, chunk, tag=1)
        bc = inputs[gi][me].copy()
        algorithm.ring_broadcast(bc, size - 1, me, size, link, chunk, tag=2)
        ag = np.zeros(n * size, dtype)
        ag[me * n:(me + 1) * n] = inputs[gi][me]
        algorithm.ring_allgather(ag, [n] * size, me, size, link, chunk, tag=3)
        return buf, bc, ag

    got = run_groups(world, groups, fn)
    for gi, g in enumerate(groups):
        first = got[g[0]]
        for w in g[1:]:
            assert all(a.tobytes() == b.tobytes() for a, b in zip(got[w], first))
        assert_reduced(first[0], inputs[gi], op)
        assert first[1].tobytes() == inputs[gi][-1].tobytes()
        assert first[2].tobytes() == np.concatenate(inputs[gi]).tobytes()


@settings(max_examples=30, deadline=None)
@given(world=st.integers(2, 4), n=st.integers(0, 500), chunk=st.integers(1, 70), dtype=DTYPES, data=st.data())
def test_send_and_recv_move_an_array_between_any_pair(world, n, chunk, dtype, data):
    src, dst = data.draw(st.lists(st.integers(0, world - 1), min_size=2, max_size=2, unique=True))
    sent = make_inputs(1, n, dtype, n)[0]

    def fn(gi, me, link):  # one group: the pair, in world order
        if groups[0][me] == src:
            collectives.send_array(sent, 1 - me, link, chunk, tag=4)
            return None
        out = np.empty(n, dtype)
        collectives.recv_array(out, 1 - me, link, chunk, tag=4)
        return out

    groups = [sorted([src, dst])]
    assert run_groups(world, groups, fn)[dst].tobytes() == sent.tobytes()


# ---------------------------------------------------------------- coordinator
def entry(name, kind="allreduce", shape=(4,), group=None, root=0, counts=None, op="sum"):
    e = {"name": name, "kind": kind, "dtype": "float32", "shape": list(shape), "op": op, "root": root,
         "nbytes": 4 * int(np.prod(shape))}
    if group is not None:
        e["group"] = group
    if counts is not None:
        e["counts"] = counts
    return e


def coordinator(size=4, timeout=30.0):
    plans: list[dict] = []
    return Coordinator(size, 1 << 20, plans.extend, timeout), plans


def test_disjoint_groups_use_one_name_at_once_and_get_their_own_numbered_steps():
    coord, plans = coordinator()
    coord.on_ready(0, [entry("g", group=[0, 1])])
    coord.on_ready(2, [entry("g", group=[2, 3])])
    coord.on_ready(3, [entry("g", group=[2, 3])])
    coord.on_ready(1, [entry("g", group=[0, 1])])
    assert plans == [{"kind": "allreduce", "names": ["g"], "sid": 1, "group": [2, 3]},
                     {"kind": "allreduce", "names": ["g"], "sid": 2, "group": [0, 1]}]
    steps = m.steps(plans)
    assert steps[0] == m.AllReduce(["g"], group=(2, 3), sid=1)
    assert m.step_ranks(steps[1]) == (0, 1)


def test_ranks_that_count_each_other_in_different_groups_fail_naming_every_group():
    coord, plans = coordinator()
    coord.on_ready(1, [entry("x", group=[0, 1, 2])])
    coord.on_ready(2, [entry("x", group=[1, 2, 3])])
    errors = [p for p in plans if p["kind"] == "error"]
    assert len(errors) == 2 and all(p["etype"] == "mismatch" for p in errors)
    assert sorted(r for p in errors for r in p["ranks"]) == [1, 2]
    assert "'x'" in errors[0]["error"] and "rank 1: group[0, 1, 2], rank 2: group[1, 2, 3]" in errors[0]["error"]
    coord.on_ready(0, [entry("x", group=[0, 1, 2])])  # members that come later fail too
    coord.on_ready(3, [entry("x", group=[1, 2, 3])])
    assert [p["ranks"] for p in plans[2:]] == [[0], [3]] and plans[2]["error"] == errors[0]["error"]
    coord.on_ready(0, [entry("x", group=[0, 1, 2])])  # and then the name is free again
    assert len(plans) == 4


def test_a_name_reused_on_an_overlapping_group_later_is_not_a_mismatch():
    coord, plans = coordinator(size=3)
    coord.on_ready(0, [entry("y", group=[0, 1])])   # rank 2 is not in [0, 1]: [0, 2] may come later
    coord.on_ready(2, [entry("y", group=[0, 2])])
    coord.on_ready(1, [entry("y", group=[0, 1])])
    assert [p["kind"] for p in plans] == ["allreduce"]


def test_sends_are_matched_by_name_and_pair_and_mismatches_name_both_ranks():
    coord, plans = coordinator()
    coord.on_ready(0, [entry("p", "send", root=1, group=[0, 2])])   # group rank 1 = world rank 2
    coord.on_ready(3, [entry("p", "send", root=0)])                  # another pair, same name
    coord.on_ready(2, [entry("p", "recv", root=0, group=[0, 2])])
    coord.on_ready(0, [entry("q", "send", root=1, shape=(3,))])
    coord.on_ready(1, [entry("q", "recv", root=0, shape=(4,))])
    assert plans[0] == {"kind": "p2p", "names": ["p"], "src": 0, "dst": 2, "sid": 1}
    assert plans[1]["etype"] == "mismatch" and plans[1]["ranks"] == [0, 1]
    assert "rank 0: (3,), rank 1: (4,)" in plans[1]["error"]


def test_a_send_and_a_collective_may_share_a_name():
    coord, plans = coordinator(size=3)
    coord.on_ready(0, [entry("x", "send", root=1)])
    coord.on_ready(2, [entry("x")])
    coord.on_ready(1, [entry("x", "recv", root=0)])
    assert [p["kind"] for p in plans] == ["p2p"]


def test_reduce_scatter_and_alltoall_carry_counts_and_the_split_matrix():
    coord, plans = coordinator(size=2)
    for r in range(2):
        coord.on_ready(r, [entry("rs", "reducescatter", shape=(3, 2), counts=[1, 2]),
                           entry("a", "alltoall", shape=(3 + r, 2), counts=[r, 3]),
                           entry("rd", "reduce", root=1, op="prod")])
    rs, a2a, rd = m.steps(plans)
    assert rs == m.ReduceScatter(["rs"], [1, 2], sid=1) and a2a == m.AllToAll(["a"], [[0, 3], [1, 3]], sid=2)
    assert rd == m.Reduce(["rd"], 1, sid=3)
    coord.on_ready(0, [entry("c", "reducescatter", shape=(3, 2), counts=[1, 2])])
    coord.on_ready(1, [entry("c", "reducescatter", shape=(3, 2), counts=[2, 1])])
    assert "in counts: rank 0: [1, 2], rank 1: [2, 1]" in plans[-1]["error"]


def test_new_steps_round_trip():
    plan = m.Plan(0, [m.ReduceScatter(["a"], [1, 2], (0, 3), 7), m.Reduce(["b"], 1, (), 8),
                      m.AllToAll(["c"], [[1, 0], [2, 2]], (1, 2), 9), m.P2P(["d"], 3, 0, 10),
                      m.AllReduce(["e"], False, None, (0, 2), 11), m.Barrier(["f"], (1, 3))])
    assert m.decode(m.encode(plan)) == plan
    text = b'[0,[[9,["d"],3,0]]]'   # a P2P step without its sid
    with pytest.raises(ValueError, match="malformed P2P step"):
        m.decode(bytes([6]) + len(text).to_bytes(4, "little") + text)


@settings(max_examples=30, deadline=None)
@given(size=st.integers(3, 4), sizes=st.lists(st.integers(0, 300), min_size=2, max_size=5),
       dtype=st.sampled_from(["float32", "float16"]), chunk=st.integers(4, 256), seed=st.integers(0, 2**16),
       data=st.data())
def test_a_fused_bucket_sums_each_tensor_as_the_tensor_alone(size, sizes, dtype, chunk, seed, data):
    """Whatever shares a bucket and wherever a tensor lands in it, the gRPC ring sums each
    element in the same rank order as an all-reduce of that tensor alone (same bits)."""
    from hostreduce.reducers.ring.datapath import DataPath

    order = data.draw(st.permutations(range(len(sizes))))
    rng = np.random.default_rng(seed)
    inputs = [[(rng.standard_normal(n) * 10 ** rng.uniform(-3, 3, n)).astype(dtype) for n in sizes]
              for _ in range(size)]

    def fn(gi, me, link):
        path = DataPath(me, size, chunk, link=link)
        fused = [np.empty_like(inputs[me][t]) for t in order]
        path.allreduce([inputs[me][t] for t in order], fused, ReduceOp.SUM, tag=1)
        alone = []
        for t, x in enumerate(inputs[me]):
            out = np.empty_like(x)
            path.allreduce([x], [out], ReduceOp.SUM, tag=2 + t)
            alone.append(out)
        return [fused[order.index(t)] for t in range(len(sizes))], alone

    got = run_groups(size, [list(range(size))], fn)
    for r in range(size):
        fused, alone = got[r]
        for t in range(len(sizes)):
            assert fused[t].tobytes() == alone[t].tobytes(), f"rank {r} tensor {t}"
            assert fused[t].tobytes() == got[0][1][t].tobytes()
