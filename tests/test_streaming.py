"""Streaming hand-off: gradients reach the reducer while the backward pass still runs,
last layer first; the timeline records it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tf_workers import tf_common as common

pytestmark = [pytest.mark.tf, pytest.mark.slow]

STEPS = 6


def _check_rank(events: list[dict], rank: int) -> None:
    spans = [e for e in events if e.get("ph") == "X"]
    backward = [e for e in spans if e["name"] == "backward"]
    reductions = [e for e in spans if e["cat"] == "reduce" and e["name"].startswith("allreduce")]
    handoffs = [e for e in spans if e["cat"] == "handoff"]
    assert len(backward) == STEPS and len(reductions) == STEPS * 18 and len(handoffs) == STEPS * 18
    assert {e["name"] for e in spans} >= {"forward", "backward", "wait and apply (per gradient)"}
    overlapped = 0
    for bwd in backward[1:]:  # the first step includes start-up work
        start, end = bwd["ts"], bwd["ts"] + bwd["dur"]
        this_step = sorted((e for e in reductions if start <= e["ts"] <= end + 1e6), key=lambda e: e["ts"])
        assert this_step, f"rank {rank}: no reduction for the step at {start}"
        if this_step[0]["ts"] < end:
            overlapped += 1
    # Backward order: the output layer's gradients are handed off before the input layer's.
    # Steps run one after another (a step's host apply waits for all its 18 reductions),
    # so the hand-offs sorted by time fall into consecutive groups of 18. (The order in
    # which the engine then starts the reductions depends on when every rank has
    # announced each one, not on this rank's backward pass.)
    in_time = sorted(handoffs, key=lambda e: e["ts"])
    exact = 0
    for k in range(1, STEPS):  # the first step includes start-up work
        order = [e["args"]["index"] for e in in_time[18 * k: 18 * (k + 1)]]
        # (TensorFlow may schedule the small bias gradients late; the kernels, 0..16 even,
        # must still come output layer first.) On a loaded machine TensorFlow's executor
        # may run a kernel's gradient late (seen: two swapped neighbours in one step,
        # [16, 12, 14, 10, 8, 6, 2, 4, 0]): every step keeps seven of the nine in backward
        # order (hand-offs all made after the backward pass, in creation order, keep one),
        # and all but one step have the output layer's gradients first.
        kernels = [i for i in order if i % 2 == 0]
        assert _longest_decreasing(kernels) >= len(kernels) - 2, f"rank {rank}: hand-off order {order}"
        exact += order[0] >= 16 and kernels.index(0) >= 6 and kernels.index(16) <= 2
    assert exact >= STEPS - 2, f"rank {rank}: output layer first in {exact} of {STEPS - 1} steps"
    assert overlapped >= len(backward[1:]) - 1, f"rank {rank}: reductions started after the backward pass"
    # The forward/backward boundary is where the loss is ready: the backward pass starts
    # there, so each step's first hand-off falls inside its backward span.
    handed = sorted(handoffs, key=lambda e: e["ts"])
    inside = 0
    for k, bwd in enumerate(backward[1:], start=1):
        assert bwd["dur"] > 0, f"rank {rank}: empty backward span in step {k}"
        first = handed[18 * k]["ts"]
        inside += bwd["ts"] <= first <= bwd["ts"] + bwd["dur"]
    assert inside >= len(backward[1:]) - 1, f"rank {rank}: first hand-off outside the backward pass"


def _longest_decreasing(seq: list[int]) -> int:
    best = [1] * len(seq)
    for i in range(len(seq)):
        for j in range(i):
            if seq[j] > seq[i]:
                best[i] = max(best[i], best[j] + 1)
    return max(best, default=0)


def test_reductions_start_during_backward(tmp_path: Path) -> None:
    from hostreduce.testing import run_ranks

    results = run_ranks(common.streaming_rank, 2, args=(str(tmp_path), STEPS), timeout=150)
    for rank, events in enumerate(results):
        _check_rank(events, rank)
        on_disk = json.loads((tmp_path / f"timeline-rank{rank}.json").read_text())["traceEvents"]
        assert len(on_disk) == len(events)


def test_timeline_from_env_and_disabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hostreduce.timeline import Timeline, timeline_dir_from_env

    monkeypatch.delenv("HOSTREDUCE_TIMELINE", raising=False)
    off = Timeline(timeline_dir_from_env(), rank=0)
    with off.scope("forward", "compute"):
        pass
    off.flush()
    assert not off.enabled and off.events() == [] and off.path is None
    monkeypatch.setenv("HOSTREDUCE_TIMELINE", str(tmp_path))
    on = Timeline(timeline_dir_from_env(), rank=3)
    with on.scope("host apply", "apply"):
        pass
    on.span("allreduce w", 1.0, 5.0, "reduce", on.reduce_row("w"))
    on.flush()
    events = json.loads((tmp_path / "timeline-rank3.json").read_text())["traceEvents"]
    assert {e["name"] for e in events if e["ph"] == "X"} == {"host apply", "allreduce w"}
    assert all(e["pid"] == 3 for e in events)


def test_ordered_handoffs_keep_their_order_in_a_tf1_session() -> None:
    """An ordered engine (MPI, Horovod's core ops) gets a group's hand-offs in one order,
    last tensor first, also in a TF1 graph run by a ``Session``, whose executor orders
    no stateful ops by itself: each hand-off has a control dependency on the one before
    it, and the engine sees the same order at every run."""
    import numpy as np
    import tensorflow as tf

    from hostreduce.reducers.local import LocalReducer
    from hostreduce.streaming import Channel, Collective, exchange

    class Recording(LocalReducer):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def _broadcast_async(self, name, arr, root, group):  # type: ignore[no-untyped-def]
            self.names.append(name)
            return super()._broadcast_async(name, arr, root, group)

    reducer = Recording()
    count = 12
    graph = tf.Graph()
    with graph.as_default():
        values = [tf.constant(np.full((i + 1,), i, np.float32)) for i in range(count)]
        results = exchange(Channel(lambda: reducer, ordered=True), values,
                           [Collective("broadcast", f"b/{i}") for i in range(count)])
    handoffs = {op.name: op for op in graph.get_operations() if op.name.startswith("hostreduce_handoff_")}
    for i in range(count - 1):
        assert [op.name for op in handoffs[f"hostreduce_handoff_{i}"].control_inputs] == \
            [f"hostreduce_handoff_{i + 1}"]
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=8)
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        for _ in range(5):
            reducer.names.clear()
            out = session.run(results)
            assert reducer.names == [f"b/{i}" for i in range(count - 1, -1, -1)]
            assert all(np.array_equal(o, np.full((i + 1,), i, np.float32)) for i, o in enumerate(out))


def test_host_collectives_of_one_call_keep_their_order_in_a_tf1_session() -> None:
    """Host ops created inside ``in_order()`` (one call's collectives on a process set)
    run in creation order in a TF1 ``Session`` too; outside it they stay independent."""
    import numpy as np
    import tensorflow as tf

    from hostreduce.reducers.local import LocalReducer
    from hostreduce.streaming import Channel
    from hostreduce.streaming.host_collective import host_collective, in_order

    seen: list[int] = []
    channel = Channel(LocalReducer, ordered=True)
    count = 12
    graph = tf.Graph()
    with graph.as_default():
        def one(i: int, value: object) -> object:
            return host_collective(channel, f"c{i}", lambda r, a, i=i: seen.append(i) or [a[0]], [value],
                                   [tf.float32], [tf.TensorShape([i + 1])])[0]

        with in_order():
            outs = [one(i, tf.constant(np.full((i + 1,), i, np.float32))) for i in range(count)]
        loose = one(count, tf.constant(np.zeros(count + 1, np.float32)))
    for i in range(1, count):
        assert outs[i].op.control_inputs == [outs[i - 1].op]
    assert outs[0].op.control_inputs == [] and loose.op.control_inputs == []
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=8)
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        for _ in range(5):
            seen.clear()
            values = session.run(outs)
            assert seen == list(range(count))
            assert all(np.array_equal(v, np.full((i + 1,), i, np.float32)) for i, v in enumerate(values))


def test_host_callbacks_of_a_traced_step_run_unconverted() -> None:
    """A step traced with AutoGraph (``tf.function``'s default) converts what it calls;
    hostreduce's entry points stop that, so the host callbacks that run at every step
    (hand-off, wait, host collectives) run as written, not as AutoGraph's converted
    code (which cost several times the collective's own CPU)."""
    import inspect

    import numpy as np
    import tensorflow as tf

    from hostreduce.reducers.local import LocalReducer
    from hostreduce.streaming import Channel, Collective, exchange
    from hostreduce.streaming.host_collective import host_collective

    converted: list[str] = []

    def note() -> None:
        converted.extend(f.function for f in inspect.stack(0) if "__autograph_generated" in f.filename)

    class Watching(LocalReducer):
        def _allreduce_async(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            note()
            return super()._allreduce_async(*args, **kwargs)

    reducer = Watching()
    channel = Channel(lambda: reducer, ordered=False)

    def add_one(_reducer: object, arrays: list[np.ndarray]) -> list[np.ndarray]:
        note()
        return [arrays[0] + 1.0]

    def users_helper(x: tf.Tensor) -> list[tf.Tensor]:  # converted by the step's AutoGraph
        reduced, _ = exchange(channel, [x, 2.0 * x], [Collective("allreduce", "a"), Collective("allreduce", "b")],
                              statuses=True)
        plain = exchange(channel, [x], [Collective("allreduce", "c")])
        hosted = host_collective(channel, "h", add_one, [x], [tf.float32], [x.shape])
        return reduced + plain + hosted

    step = tf.function(lambda x: users_helper(x))
    for _ in range(3):
        out = step(tf.constant(np.arange(4, dtype=np.float32)))
    assert [o.numpy().tolist() for o in out] == [[0, 1, 2, 3], [0, 2, 4, 6], [0, 1, 2, 3], [1, 2, 3, 4]]
    assert converted == [], f"converted frames in the host callbacks: {converted}"
