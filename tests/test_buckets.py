"""Fusion buckets of the streaming hand-off: layout, submission when a bucket is full or
the group ends, results split back per tensor, the swappable communication hook, and
MPI training under mpirun with one collective per bucket."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hostreduce.errors import ConfigError
from hostreduce.reducers.base import Handle
from hostreduce.streaming import Channel, Collective, Slot, plan_buckets, register_bucket_hook
from hostreduce.streaming.slots import fuse

from tests.mpi_workers.mpi_launch import mpi_skip_reason


class TwoRanks:
    """A reducer for two ranks holding equal arrays: ``sum`` doubles, ``mean`` keeps.
    Collectives complete when ``release()`` is called, so tests see what is pending."""

    size = 2

    def __init__(self) -> None:
        self.calls: list[tuple[str, np.dtype, int]] = []
        self.pending: list[tuple[Handle, np.ndarray, str, Any]] = []

    def allreduce_async(self, name: str, array: np.ndarray, op: str = "sum", out: Any = None) -> Handle:
        self.calls.append((name, array.dtype, array.size))
        handle = Handle(name)
        self.pending.append((handle, array, op, out))
        return handle

    def release(self) -> None:
        pending, self.pending = self.pending, []
        for handle, array, op, out in pending:
            result = array * 2 if op == "sum" else array.copy()
            if out is not None:
                np.copyto(out, result)
                result = out
            handle.set_result(result)


def _group(channel: Channel, arrays: list[np.ndarray], ops: list[str] | None = None) -> list[Slot]:
    ops = ops or ["sum"] * len(arrays)
    slots = [Slot(Collective("allreduce", f"g/{i}", ops[i]), channel, i, a.shape, a.dtype)
             for i, a in enumerate(arrays)]
    fuse(slots, channel)
    return slots


def _hand_off_all(slots: list[Slot], arrays: list[np.ndarray]) -> None:
    for i in range(len(slots) - 1, -1, -1):  # backward order: last tensor first
        slots[i].hand_off(arrays[i])


# ---------------------------------------------------------------- layout (pure)
def test_layout_mixed_dtypes_big_tensor_and_order() -> None:
    f32, f16 = ("f4", "sum"), ("f2", "sum")
    entries = [(f32, 40), (f16, 40), (f32, 40), (f32, 500), (f16, 40), (f32, 30), None, (("f4", "mean"), 8)]
    assert plan_buckets(entries, 100) == [[0, 2], [3], [1, 4], [5], [6], [7]]
    # 0: one tensor per bucket; a huge limit: one bucket per dtype and op.
    assert plan_buckets(entries, 0) == [[i] for i in range(len(entries))]
    assert plan_buckets(entries, 1 << 30) == [[1, 4], [0, 2, 3, 5], [6], [7]]


# ---------------------------------------------------------------- submission
def test_buckets_fill_in_backward_order_and_close_at_end_of_group() -> None:
    reducer = TwoRanks()
    channel = Channel(lambda: reducer, ordered=True, bucket_bytes=64)
    rng = np.random.default_rng(0)
    # Backward order: t5 (8 B), t4 (40 B), t3 (200 B: bigger than a bucket), t2 (16 B,
    # float16), t1 (24 B), t0 (8 B).
    arrays = [rng.standard_normal(2).astype(np.float32), rng.standard_normal(6).astype(np.float32),
              rng.standard_normal(8).astype(np.float16), rng.standard_normal(50).astype(np.float32),
              rng.standard_normal((2, 5)).astype(np.float32), rng.standard_normal(2).astype(np.float32)]
    slots = _group(channel, arrays)
    submitted = []
    for i in range(len(slots) - 1, -1, -1):
        slots[i].hand_off(arrays[i])
        submitted.append(len(reducer.calls))
    # t5+t4 (48 B) are full (t3 would overflow them) and go as soon as t4 arrives; t3
    # alone; t2 has a dtype of its own; t1+t0 (32 B) are not full and go at the end of
    # the group, when t0, the last tensor of the backward pass, is handed off.
    assert submitted == [0, 1, 2, 3, 3, 4]
    names = [_base(c[0]) for c in reducer.calls]
    assert names == ["bucket:g/5..g/4", "g/3", "g/2", "bucket:g/1..g/0"]
    assert [(str(c[1]), c[2]) for c in reducer.calls] == [("float32", 12), ("float32", 50), ("float16", 8),
                                                          ("float32", 8)]
    assert not any(s.handle.done() for s in slots)  # each handle completes with its bucket
    reducer.release()
    for slot, array in zip(slots, arrays):
        got = slot.wait(5)
        assert got.shape == array.shape and got.dtype == array.dtype
        np.testing.assert_array_equal(got, array * 2)


def test_second_step_reuses_buckets() -> None:
    reducer = TwoRanks()
    channel = Channel(lambda: reducer, ordered=True, bucket_bytes=1 << 20)
    arrays = [np.ones((3, 4), np.float32), np.full(5, 2.0, np.float32)]
    slots = _group(channel, arrays, ops=["mean", "mean"])
    for step in range(3):
        values = [a * (step + 1) for a in arrays]
        _hand_off_all(slots, values)
        reducer.release()
        for slot, value in zip(slots, values):
            np.testing.assert_array_equal(slot.wait(5), value)
    assert [_base(c[0]) for c in reducer.calls] == ["bucket:g/1..g/0"] * 3


def test_ring_default_is_one_tensor_per_bucket() -> None:
    reducer = TwoRanks()
    channel = Channel(lambda: reducer, ordered=False)
    arrays = [np.ones(4, np.float32) for _ in range(5)]
    slots = _group(channel, arrays)
    _hand_off_all(slots, arrays)
    assert [_base(c[0]) for c in reducer.calls] == [f"g/{i}" for i in range(4, -1, -1)]


def test_ordered_default_size_is_the_engines_fusion_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    from hostreduce.config import Config

    reducer = TwoRanks()
    reducer._config = Config(fusion_threshold_bytes=12)  # type: ignore[attr-defined]
    assert Channel(lambda: reducer, ordered=True).resolved_bucket_bytes() == 12
    monkeypatch.setenv("HOSTREDUCE_FUSION_THRESHOLD_BYTES", "4096")
    assert Channel(lambda: TwoRanks(), ordered=True).resolved_bucket_bytes() == 4096
    assert Channel(lambda: TwoRanks(), ordered=True, bucket_bytes=0).resolved_bucket_bytes() == 0
    with pytest.raises(ConfigError, match="bucket_bytes"):
        Channel(lambda: reducer, ordered=True, bucket_bytes=-1)
    with pytest.raises(ConfigError, match="bucket_hook"):
        Channel(lambda: reducer, ordered=True, bucket_hook=42)  # type: ignore[arg-type]


def test_shape_change_of_a_fused_tensor_is_refused() -> None:
    from hostreduce.errors import HostReduceError

    channel = Channel(lambda: TwoRanks(), ordered=True, bucket_bytes=1 << 20)
    slots = _group(channel, [np.ones(4, np.float32), np.ones(4, np.float32)])
    with pytest.raises(HostReduceError, match="shape"):
        slots[1].hand_off(np.ones(5, np.float32))


# ---------------------------------------------------------------- the hook
def test_channel_hook_is_called_per_bucket_and_can_scale() -> None:
    reducer = TwoRanks()
    seen: list[tuple[str, tuple[str, ...], int]] = []

    def halve_then_sum(red: Any, bucket: Any) -> Handle:
        seen.append((bucket.op, bucket.names, bucket.buffer.size))
        bucket.buffer *= 0.5
        return red.allreduce_async(bucket.name, bucket.buffer, op="sum", out=bucket.buffer)

    channel = Channel(lambda: reducer, ordered=True, bucket_bytes=32, bucket_hook=halve_then_sum)
    arrays = [np.full(4, float(i + 1), np.float32) for i in range(6)]  # 16 B each: two per bucket
    slots = _group(channel, arrays)
    _hand_off_all(slots, arrays)
    reducer.release()
    assert seen == [("sum", ("g/5", "g/4"), 8), ("sum", ("g/3", "g/2"), 8), ("sum", ("g/1", "g/0"), 8)]
    for slot, array in zip(slots, arrays):
        np.testing.assert_array_equal(slot.wait(5), array)  # halved, then summed over two ranks


def test_registered_hook_may_return_another_array_and_dtype() -> None:
    """A compression hook: float16 on the wire, the result copied back into the bucket."""
    reducer = TwoRanks()
    sizes: list[int] = []

    def fp16(red: Any, bucket: Any) -> Handle:
        sizes.append(bucket.nbytes)
        return red.allreduce_async(bucket.name, bucket.buffer.astype(np.float16), op=bucket.op)

    previous = register_bucket_hook(fp16)
    try:
        channel = Channel(lambda: reducer, ordered=True, bucket_bytes=1 << 20)
        arrays = [np.full((2, 3), 1.5, np.float32), np.full(3, -0.25, np.float32)]
        slots = _group(channel, arrays)
        _hand_off_all(slots, arrays)
        reducer.release()
        assert sizes == [36] and [(_base(c[0]), *c[1:]) for c in reducer.calls] == [
            ("bucket:g/1..g/0", np.dtype(np.float16), 9)]
        for slot, array in zip(slots, arrays):
            got = slot.wait(5)
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, array * 2)
    finally:
        assert register_bucket_hook(previous) is fp16
    with pytest.raises(ConfigError, match="hook"):
        register_bucket_hook("not callable")  # type: ignore[arg-type]


def test_hook_failure_reaches_every_tensor_of_the_bucket() -> None:
    reducer = TwoRanks()

    def wrong_size(red: Any, bucket: Any) -> Handle:
        handle = Handle(bucket.name)
        handle.set_result(np.zeros(bucket.buffer.size + 1, bucket.buffer.dtype))
        return handle

    from hostreduce.errors import HostReduceError

    channel = Channel(lambda: reducer, ordered=True, bucket_bytes=1 << 20, bucket_hook=wrong_size)
    arrays = [np.ones(2, np.float32), np.ones(3, np.float32)]
    slots = _group(channel, arrays)
    _hand_off_all(slots, arrays)
    for slot in slots:
        with pytest.raises(HostReduceError, match="elements"):
            slot.wait(5)


# ---------------------------------------------------------------- in a tf.function
@pytest.mark.tf
def test_exchange_in_a_graph_submits_one_collective_per_bucket() -> None:
    import tensorflow as tf

    from hostreduce.streaming import exchange

    reducer = TwoRanks()

    def hook(red: Any, bucket: Any) -> Handle:
        handle = red.allreduce_async(bucket.name, bucket.buffer, op=bucket.op, out=bucket.buffer)
        red.release()
        return handle

    channel = Channel(lambda: reducer, ordered=True, timeout_s=30, bucket_bytes=1 << 20, bucket_hook=hook)
    values = [tf.ones((3, 2)), tf.fill([4], 2.0), tf.cast(tf.range(3), tf.float16), tf.fill([5], 3.0)]
    collectives = [Collective("allreduce", f"t/{i}", "sum") for i in range(len(values))]

    @tf.function
    def step(scale: Any) -> list[Any]:
        return exchange(channel, [v * tf.cast(scale, v.dtype) for v in values], collectives)

    for scale in (1.0, 3.0):
        got = step(tf.constant(scale))
        for g, v in zip(got, values):
            np.testing.assert_allclose(g.numpy(), 2 * scale * v.numpy())
    # Per step: one float32 bucket of three tensors and the float16 tensor on its own.
    assert sorted(_base(c[0]) for c in reducer.calls) == sorted(["bucket:t/3..t/0", "t/2"] * 2)


# ---------------------------------------------------------------- MPI training
_MPI_SKIP = mpi_skip_reason()
STEPS = 12
# The MLP's gradients in backward order: bias 5, kernel 32x5, bias 32, kernel 32x32,
# bias 32, kernel 12x32 (float32). At 2048 bytes: [20+640+128] [4096, bigger than a
# bucket] [128+1536]: three buckets for six tensors.
GRAD_BYTES = [20, 640, 128, 4096, 128, 1536]
RUNS = {"sgd@0": 6, "sgd@2048": 3, "adam@2048": 3, "sgd@default": 1}


@pytest.mark.mpi
@pytest.mark.tf
@pytest.mark.slow
@pytest.mark.skipif(_MPI_SKIP is not None, reason=_MPI_SKIP or "")
def test_mpi_training_one_collective_per_bucket(tmp_path: Path) -> None:
    from tests.mpi_workers.mpi_launch import run_mpi
    from tests.tf_workers import tf_common as common

    for size in (0, 2048):
        entries = [(("f4", "mean"), n) for n in GRAD_BYTES]
        assert len(plan_buckets(entries, size)) == RUNS[f"sgd@{size}"]
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "HOSTREDUCE_SECRET")}
    code, out = run_mpi("mpi", 2, "bucket_train.py", ",".join(RUNS), str(STEPS), str(tmp_path), timeout=300,
                        env=env)
    assert code == 0, out
    reference = {opt: common.train_weights(None, opt, STEPS) for opt in ("sgd", "adam")}
    for run, buckets in RUNS.items():
        for rank in range(2):
            assert f"OK {run} rank {rank}/2" in out, out
            got = common.load_result(str(tmp_path / f"{run}-rank{rank}.npz"))
            want = reference[run.split("@")[0]]
            for key, value in want.items():
                scale = max(float(np.max(np.abs(value))), 1e-12)
                err = float(np.max(np.abs(got[key].astype(np.float64) - value))) / scale
                assert err <= 1e-5, f"{run} rank {rank}: {key} differs, relative error {err:.3g}"
            counts = json.loads((tmp_path / f"{run}-rank{rank}.json").read_text())
            steps = counts["steps"]
            assert steps == STEPS
            # Every gradient all-reduce the MPI engine ran came from a bucket, one per bucket.
            assert counts["engine"]["allreduce/grad"] == buckets * steps, (run, counts["engine"])
            assert len(counts["buckets"]) == buckets * steps
            assert sum(b[1] for b in counts["buckets"]) == len(GRAD_BYTES) * steps
        # Both ranks closed the same buckets in the same order.
        orders = [json.loads((tmp_path / f"{run}-rank{r}.json").read_text())["buckets"] for r in range(2)]
        assert orders[0] == orders[1]


def test_a_wait_on_a_tensor_waits_on_its_buckets_engine_handle() -> None:
    """Engines act on waits (the ring tells its peers this rank is blocked, which turns a
    deadlock into an error within a second), so a tensor's wait reaches the engine's."""
    waited: list[str] = []

    class Watched(Handle):
        __slots__ = ()

        def wait(self, timeout: float | None = None) -> Any:
            waited.append(self.name)
            return super().wait(timeout)

    class Reducer(TwoRanks):
        def allreduce_async(self, name: str, array: np.ndarray, op: str = "sum", out: Any = None) -> Handle:
            handle = Watched(name)
            self.pending.append((handle, array, op, out))
            return handle

    reducer = Reducer()
    channel = Channel(lambda: reducer, ordered=True, bucket_bytes=1 << 20)
    arrays = [np.ones(3, np.float32), np.ones(5, np.float32)]
    slots = _group(channel, arrays)
    _hand_off_all(slots, arrays)
    with pytest.raises(Exception, match="did not complete"):
        slots[0].wait(0.05)
    assert waited, "the engine's handle was never waited on"
    reducer.release()
    np.testing.assert_array_equal(slots[1].wait(1), 2 * arrays[1])


def _base(name: str) -> str:
    """A bucket's name without the signature of its members' shapes."""
    return name.split("#")[0]


def test_bucket_names_carry_the_members_shapes() -> None:
    """Ranks whose tensors have the same size but other shapes submit buckets of other
    names (a lone tensor goes in its own shape), so the engines refuse to reduce them
    together (Horovod refuses it too)."""
    names = []
    for shape in ((17, 6), (6, 17)):
        reducer = TwoRanks()
        channel = Channel(lambda r=reducer: r, ordered=True, bucket_bytes=1 << 20)
        arrays = [np.ones(shape, np.float32), np.ones(3, np.float32)]
        slots = _group(channel, arrays)
        _hand_off_all(slots, arrays)
        reducer.release()
        names.append(reducer.calls[0][0])
    assert _base(names[0]) == _base(names[1]) and names[0] != names[1], names
    reducer = TwoRanks()
    channel = Channel(lambda: reducer, ordered=False)
    slots = _group(channel, [np.ones((17, 6), np.float32)])
    _hand_off_all(slots, [np.ones((17, 6), np.float32)])
    reducer.release()
    assert reducer.calls[0][0] == "g/0", reducer.calls


def test_exchange_on_the_ring_fuses_runs_of_small_tensors_into_one_op_pair_and_one_collective() -> None:
    """On an engine that negotiates by name (``ordered=False``), ``exchange`` gives each run
    of consecutive small all-reduces (``SMALL_BUCKET_BYTES`` together) one bucket, one
    hand-off op and one wait op; a larger tensor goes alone. The MNIST model's shapes:
    six gradients become two collectives and four ops, in a ``tf.function`` and in a TF1
    graph, with every result in its own shape."""
    import tensorflow as tf

    from hostreduce.streaming import exchange
    from hostreduce.streaming.handoff import SMALL_BUCKET_BYTES

    shapes = [(784, 256), (256,), (256, 128), (128,), (128, 10), (10,)]  # creation order
    assert 784 * 256 * 4 > SMALL_BUCKET_BYTES > sum(4 * int(np.prod(s)) for s in shapes[1:])
    values = [np.random.default_rng(i).normal(size=s).astype(np.float32) for i, s in enumerate(shapes)]

    class Instant(TwoRanks):
        def allreduce_async(self, name: str, array: np.ndarray, op: str = "sum", out: Any = None) -> Handle:
            handle = super().allreduce_async(name, array, op, out)
            self.release()
            return handle

    def check(results: list[np.ndarray], reducer: Instant, steps: int) -> None:
        """The results, and two collectives per step: the big kernel alone, the rest fused."""
        assert all(np.array_equal(r, 2 * v) for r, v in zip(results, values))
        assert len(reducer.calls) == 2 * steps
        bucket, kernel = sorted(reducer.calls[-2:])
        assert kernel == ("g/0", np.float32, 784 * 256), kernel
        assert bucket[0].startswith("bucket:g/5..g/1#"), bucket
        assert bucket[2] == sum(int(np.prod(s)) for s in shapes[1:]), bucket

    reducer = Instant()
    channel = Channel(lambda: reducer, ordered=False)
    collectives = [Collective("allreduce", f"g/{i}", "sum") for i in range(len(shapes))]
    step = tf.function(lambda *xs: exchange(channel, list(xs), collectives))
    for n in range(1, 4):
        check([r.numpy() for r in step(*values)], reducer, n)
    ops = [op for op in step.get_concrete_function(*values).graph.get_operations() if op.type == "PyFunc"
           or op.type == "PyFuncStateless" or op.type == "EagerPyFunc"]
    assert len(ops) == 4, [op.name for op in ops]
    assert len(reducer.calls) == 6

    reducer = Instant()
    channel = Channel(lambda: reducer, ordered=False)
    graph = tf.Graph()
    with graph.as_default():
        results = exchange(channel, [tf.constant(v) for v in values], collectives)
    assert [r.shape.as_list() for r in results] == [list(s) for s in shapes]
    with tf.compat.v1.Session(graph=graph) as session:
        check(session.run(results), reducer, 1)
