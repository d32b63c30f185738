"""Async checkpoints are a consistent cut of every ps: while workers push without pause,
each checkpoint's shards hold the same pushes of every worker on every ps (a variable
on one ps has been applied exactly as often as one on the other, both being in every
push), and the values the chief pulls for its own checkpoint are the shards' bit for
bit. The pause that makes the cut (``hostreduce/ps/cut.py``) lets through exactly the
pushes another ps has applied, waits for no worker that is gone, and fails with a named
error, applies going on, when a push never comes."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from hostreduce.errors import CollectiveTimeoutError, PeerLostError
from hostreduce.ps import SGD, checkpoint
from hostreduce.ps.cut import ApplyGate
from tests.ps_helpers import LocalCluster, model_values, worker_grads

pytestmark = pytest.mark.timeout(120)


def _in_thread(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except BaseException as e:  # noqa: BLE001 - checked by the caller
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_pause_waits_for_the_apply_in_progress_and_holds_later_pushes():
    gate = ApplyGate(0)
    gate.enter(1, True, 5.0)                       # worker 1's push is being applied
    t, out = _in_thread(gate.pause, {}, 30.0, set)
    t.join(0.05)  # blocked: never passes by itself (still applying)
    assert t.is_alive()
    gate.leave(1, True)
    t.join(30)
    assert out == [{1: 1}]
    held, got = _in_thread(gate.enter, 2, True, 30.0)   # worker 2 arrives while paused: held
    held.join(0.05)  # blocked: never passes by itself
    assert held.is_alive()
    gate.resume()
    held.join(30)
    assert got == [None] and gate._applying == 1


def test_until_lets_through_exactly_the_pushes_another_ps_applied():
    gate = ApplyGate(1)
    gate.pause({}, 5.0, set)
    t, out = _in_thread(gate.enter, 0, True, 30.0)  # worker 0's push, applied on the other ps already
    t.join(0.05)  # blocked: never passes by itself
    assert t.is_alive()
    p, settled = _in_thread(gate.pause, {0: 1}, 30.0, set)
    t.join(30)
    assert out == [None]                            # let through
    gate.leave(0, True)
    p.join(30)
    assert settled == [{0: 1}]
    later, got = _in_thread(gate.enter, 0, True, 30.0)  # its next push waits for the resume
    later.join(0.05)  # blocked: never passes by itself
    assert later.is_alive()
    gate.resume()
    later.join(30)
    assert got == [None]


def test_a_push_that_never_comes_fails_the_cut_by_name_unless_its_worker_is_gone():
    gate = ApplyGate(1)
    with pytest.raises(CollectiveTimeoutError, match=r"worker 2's push #3 \(another ps has applied it\)"):
        gate.pause({2: 3}, 0.2, set)
    assert gate.pause({2: 3}, 30.0, lambda: {2}) == {}  # lost or done: not waited for
    with pytest.raises(CollectiveTimeoutError, match="waited 0.1 s for the chief's checkpoint"):
        gate.enter(0, True, 0.1)
    gate.abort("the chief ended the job")
    with pytest.raises(PeerLostError, match="stopped serving"):
        gate.enter(0, True, 30.0)


def _shards(directory: str, step: int) -> list[dict[str, np.ndarray]]:
    out = []
    for m in range(2):
        with np.load(checkpoint.shard_path(directory, step, m, 2)) as f:
            out.append({k: f[k] for k in f.files})
    return out


def test_async_checkpoints_taken_while_workers_push_are_consistent_cuts(tmp_path):
    cluster = LocalCluster(2, 3, mode="async", timeout_s=30.0)
    stop = threading.Event()
    try:
        chief = cluster.client(0, timeout_s=30.0)
        placement = chief.register(model_values(), SGD(0.01), shard_bytes=20_000, model_dir=str(tmp_path))
        kernel_ps, bias_ps = placement["dense/kernel"].ps, placement["dense/bias"].ps
        assert kernel_ps != bias_ps and placement["emb"].sharded  # both ps are in every push
        workers = [cluster.client(r, timeout_s=30.0) for r in (1, 2)]
        for c in workers:
            c.wait_ready()
        pushed = {1: 0, 2: 0}

        def train(rank: int) -> None:
            c = workers[rank - 1]
            while not stop.is_set():
                pushed[rank] += 1
                c.push(*worker_grads(rank, pushed[rank]), step=pushed[rank])

        threads = [_in_thread(train, r) for r in (1, 2)]
        taken = []
        for step in range(1, 9):
            chief.push(*worker_grads(0, step), step=step)
            values = chief.cut(step, ["dense/kernel", "dense/bias"])
            chief.save(str(tmp_path), step)
            shards = _shards(str(tmp_path), step)
            counts = {name: int(shards[m][f"{name}/@iterations"])
                      for name, m in (("dense/kernel", kernel_ps), ("dense/bias", bias_ps))}
            emb = [int(shards[m]["emb/@iterations"]) for m in range(2)]
            taken.append((counts, emb))
            # one point: every push is in both shards or in neither
            assert counts["dense/kernel"] == counts["dense/bias"] == emb[0] == emb[1], (step, counts, emb)
            for name, m in (("dense/kernel", kernel_ps), ("dense/bias", bias_ps)):
                assert values[name].tobytes() == shards[m][name].tobytes(), (step, name)
        stop.set()
        for t, out in threads:
            t.join(60)
            assert out == [None], out  # no worker's push failed for the pauses
        # the other workers pushed meanwhile (the cuts fell among their pushes)
        assert taken[-1][0]["dense/kernel"] > 8 + 2 and os.path.exists(os.path.join(tmp_path, checkpoint.INDEX))
        for c in workers:
            c.close()
        chief.shutdown()
    finally:
        stop.set()
        cluster.stop_and_join()


def test_only_the_chief_pauses_and_resumes_and_a_bad_until_is_refused():
    from hostreduce.errors import ConfigError, RoleError
    from hostreduce.ps import wire

    cluster = LocalCluster(1, 2, mode="async")
    try:
        chief = cluster.client(0)
        chief.register(model_values(), SGD(0.01), shard_bytes=20_000)
        other = cluster.client(1)
        other.wait_ready()
        for method in ("Pause", "Resume"):
            with pytest.raises(RoleError, match=f"only the chief \\(worker 0\\) may call {method}"):
                other._call(method, {0: wire.pack({})})
        for until in ({"7": 1}, {"0": -1}, [1]):
            with pytest.raises(ConfigError, match="`until` of Pause"):
                chief._call("Pause", {0: wire.pack({"until": until})})
        other.push(*worker_grads(1, 1), step=1)  # nothing was left paused
        assert other.info()["step"] == 0
    finally:
        cluster.stop_and_join()
