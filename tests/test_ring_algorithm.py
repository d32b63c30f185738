"""The ring algorithm over an in-memory link, against numpy (property-based), and the
coordinator's ordering, fusion and error items."""
from __future__ import annotations

import queue
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hostreduce.reducers.base import ReduceOp, SUPPORTED_DTYPES
from hostreduce.reducers.ring import algorithm
from hostreduce.reducers.ring.negotiation import Coordinator


class MemLink:
    """In-memory mesh: one FIFO per (receiver, sender) pair, like the gRPC mesh's inboxes."""

    def __init__(self, inboxes: list[list[queue.Queue]], rank: int) -> None:
        self.inboxes, self.rank, self.size = inboxes, rank, len(inboxes)

    def send(self, tag: int, data: np.ndarray) -> None:
        self.send_to((self.rank + 1) % self.size, tag, data)

    def recv(self, tag: int) -> bytes:
        return self.recv_from((self.rank - 1) % self.size, tag)

    def send_to(self, dst: int, tag: int, data: np.ndarray) -> None:
        self.inboxes[dst][self.rank].put((tag, data.tobytes()))

    def recv_from(self, src: int, tag: int) -> bytes:
        got, payload = self.inboxes[self.rank][src].get(timeout=10)
        assert got == tag
        return payload


def run_ring(size: int, fn) -> list:
    inboxes = [[queue.Queue() for _ in range(size)] for _ in range(size)]
    results: list = [None] * size
    errors: list = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, MemLink(inboxes, rank))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert all(q.empty() for row in inboxes for q in row), "ring left undelivered messages"
    return results


def make_inputs(size: int, n: int, dtype: np.dtype, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype.kind in "iu":
        return [rng.integers(-1000, 1000, n).astype(dtype) for _ in range(size)]
    return [rng.standard_normal(n).astype(dtype) for _ in range(size)]


def numpy_reduce(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    wide = [x.astype(np.float64) if x.dtype.kind == "f" or x.dtype.name == "bfloat16" else x for x in inputs]
    if op is ReduceOp.SUM:
        return np.sum(wide, axis=0)
    if op is ReduceOp.MEAN:
        total = np.sum(wide, axis=0)
        return total // len(inputs) if inputs[0].dtype.kind in "iu" else total / len(inputs)
    if op is ReduceOp.PROD:  # integers wrap around as the engines' do
        return np.prod(wide, axis=0, dtype=None if inputs[0].dtype.kind == "f" or inputs[0].dtype.name == "bfloat16"
                       else inputs[0].dtype)
    return (np.min if op is ReduceOp.MIN else np.max)(wide, axis=0)


def tolerance(dtype: np.dtype) -> float:
    return {"float16": 5e-3, "bfloat16": 3e-2, "float32": 1e-6, "float64": 1e-12}.get(dtype.name, 0.0)


# The wide dtypes, whose sums the reference computes without wrapping around; the 8- and
# 16-bit integers (which wrap, as in Horovod) and bool: tests/test_horovod_exact.py.
DTYPES = st.sampled_from([d for d in SUPPORTED_DTYPES if d.name in ("float16", "float32", "float64", "int32", "int64",
                                                                    "bfloat16")])
OPS = st.sampled_from(list(ReduceOp))


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 5), n=st.integers(0, 3000), dtype=DTYPES, op=OPS,
       chunk=st.integers(1, 700), seed=st.integers(0, 2**16))
def test_allreduce_matches_numpy_and_is_identical_on_every_rank(size, n, dtype, op, chunk, seed):
    check_allreduce(size, n, dtype, op, seed,
                    lambda buf, rank, link: algorithm.ring_allreduce(buf, rank, size, link, op, chunk, tag=7))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 3000), dtype=DTYPES, op=OPS, chunk=st.integers(1, 700), seed=st.integers(0, 2**16))
def test_pair_exchange_matches_numpy_and_is_identical_on_both_ranks(n, dtype, op, chunk, seed):
    check_allreduce(2, n, dtype, op, seed,
                    lambda buf, rank, link: algorithm.pair_allreduce(buf, rank, link, op, chunk, tag=3))


@pytest.mark.parametrize("op", list(ReduceOp))
def test_pair_exchange_is_bitwise_identical_with_signed_zeros_and_nans(op):
    a = np.array([0.0, -0.0, np.nan, 1.0, -np.nan, np.inf], np.float32)
    b = np.array([-0.0, 0.0, -np.nan, np.nan, 2.0, -np.inf], np.float32)
    b.view(np.uint32)[2] |= 0x1234  # a NaN with another payload

    def rank_fn(rank, link):
        buf = (a if rank == 0 else b).copy()
        with np.errstate(invalid="ignore"):  # inf + -inf on purpose
            algorithm.pair_allreduce(buf, rank, link, op, 2, tag=1)
        return buf

    r0, r1 = run_ring(2, rank_fn)
    assert r0.tobytes() == r1.tobytes()


def check_allreduce(size, n, dtype, op, seed, algo) -> None:
    inputs = make_inputs(size, n, dtype, seed)

    def rank_fn(rank, link):
        buf = inputs[rank].copy()
        algo(buf, rank, link)
        return buf

    results = run_ring(size, rank_fn)
    for r in results[1:]:
        assert r.tobytes() == results[0].tobytes()
    expected = numpy_reduce(inputs, op)
    got = results[0].astype(np.float64) if dtype.kind == "f" or dtype.name == "bfloat16" else results[0]
    if tolerance(dtype) == 0.0 or op in (ReduceOp.MIN, ReduceOp.MAX):
        np.testing.assert_array_equal(got, expected.astype(got.dtype) if op in (ReduceOp.MIN, ReduceOp.MAX) else expected)
    else:
        scale = np.maximum(np.abs(expected), np.sum([np.abs(x.astype(np.float64)) for x in inputs], axis=0))
        assert np.all(np.abs(got - expected) <= tolerance(dtype) * np.maximum(scale, 1e-30) * 1.0001)


@settings(max_examples=30, deadline=None)
@given(counts=st.lists(st.integers(0, 50), min_size=1, max_size=5), inner=st.integers(1, 4),
       chunk=st.integers(1, 40))
def test_allgather_concatenates_in_rank_order(counts, inner, chunk):
    size = len(counts)
    parts = [np.arange(c * inner, dtype=np.int64) + 1000 * r for r, c in enumerate(counts)]
    elems = [c * inner for c in counts]

    def rank_fn(rank, link):
        buf = np.zeros(sum(elems), np.int64)
        off = sum(elems[:rank])
        buf[off:off + elems[rank]] = parts[rank]
        algorithm.ring_allgather(buf, elems, rank, size, link, chunk)
        return buf

    for got in run_ring(size, rank_fn):
        np.testing.assert_array_equal(got, np.concatenate(parts))


@settings(max_examples=30, deadline=None)
@given(size=st.integers(1, 5), n=st.integers(0, 500), chunk=st.integers(1, 100), data=st.data())
def test_broadcast_from_any_root(size, n, chunk, data):
    root = data.draw(st.integers(0, size - 1))
    source = np.arange(n, dtype=np.float32) * 3.5

    def rank_fn(rank, link):
        buf = source.copy() if rank == root else np.zeros(n, np.float32)
        algorithm.ring_broadcast(buf, root, rank, size, link, chunk)
        return buf

    for got in run_ring(size, rank_fn):
        np.testing.assert_array_equal(got, source)


# ---------------------------------------------------------------- coordinator
def entry(name, kind="allreduce", dtype="float32", shape=(4,), op="sum", root=0):
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return {"name": name, "kind": kind, "dtype": dtype, "shape": list(shape), "op": op, "root": root,
            "nbytes": nbytes}


def coordinator(size=2, threshold=1 << 20, timeout=30.0, clock=None):
    plans: list[dict] = []
    kwargs = {} if clock is None else {"clock": clock}
    return Coordinator(size, threshold, plans.extend, timeout, **kwargs), plans


def test_order_is_agreed_whatever_the_submission_order():
    coord, plans = coordinator(threshold=0)
    for n in "abc":
        coord.on_ready(0, [entry(n)])
    for n in "cba":
        coord.on_ready(1, [entry(n)])
    assert [i["names"] for i in plans] == [["c"], ["b"], ["a"]]


def test_ready_tensors_are_fused_up_to_the_threshold_by_dtype_and_op():
    coord, plans = coordinator(threshold=48)
    batch = [entry("a"), entry("b"), entry("c", dtype="float64"), entry("d", op="max"), entry("e"),
             entry("f"), entry("g"), entry("h")]
    coord.on_ready(0, batch)
    coord.on_ready(1, batch)
    assert [i["names"] for i in plans] == [["a", "b"], ["c"], ["d"], ["e", "f", "g"], ["h"]]


def test_tensors_sent_with_their_data_form_gather_buckets_that_keep_the_data_on_rank_0():
    plans: list[dict] = []
    coord = Coordinator(2, 1 << 20, plans.extend, 30.0, gather_threshold=32)

    def with_data(name, rank):
        return {**entry(name), "_data": f"{name}{rank}"}

    coord.on_ready(0, [with_data("a", 0), with_data("b", 0), with_data("c", 0), entry("d")])
    coord.on_ready(1, [with_data("a", 1), with_data("b", 1), with_data("c", 1), entry("d")])
    assert [(i["names"], i.get("gather", False)) for i in plans] == [
        (["a", "b"], True), (["c"], True), (["d"], False)]
    assert plans[0]["_parts"] == {"a": ["a0", "a1"], "b": ["b0", "b1"]}
    assert "_parts" not in plans[2]


def test_a_tensor_whose_data_only_some_ranks_sent_takes_the_ordinary_path():
    coord, plans = coordinator()
    coord.on_ready(0, [{**entry("a"), "_data": b"x"}])
    coord.on_ready(1, [entry("a")])
    (item,) = plans
    assert item["names"] == ["a"] and "gather" not in item and "_parts" not in item


@pytest.mark.parametrize("field,a,b,fragment", [
    ("shape", (4,), (5,), "rank 0: (4,), rank 1: (5,)"),
    ("dtype", "float32", "int32", "rank 0: float32, rank 1: int32"),
    ("op", "sum", "max", "rank 0: sum, rank 1: max"),
])
def test_mismatch_becomes_an_error_item_naming_each_rank(field, a, b, fragment):
    coord, plans = coordinator()
    coord.on_ready(0, [entry("w", **{field: a})])
    coord.on_ready(1, [entry("w", **{field: b})])
    (item,) = plans
    assert item["kind"] == "error" and item["etype"] == "mismatch"
    assert "'w'" in item["error"] and fragment in item["error"]


def test_collective_missing_on_a_rank_times_out_with_the_ranks_named():
    now = [0.0]
    coord, plans = coordinator(size=3, timeout=5.0, clock=lambda: now[0])
    coord.on_ready(0, [entry("x")])
    coord.on_ready(2, [entry("x")])
    coord.check_stalls()
    assert plans == []
    now[0] = 6.0
    coord.check_stalls()
    (item,) = plans
    assert item["etype"] == "stall" and item["ranks"] == [0, 2]
    assert "not by ranks [1]" in item["error"]


def test_ranks_all_blocked_on_names_not_common_to_all_fail_together_after_settling():
    now = [0.0]
    coord, plans = coordinator(size=3, clock=lambda: now[0])
    coord.on_ready(0, [entry("a"), entry("c")])
    coord.on_ready(1, [entry("b"), entry("c")])
    coord.on_ready(2, [entry("a")])
    coord.on_blocked(0, "a")
    coord.on_blocked(1, "b")
    coord.check_blocked()
    assert plans == []  # rank 2 is not waiting: it may still submit "b"
    coord.on_blocked(2, "a")
    coord.check_blocked()
    now[0] = 0.2
    coord.check_blocked()
    assert plans == []  # settling: a message may still be on its way
    now[0] = 0.4
    coord.check_blocked()
    (item,) = plans
    assert item["etype"] == "unmatched" and item["names"] == ["a", "b", "c"] and item["ranks"] == [0, 1, 2]
    assert ("rank 0 waits for ['a', 'c'], rank 1 waits for ['b', 'c'], rank 2 waits for ['a']"
            in item["error"]), item["error"]
    coord.on_ready(0, [entry("a")])  # the names are free again
    coord.on_ready(1, [entry("a")])
    coord.on_ready(2, [entry("a")])
    assert plans[-1] == {"kind": "allreduce", "names": ["a"], "sid": 1}


def test_a_rank_that_submits_or_stops_waiting_is_not_blocked():
    now = [0.0]
    coord, plans = coordinator(size=2, clock=lambda: now[0])
    coord.on_ready(0, [entry("a")])
    coord.on_ready(1, [entry("b")])
    coord.on_blocked(0, "a")
    coord.on_blocked(1, "b")
    coord.on_ready(1, [entry("a")])  # rank 1 submits what rank 0 waits for: planned
    for t in (0.0, 1.0, 2.0):
        now[0] = t
        coord.check_blocked()
    assert [i["kind"] for i in plans] == ["allreduce"]
    coord.on_blocked(0, None)
    coord.on_blocked(1, "b")  # rank 0 no longer waits (its wait timed out)
    for t in (3.0, 4.0):
        now[0] = t
        coord.check_blocked()
    assert len(plans) == 1
    coord.on_blocked(0, "zzz")  # a name this rank has not announced (yet): not blocked on it
    for t in (5.0, 6.0):
        now[0] = t
        coord.check_blocked()
    assert len(plans) == 1


def test_a_stall_on_a_rank_that_stopped_answering_blames_that_rank():
    now = [0.0]
    coord, plans = coordinator(size=3, timeout=5.0, clock=lambda: now[0])
    coord.on_ready(0, [entry("x")])
    coord.on_ready(2, [entry("x")])
    now[0] = 6.0
    coord.check_stalls(lambda missing: f"rank {missing[0]} has not answered for 6.0 s (stopped or hung)")
    (item,) = plans
    assert item["etype"] == "lost" and item["error"] == "rank 1 has not answered for 6.0 s (stopped or hung)"


def test_announcement_with_data_round_trips():
    from hostreduce.reducers.ring.messages import Ready, decode, encode

    def encode_announcement(entries):
        return encode(Ready(1, entries))

    def decode_announcement(payload):
        return decode(payload).entries

    a = np.arange(5, dtype=np.float32)
    b = np.arange(3, dtype=np.int64).reshape(3, 1)
    entries = [{**entry("a", shape=(5,)), "_data": a}, entry("big", shape=(4,)),
               {**entry("b", dtype="int64", shape=(3, 1)), "_data": b}]
    got = decode_announcement(memoryview(encode_announcement(entries)))
    assert [e["name"] for e in got] == ["a", "big", "b"]
    assert "_data" not in got[1] and all("inline" not in e for e in got)
    np.testing.assert_array_equal(np.frombuffer(got[0]["_data"], np.float32), a)
    np.testing.assert_array_equal(np.frombuffer(got[2]["_data"], np.int64), b.reshape(-1))
    with pytest.raises(ValueError, match="does not match"):
        decode_announcement(memoryview(encode_announcement(entries) + b"x"))
