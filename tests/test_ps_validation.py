"""What a parameter server accepts from an authenticated worker (a buggy or compromised
one): every malformed push and pull is refused with a named error before anything
changes (async and sync; in sync mode every worker of the step gets the same error),
NaN/Inf gradients are applied or refused as configured, and control calls are limited
to the chief, under its ``model_dir``, at steps the ps has reached. After the refusals
the job trains on to exactly the values of an undisturbed run, and every ps ends."""
from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import pytest

from hostreduce.errors import (ConfigError, NonFiniteGradientError, RoleError, TensorMismatchError)
from hostreduce.ps import SGD, Adam, wire
from tests.ps_helpers import EMB_DIM, LocalCluster, assert_same_bits, model_values, worker_grads

pytestmark = pytest.mark.timeout(120)

K = np.ones((16, 4), np.float32)       # a valid gradient of dense/kernel
IDS = np.array([0, 3], np.int64)       # valid local row ids of emb on any ps
ROWS = np.ones((2, EMB_DIM), np.float32)


def _case(dense: list, dense_arrays: list, rows: list, rows_arrays: list) -> tuple[dict, list]:
    return {"dense": dense, "rows": rows}, dense_arrays + rows_arrays


# name -> (header, arrays, error class, text the error must contain). Each starts with a
# valid part (the kernel's gradient, emb's rows) so that a partial apply would show.
BAD_PUSHES: dict[str, tuple[dict, list, type, str]] = {
    "unknown second name": (*_case(["dense/kernel", "nope"], [K, K], ["emb"], [IDS, ROWS]),
                            ConfigError, "holds no variable 'nope'"),
    "broadcastable (4,) gradient": (*_case(["dense/kernel"], [np.ones(4, np.float32)], ["emb"], [IDS, ROWS]),
                                    TensorMismatchError, "must have shape (16, 4)"),
    "broadcastable (1,) gradient": (*_case(["dense/kernel"], [np.ones(1, np.float32)], [], []),
                                    TensorMismatchError, "must have shape (16, 4)"),
    "float64 gradient": (*_case(["dense/kernel"], [K.astype(np.float64)], [], []),
                         TensorMismatchError, "dtype float32"),
    "int32 gradient": (*_case(["dense/kernel"], [K.astype(np.int32)], [], []),
                       TensorMismatchError, "dtype float32"),
    "NaN row id": (*_case(["dense/kernel"], [K], ["emb"], [np.array([np.nan]), ROWS[:1]]),
                   ConfigError, "must be integers"),
    "fractional row id": (*_case(["dense/kernel"], [K], ["emb"], [np.array([1.5]), ROWS[:1]]),
                          ConfigError, "must be integers"),
    "2-D row ids": (*_case(["dense/kernel"], [K], ["emb"], [IDS.reshape(2, 1), ROWS]),
                    ConfigError, "must be a 1-D array"),
    "row id past the end": (*_case(["dense/kernel"], [K], ["emb"], [np.array([0, 10**6]), ROWS]),
                            ConfigError, "must be in [0,"),
    "negative row id": (*_case(["dense/kernel"], [K], ["emb"], [np.array([-1, 0]), ROWS]),
                        ConfigError, "must be in [0,"),
    "rows of another width": (*_case(["dense/kernel"], [K], ["emb"], [IDS, np.ones((2, 4), np.float32)]),
                              TensorMismatchError, "one row per id"),
    "fewer rows than ids": (*_case(["dense/kernel"], [K], ["emb"], [IDS, ROWS[:1]]),
                            TensorMismatchError, "one row per id"),
    "float64 rows": (*_case(["dense/kernel"], [K], ["emb"], [IDS, ROWS.astype(np.float64)]),
                     TensorMismatchError, "dtype float32"),
    "arrays missing": (*_case(["dense/kernel"], [K], ["emb"], [IDS]), TensorMismatchError, "arrays for"),
    "names not a list": ({"dense": "dense/kernel", "rows": []}, [K], ConfigError, "list of variable names"),
    "a name twice": (*_case(["dense/kernel", "dense/kernel"], [K, K], [], []), ConfigError, "each variable once"),
    "dense and rows at once": (*_case(["dense/kernel"], [K], ["dense/kernel"], [np.array([0]), K[:1]]),
                               ConfigError, "both as dense and as rows"),
}


def _kernel_ps(client: Any) -> int:
    return client.placement["dense/kernel"].ps


def _good_pushes(client: Any, steps: range, sync: bool) -> None:
    for step in steps:
        client.push(*worker_grads(0, step), step=step if sync else None)


def _registered(cluster: LocalCluster, config: Any = None, **kwargs: Any) -> list:
    clients = [cluster.client(r) for r in range(cluster.num_workers)]
    clients[0].register(model_values(), config or Adam(0.01), shard_bytes=20_000, **kwargs)
    for c in clients[1:]:
        c.wait_ready()
    return clients


def test_async_a_malformed_push_of_each_kind_changes_nothing_and_the_job_ends_as_undisturbed():
    undisturbed = LocalCluster(2, 1, mode="async")
    try:
        _good_pushes(_registered(undisturbed)[0], range(1, 4), sync=False)
        expected = undisturbed.snapshots()
    finally:
        undisturbed.stop_and_join()
    cluster = LocalCluster(2, 1, mode="async")
    try:
        c = _registered(cluster)[0]
        m = _kernel_ps(c)
        _good_pushes(c, range(1, 2), sync=False)
        for name, (header, arrays, error, text) in BAD_PUSHES.items():
            before = cluster.snapshots()
            with pytest.raises(error, match=None) as info:
                c._call("Push", {m: wire.pack(header, arrays)})
            assert text in str(info.value) and f"ps task {m}" in str(info.value), (name, str(info.value))
            assert_same_bits(cluster.snapshots(), before)
        _good_pushes(c, range(2, 4), sync=False)
        assert_same_bits(cluster.snapshots(), expected)
    finally:
        cluster.stop_and_join()


def _arrived(server: Any, rank: int) -> threading.Event:
    """Set once ``rank``'s push has joined ``server``'s step (it then waits for the others)."""
    event = threading.Event()
    enter = server.barrier._enter

    def watched(r: int, step: int) -> None:
        enter(r, step)
        if r == rank:
            event.set()

    server.barrier._enter = watched
    return event


@pytest.mark.parametrize("bad_last", [False, True], ids=["bad-first", "bad-last"])
@pytest.mark.parametrize("case", ["unknown second name", "broadcastable (4,) gradient", "NaN row id",
                                  "2-D row ids", "fractional row id"])
def test_sync_a_malformed_push_fails_its_step_for_every_worker_with_one_error(case: str, bad_last: bool):
    """Worker 1 pushes a malformed step 1 to the ps holding the kernel (and a valid
    empty one to the other ps), worker 0 a valid one: both get the same error whichever
    came first, and nothing of step 1 is applied on that ps."""
    header, arrays, error, text = BAD_PUSHES[case]
    cluster = LocalCluster(2, 2, timeout_s=30.0)
    try:
        c0, c1 = _registered(cluster)
        m = _kernel_ps(c0)
        before = cluster.snapshots()[m]
        joined = _arrived(cluster.servers[m], 0)
        got: dict[int, BaseException] = {}

        def good() -> None:
            try:
                c0.push({"dense/kernel": K}, {"emb": (IDS, ROWS)}, step=1)
            except Exception as e:  # noqa: BLE001 - checked below
                got[0] = e

        thread = threading.Thread(target=good)
        if bad_last:
            thread.start()
            assert joined.wait(30)  # a hang guard
        with pytest.raises(error) as info:
            c1._call("Push", {m: wire.pack(dict(header, step=1), arrays),
                              1 - m: wire.pack({"step": 1, "dense": [], "rows": []})})
        got[1] = info.value
        if not bad_last:
            thread.start()
        thread.join(60)
        assert isinstance(got.get(0), error), got
        said = [str(got[r]).split(f"Push on ps task {m} at '{cluster.addresses[m]}': ", 1)[1] for r in (0, 1)]
        assert said[0] == said[1], said
        assert text in said[0] and "worker 1's push was refused, nothing of step 1 was applied" in said[0], said
        assert_same_bits([cluster.snapshots()[m]], [before])
        # The step stays failed for everyone: a retry gets the same error.
        with pytest.raises(error, match="worker 1's push was refused"):
            c0._call("Push", {m: wire.pack({"step": 1, "dense": [], "rows": []})})
    finally:
        cluster.stop_and_join()


def test_sync_the_job_trains_on_after_malformed_pushes_refused_before_their_step():
    """A malformed push whose step is not the next one (or has none) is refused alone;
    the job then ends bit for bit as an undisturbed one."""
    undisturbed = LocalCluster(2, 1)
    try:
        _good_pushes(_registered(undisturbed)[0], range(1, 4), sync=True)
        expected = undisturbed.snapshots()
    finally:
        undisturbed.stop_and_join()
    cluster = LocalCluster(2, 1)
    try:
        c = _registered(cluster)[0]
        m = _kernel_ps(c)
        _good_pushes(c, range(1, 2), sync=True)
        header, arrays, _, _ = BAD_PUSHES["unknown second name"]
        for step in (None, "2", 1, 7, True):
            with pytest.raises((ConfigError, TensorMismatchError)):
                c._call("Push", {m: wire.pack(dict(header, step=step), arrays)})
        _good_pushes(c, range(2, 4), sync=True)
        assert_same_bits(cluster.snapshots(), expected)
    finally:
        cluster.stop_and_join()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_malformed_pulls_are_refused_and_change_nothing(mode: str):
    cluster = LocalCluster(2, 1, mode=mode)
    try:
        c = _registered(cluster)[0]
        before = cluster.snapshots()
        bad = {"NaN id": (["emb"], [np.array([np.nan])], "must be integers"),
               "fractional id": (["emb"], [np.array([1.5])], "must be integers"),
               "2-D ids": (["emb"], [np.zeros((2, 3), np.int64)], "must be a 1-D array"),
               "id past the end": (["emb"], [np.array([10**6])], "must be in [0,"),
               "negative id": (["emb"], [np.array([-5])], "must be in [0,"),
               "unknown name": (["nope"], [np.array([0])], "holds no variable 'nope'"),
               "ids missing": (["emb"], [], "names for 0 id arrays")}
        for name, (names, arrays, text) in bad.items():
            with pytest.raises((ConfigError, TensorMismatchError), match=None) as info:
                c._call("PullRows", {0: wire.pack({"names": names}, arrays)})
            assert text in str(info.value), (name, str(info.value))
        with pytest.raises(ConfigError, match="holds no variable 'nope'"):
            c._call("PullRows", {0: wire.pack({"names": [], "dense": ["nope"]})})
        with pytest.raises(ConfigError, match="holds no variable 'nope'"):
            c._call("PullDense", {0: wire.pack({"names": ["nope"]})})
        with pytest.raises(ConfigError, match="list of variable names"):
            c._call("PullDense", {0: wire.pack({"names": {"a": 1}})})
        with pytest.raises(ConfigError, match="must be integers"):
            c.pull_rows({"emb": np.array([1.5])})   # the client refuses it before sending
        assert_same_bits(cluster.snapshots(), before)
        np.testing.assert_array_equal(c.pull_rows({"emb": np.array([[0, 5], [7, 5]])})["emb"],
                                      model_values()["emb"][[[0, 5], [7, 5]]])
    finally:
        cluster.stop_and_join()


def test_the_client_converts_floating_gradients_and_refuses_the_rest():
    cluster = LocalCluster(2, 1, mode="async")
    reference = LocalCluster(2, 1, mode="async")
    try:
        c, r = _registered(cluster, SGD(0.5))[0], _registered(reference, SGD(0.5))[0]
        g = np.random.default_rng(0).normal(size=(16, 4))
        c.push({"dense/kernel": g})                       # float64: converted on the worker
        r.push({"dense/kernel": g.astype(np.float32)})
        with pytest.raises(TensorMismatchError, match="must be floating point"):
            c.push({"dense/kernel": K.astype(np.int32)})
        with pytest.raises(TensorMismatchError, match=r"must have shape \(16, 4\)"):
            c.push({"dense/kernel": np.ones(4, np.float32)})
        with pytest.raises(ConfigError, match="must be integers"):
            c.push(rows={"emb": (np.array([1.5]), ROWS[:1])})
        assert_same_bits(cluster.snapshots(), reference.snapshots())
    finally:
        cluster.stop_and_join()
        reference.stop_and_join()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_nonfinite_gradients_are_applied_by_default_and_refused_when_asked(mode: str):
    nan = K.copy()
    nan[0, 0] = np.nan
    inf_rows = ROWS.copy()
    inf_rows[1, 2] = np.inf
    step = 1 if mode == "sync" else None
    applies = LocalCluster(1, 1, mode=mode)
    try:
        c = _registered(applies, SGD(0.5))[0]
        c.push({"dense/kernel": nan}, {"emb": (IDS, inf_rows)}, step=step)  # as TensorFlow's optimizers do
        got = c.pull()
        assert np.isnan(got["dense/kernel"][0, 0]) and np.isinf(got["emb"][3, 2])
    finally:
        applies.stop_and_join()
    refuses = LocalCluster(1, 1, mode=mode, nonfinite="refuse")
    try:
        c = _registered(refuses, SGD(0.5))[0]
        before = refuses.snapshots()
        with pytest.raises(NonFiniteGradientError, match=r"'dense/kernel'.*1 NaN, 0 Inf"):
            c.push({"dense/kernel": nan}, step=step)
        if mode == "async":
            with pytest.raises(NonFiniteGradientError, match=r"'emb'.*0 NaN, 1 Inf"):
                c.push({"dense/kernel": K}, {"emb": (IDS, inf_rows)})
        assert_same_bits(refuses.snapshots(), before)
    finally:
        refuses.stop_and_join()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_control_calls_are_the_chiefs_under_its_model_dir_at_reached_steps(tmp_path, mode: str):
    model_dir, outside = tmp_path / "m", tmp_path / "outside"
    model_dir.mkdir()
    outside.mkdir()
    (model_dir / "link").symlink_to(outside)
    cluster = LocalCluster(2, 2, mode=mode)
    try:
        chief, w1 = _registered(cluster, model_dir=str(model_dir))
        before = cluster.snapshots()
        # Another worker cannot hold, open, register, pause, save, restore or end the job.
        for call, text in ((lambda: w1.register(model_values(), Adam(0.01), shard_bytes=20_000, hold=True),
                            "Register from worker 1"),
                           (w1.open, "Open from worker 1"),
                           (lambda: w1.save(str(model_dir), 0), "Pause from worker 1"),  # its cut, first
                           (lambda: w1._call("Save", {0: wire.pack({"dir": str(model_dir), "step": 0})}),
                            "Save from worker 1"),
                           (lambda: w1._call("Restore", {0: wire.pack({"dir": str(model_dir)})}), "Restore from worker 1"),
                           (lambda: w1._call("Shutdown", {0: wire.pack({})}), "Shutdown from worker 1")):
            with pytest.raises(RoleError, match=text):
                call()
        assert all(s._opened and not s._stopped.is_set() for s in cluster.servers)
        w1.wait_ready(5.0)                                # still open to everyone
        # The chief saves only under model_dir, and only at a step the ps reached.
        for directory in (outside, model_dir / ".." / "outside", model_dir / "link", "/tmp"):
            with pytest.raises(RoleError, match="only under model_dir"):
                chief.save(str(directory), 0)
        with pytest.raises(TensorMismatchError, match="asked to save step 1000000000"):
            chief.save(str(model_dir / "ps"), 10**9)
        with pytest.raises(ConfigError, match="`step` of Save"):
            chief._call("Save", {0: wire.pack({"dir": str(model_dir), "step": "3"})})
        with pytest.raises(RoleError, match="model_dir"):
            chief.register(model_values(), Adam(0.01), shard_bytes=20_000, model_dir=str(outside))
        assert_same_bits(cluster.snapshots(), before)
        assert list(outside.iterdir()) == []
        for step in (1, 2):
            pushes = [threading.Thread(target=c.push, args=worker_grads(r, step), kwargs={"step": step})
                      for r, c in enumerate((chief, w1))]
            for t in pushes:
                t.start()
            for t in pushes:
                t.join(30)
        with pytest.raises(TensorMismatchError, match="asked to save step 3"):
            chief.save(str(model_dir / "ps"), 3)
        chief.save(str(model_dir / "ps"), 2)
        assert chief.restore(str(model_dir / "ps")) == 2
        chief.shutdown()
    finally:
        cluster.stop_and_join()


def test_saves_and_restores_need_a_registered_model_dir(tmp_path):
    cluster = LocalCluster(1, 1)
    try:
        c = _registered(cluster)[0]
        with pytest.raises(RoleError, match="register a model_dir first"):
            c.save(str(tmp_path), 0)
        with pytest.raises(RoleError, match="register a model_dir first"):
            c._call("Restore", {0: wire.pack({"dir": str(tmp_path)})})
        assert os.listdir(tmp_path) == []
    finally:
        cluster.stop_and_join()
