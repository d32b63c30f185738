"""Parameter-server core (hostreduce/ps): placement, the host optimizers against Keras,
and a ps cluster of threads in this process: sync equal to global-batch training,
async, authentication, lost ps, checkpoints with re-sharding, traffic of rows."""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from hostreduce.errors import AuthenticationError, CollectiveTimeoutError, ConfigError, PeerLostError
from hostreduce.ps import SGD, Adagrad, Adam, VarSpec, from_keras, locate, place, sum_duplicates
from hostreduce.ps import checkpoint
from hostreduce.ps import wire
from hostreduce.ps.barrier import StepBarrier
from tests.ps_helpers import LocalCluster, keras_reference, max_rel, model_values, worker_grads

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------------- placement
def _specs():
    return [VarSpec("emb", (1000, 64)), VarSpec("big", (300, 1000)), VarSpec("k1", (64, 64)), VarSpec("k2", (128, 32)),
            VarSpec("b1", (64,)), VarSpec("b2", (32,)), VarSpec("scalar", ()), VarSpec("k3", (200, 10), "float64")]


def test_placement_is_deterministic_and_balanced():
    specs = _specs()
    p = place(specs, 3, shard_bytes=200_000)
    assert p == place(list(reversed(specs)), 3, shard_bytes=200_000)
    assert p["emb"].sharded and p["big"].sharded and not p["k1"].sharded
    loads = p.bytes_per_ps()
    assert sum(loads) == sum(s.nbytes for s in specs)
    assert max(loads) - min(loads) <= max(s.nbytes for s in specs if not p[s.name].sharded)
    assert place(specs, 1).bytes_per_ps() == [sum(s.nbytes for s in specs)]
    with pytest.raises(ConfigError, match="num_ps"):
        place(specs, 0)
    with pytest.raises(ConfigError, match="dtype"):
        VarSpec("x", (2,), "int8")


def test_rows_route_split_merge_and_locate():
    p = place(_specs(), 3, shard_bytes=200_000)
    full = np.arange(1000 * 64, dtype=np.float32).reshape(1000, 64)
    parts = p["emb"].split(full)
    np.testing.assert_array_equal(p["emb"].merge(parts), full)
    ids = np.array([5, 999, 0, 3, 3])
    for m, (pos, local) in enumerate(p["emb"].route(ids)):
        np.testing.assert_array_equal(parts[m][local], full[ids[pos]])
    owner, local = locate(p, "emb", ids)
    assert [parts[o][l][0] for o, l in zip(owner, local)] == list(full[ids][:, 0])
    q = place(_specs(), 2, shard_bytes=200_000)
    for m in range(2):
        g = q["emb"].global_rows(m)
        o, l = locate(p, "emb", g)
        np.testing.assert_array_equal(np.stack([parts[a][b] for a, b in zip(o, l)]), q["emb"].split(full)[m])


def test_sum_duplicates():
    ids = np.array([3, 1, 3, 0, 1, 3])
    vals = np.arange(12, dtype=np.float32).reshape(6, 2)
    u, s = sum_duplicates(ids, vals)
    assert u.tolist() == [0, 1, 3]
    np.testing.assert_array_equal(s, [[6, 7], [2 + 8, 3 + 9], [0 + 4 + 10, 1 + 5 + 11]])


@pytest.mark.parametrize("distinct", [5, 300, 5000])
def test_sum_duplicates_adds_each_ids_rows_in_arrival_order(distinct: int) -> None:
    """Bit for bit the left-to-right sum of each id's rows in their order in the input
    (float32 addition is not associative: another order changes the bits)."""
    rng = np.random.default_rng(distinct)
    ids = rng.integers(0, distinct, 3000)
    vals = (rng.normal(size=(3000, 4)) * 1e3 ** rng.integers(-2, 3, (3000, 1))).astype(np.float32)
    expected: dict[int, np.ndarray] = {}
    for i, row in zip(ids.tolist(), vals):
        expected[i] = row.copy() if i not in expected else expected[i] + row
    u, s = sum_duplicates(ids, vals)
    assert u.tolist() == sorted(expected)
    np.testing.assert_array_equal(s, np.stack([expected[i] for i in u.tolist()]))
    assert s.dtype == np.float32


# ---------------------------------------------------------------------------- optimizers vs Keras
KERAS_CASES = [("SGD", {"learning_rate": 0.1}), ("SGD", {"learning_rate": 0.1, "momentum": 0.9}),
               ("SGD", {"learning_rate": 0.05, "momentum": 0.8, "nesterov": True}),
               ("Adam", {"learning_rate": 0.01}), ("Adam", {"learning_rate": 0.003, "beta_2": 0.99, "epsilon": 1e-4}),
               ("Adagrad", {"learning_rate": 0.1}), ("RMSprop", {"learning_rate": 0.1}),
               ("RMSprop", {"learning_rate": 0.01, "rho": 0.8, "momentum": 0.9, "centered": True})]


@pytest.mark.parametrize("name,kwargs", KERAS_CASES)
def test_optimizers_match_keras_dense_and_rows(name, kwargs):
    import keras
    import tensorflow as tf

    rng = np.random.default_rng(0)
    dense0, emb0 = rng.normal(size=(7, 5)).astype(np.float32), rng.normal(size=(30, 4)).astype(np.float32)
    kopt = getattr(keras.optimizers, name)(**kwargs)
    host = from_keras(kopt)
    kd, ke = tf.Variable(dense0), tf.Variable(emb0)
    hd, he = dense0.copy(), emb0.copy()
    sd, se = host.init_slots(hd), host.init_slots(he)
    for step in range(1, 6):
        g = rng.normal(size=dense0.shape).astype(np.float32)
        ids = rng.integers(0, 10, size=12)                 # duplicates; rows 10.. never touched
        vals = rng.normal(size=(12, 4)).astype(np.float32)
        uniq, summed = sum_duplicates(ids, vals)   # Keras would update Adam's moments per duplicate
        kopt.apply_gradients([(tf.constant(g), kd), (tf.IndexedSlices(tf.constant(summed), tf.constant(uniq), [30, 4]), ke)])
        host.apply_dense(hd, sd, g, step)
        host.apply_rows(he, se, uniq, summed, step)
    assert max_rel(hd, kd.numpy()) <= 1e-6
    assert max_rel(he, ke.numpy()) <= 1e-6


@pytest.mark.tf
def test_tf_keras_optimizers_match_the_ps_kernels():
    """tf_keras's optimizers, legacy (``OptimizerV2``) and new, against the kernels the ps
    choose for them (legacy Adagrad and RMSprop without momentum add epsilon after the
    square root; legacy SGD and RMSprop with momentum update only the looked-up rows), in
    a process of its own (it imports tf_keras)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tests.script_jobs import base_env

    script = Path(__file__).resolve().parent / "ps_scripts" / "tf_keras_optimizers.py"
    done = subprocess.run([sys.executable, str(script)], env=base_env(TF_USE_LEGACY_KERAS="1"), capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    errors = json.loads(done.stdout.split("ERRORS", 1)[1])
    assert len(errors) == 10 and all(max(e) <= 1e-6 for e in errors.values()), errors


def test_lazy_rows_touch_only_their_rows():
    emb = np.ones((10, 3), np.float32)
    opt = Adam(0.1, sparse="lazy")
    slots = opt.init_slots(emb)
    opt.apply_rows(emb, slots, np.array([2, 5]), np.ones((2, 3), np.float32), 1)
    dense_ref = np.ones((10, 3), np.float32)
    ref_slots = opt.init_slots(dense_ref)
    g = np.zeros_like(dense_ref)
    g[[2, 5]] = 1
    opt.apply_dense(dense_ref, ref_slots, g, 1)
    np.testing.assert_array_equal(emb, dense_ref)      # step 1: untouched rows have zero moments
    opt.apply_rows(emb, slots, np.array([2]), np.ones((1, 3), np.float32), 2)
    assert (emb[5] == dense_ref[5]).all()               # lazy: row 5 did not move at step 2
    with pytest.raises(ConfigError, match="sparse"):
        SGD(0.1, sparse="eager")
    with pytest.raises(ConfigError, match="learning_rate"):
        Adagrad(-1.0)


def test_wire_roundtrip_and_bad_messages():
    arrays = [np.arange(5, dtype=np.int64), np.ones((2, 3), np.float32), np.zeros((0, 4), np.float64)]
    header, got = wire.unpack(wire.pack({"a": 1}, arrays))
    assert header == {"a": 1} and all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(arrays, got))
    raw = wire.pack({}, [np.ones(100, np.float32)])
    with pytest.raises(wire.WireError, match="overruns"):
        wire.unpack(raw[:-40])
    with pytest.raises(wire.WireError):
        wire.unpack(b"\xff\xff\xff\x00{}")


# ---------------------------------------------------------------------------- a ps cluster in threads
def _train(cluster, clients, config, steps):
    clients[0].register(model_values(), config, shard_bytes=20_000)   # "emb" (128 KB) is dealt over the ps
    for c in clients[1:]:
        c.wait_ready()
    errors = []

    def worker(rank):
        try:
            c = clients[rank]
            for step in range(1, steps + 1):
                dense, rows = worker_grads(rank, step)
                c.pull_rows({"emb": rows["emb"][0]})
                c.pull(["dense/kernel", "dense/bias"])
                c.push(dense, rows, step=step)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("config", [{"name": "sgd", "learning_rate": 0.1, "momentum": 0.9},
                                    {"name": "adam", "learning_rate": 0.01}], ids=["sgd", "adam"])
def test_sync_two_workers_two_ps_equals_global_batch_keras(config):
    cluster = LocalCluster(2, 2)
    try:
        clients = [cluster.client(r) for r in range(2)]
        _train(cluster, clients, config, steps=4)
        assert clients[0].placement["emb"].sharded
        got = clients[1].pull()
        ref = keras_reference(config, 2, 4)
        for n in ref:
            assert max_rel(got[n], ref[n]) <= 1e-5, n
        clients[0].shutdown()
    finally:
        cluster.stop()


def test_async_applies_each_push_on_arrival():
    cluster = LocalCluster(2, 2, mode="async")
    try:
        c0, c1 = cluster.client(0), cluster.client(1)
        v0 = model_values()
        c0.register(v0, SGD(0.5), shard_bytes=20_000)
        c1.wait_ready()
        g = np.ones((16, 4), np.float32)
        c1.push({"dense/kernel": g})
        np.testing.assert_allclose(c0.pull(["dense/kernel"])["dense/kernel"], v0["dense/kernel"] - 0.5)
        c0.push({"dense/kernel": g}, {"emb": (np.array([7, 7, 3001]), np.ones((3, 8), np.float32))})
        got = c1.pull()
        np.testing.assert_allclose(got["dense/kernel"], v0["dense/kernel"] - 1.0)
        np.testing.assert_allclose(got["emb"][7], v0["emb"][7] - 1.0)     # duplicates summed
        np.testing.assert_allclose(got["emb"][3001], v0["emb"][3001] - 0.5)
        np.testing.assert_array_equal(got["emb"][8], v0["emb"][8])
    finally:
        cluster.stop()


def _chief_ends_the_job(caplog) -> float:
    """The test below; returns how long the chief's end of the job took."""
    from hostreduce.ps.job import PSJob

    cluster = LocalCluster(2, 4, mode="async", timeout_s=1.0)
    try:
        chief = PSJob(cluster.addresses, 0, 4, cluster.secret, timeout_s=1.0, connect_timeout_s=10.0)
        c1, c2 = cluster.client(1, timeout_s=1.0), cluster.client(2, timeout_s=1.0)
        chief.client.register(model_values(), SGD(0.5), shard_bytes=20_000, step=7, hold=True)
        with pytest.raises(CollectiveTimeoutError, match="did not register"):
            c1.wait_ready(timeout_s=0.3)       # registered, not open
        chief.client.open()
        c1.wait_ready(timeout_s=1.0)
        assert chief.client.info()["step"] == 7 and chief.client.workers() == {"done": [], "failed": {}, "lost": []}
        c1.done()
        c2.done("RuntimeError: boom")
        ended = threading.Event()
        # Worker 3 never calls: lost timeout_s after the registration. Worker 1 calls
        # again (a heartbeat) while the chief waits: done stays done.
        with caplog.at_level(logging.WARNING, logger="hostreduce.ps"):
            waiter = threading.Thread(target=lambda: (chief.end(), ended.set()))
            t0 = time.monotonic()
            waiter.start()
            c1.heartbeat()
            assert ended.wait(30.0), "the chief did not end the job"  # a hang guard
            took = time.monotonic() - t0
        messages = [r.getMessage() for r in caplog.records]
        assert "worker 2 failed: RuntimeError: boom; the job goes on without it" in messages, messages
        assert any(m.startswith("worker 3 was lost") for m in messages), messages
        assert any("worker 3 never called for" in m and "async training goes on without it" in m
                   for m in messages), messages
        for server in cluster.servers:  # the chief ended the job: every ps returned from serve()
            assert server._stopped.wait(30.0) and server.failure is None
    finally:
        cluster.stop()
    return took


def test_workers_wait_for_open_and_the_chief_ends_the_job_once_the_others_are_done_or_lost(caplog):
    """A held registration keeps the other workers' wait_ready waiting until the chief
    opens the ps; the chief's end of job (PSJob.end) waits for every other worker's Done
    or loss, logs the failed and lost ones, then stops the ps."""
    _chief_ends_the_job(caplog)


@pytest.mark.perf
def test_the_chief_ends_the_job_within_timeout_s_of_a_silent_worker(caplog):
    assert _chief_ends_the_job(caplog) < 1.0 + 1.0  # worker 3 is lost timeout_s (1 s) after registering


def test_wrong_secret_is_refused_and_logged_and_the_job_goes_on(caplog):
    cluster = LocalCluster(2, 2, mode="async")
    try:
        c0 = cluster.client(0)
        c0.register(model_values(), SGD(0.1))
        with caplog.at_level(logging.WARNING, logger="hostreduce.ps"):
            with pytest.raises(AuthenticationError, match="ps task 0"):
                cluster.client(1, secret="not-the-secret")
        assert any(r.name == "hostreduce.ps" and r.getMessage().startswith("ps task 0: refused a call from")
                   and "wrong or missing shared secret" in r.getMessage() for r in caplog.records)
        c1 = cluster.client(1)
        c1.wait_ready()
        c1.push({"dense/bias": np.ones(4, np.float32)})
        np.testing.assert_allclose(c0.pull(["dense/bias"])["dense/bias"], model_values()["dense/bias"] - 0.1)
    finally:
        cluster.stop()


def _straggler_and_stopped_ps() -> tuple[float, float]:
    """The test below; returns how long the straggler's push and the pull from the
    stopped ps took to fail."""
    cluster = LocalCluster(2, 2, timeout_s=1.5)
    try:
        c0 = cluster.client(0, timeout_s=1.5)
        c0.register(model_values(), SGD(0.1))
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match=r"worker rank\(s\) \[1\]"):
            c0.push(*worker_grads(0, 1), step=1)
        push_s = time.monotonic() - t0
        cluster.servers[1].stop()
        t0 = time.monotonic()
        with pytest.raises(PeerLostError, match=f"ps task 1 at '{cluster.addresses[1]}'"):
            c0.pull()
        return push_s, time.monotonic() - t0
    finally:
        cluster.stop()


def test_sync_straggler_is_named_and_a_stopped_ps_is_lost_within_timeout():
    # Errors that name the straggler and the lost ps: they come from timeout_s (1.5 s)
    # and the stop, not from a hang (this module's pytest timeout).
    _straggler_and_stopped_ps()


@pytest.mark.perf
def test_sync_straggler_and_stopped_ps_fail_within_timeout_s():
    push_s, pull_s = _straggler_and_stopped_ps()
    assert push_s < 1.5 + 0.5 and pull_s < 1.5, (push_s, pull_s)


def test_a_stopping_ps_fails_the_pushes_waiting_on_its_step_at_once():
    """The chief ends the job while worker 1's push of step 1 waits for worker 0's: the
    push fails at once (naming why), not when its 20 s wait ends, so the ps process can
    exit; nothing of the step is applied."""
    cluster = LocalCluster(1, 2, timeout_s=20.0)
    try:
        c0, c1 = cluster.client(0, timeout_s=20.0), cluster.client(1, timeout_s=20.0)
        c0.register(model_values(), SGD(0.1))
        c1.wait_ready()
        failed: list[BaseException] = []
        pusher = threading.Thread(target=lambda: _push_catching(c1, failed), daemon=True)
        pusher.start()
        deadline = time.monotonic() + 10
        while not cluster.servers[0].barrier._parts and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cluster.servers[0].barrier._parts, "worker 1's push never reached the barrier"
        cluster.servers[0].stop()
        pusher.join(30)  # a hang guard: the message below tells the stop from the push's 20 s timeout
        assert not pusher.is_alive(), "the waiting push outlived the ps's stop"
        assert failed and isinstance(failed[0], PeerLostError), failed
        assert "ps task 0 stopped serving (the chief ended the job)" in str(failed[0]), failed
        assert not _threads_in(StepBarrier.arrive), "a handler thread still waits in the barrier"
        assert cluster.servers[0].store.step == 0
    finally:
        cluster.stop()


def _threads_in(function) -> list[int]:
    """The threads whose stack is inside ``function`` now."""
    import sys

    found = []
    for ident, frame in sys._current_frames().items():
        while frame is not None:
            if frame.f_code is function.__code__:
                found.append(ident)
                break
            frame = frame.f_back
    return found


def _push_catching(client, failed: list) -> None:
    try:
        client.push(*worker_grads(1, 1), step=1)
    except Exception as e:  # noqa: BLE001 - the test inspects it
        failed.append(e)


class _SilentCall:
    """A gRPC method whose calls never end (until the test releases them)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __call__(self, request, timeout=None, metadata=None):
        self.release.wait(30)
        raise RuntimeError("released")


def _call_never_ended(monkeypatch) -> float:
    """The test below; returns how long the heartbeat took to fail."""
    from hostreduce.ps import client as client_module

    monkeypatch.setattr(client_module, "_GRACE_S", 0.3, raising=False)
    cluster = LocalCluster(2, 1, timeout_s=0.5)
    silent = _SilentCall()
    try:
        c = cluster.client(0, timeout_s=0.5)
        c._stubs[1] = dict(c._stubs[1], Info=silent)
        t0 = time.monotonic()
        with pytest.raises(PeerLostError, match=f"ps task 1 at '{cluster.addresses[1]}' did not answer Info"):
            c.heartbeat()
        return time.monotonic() - t0
    finally:
        silent.release.set()
        cluster.stop()


@pytest.mark.timeout(60)
def test_a_call_whose_end_is_never_reported_fails_naming_the_ps(monkeypatch):
    """The client's wait for the replies has its own limit (the deadline plus a grace),
    so even a call gRPC never ends cannot block a worker forever (the silent call would
    end with RuntimeError("released") after 30 s: not the error expected)."""
    _call_never_ended(monkeypatch)


@pytest.mark.perf
@pytest.mark.timeout(60)
def test_a_call_whose_end_is_never_reported_fails_after_the_deadline_and_grace(monkeypatch):
    took = _call_never_ended(monkeypatch)
    assert took < 0.5 + 0.3 + 1.0, took


def test_checkpoint_restores_onto_three_ps_and_a_crash_before_publish_keeps_the_previous(tmp_path):
    d = str(tmp_path)
    config = Adam(0.01)
    two = LocalCluster(2, 1)
    try:
        c = two.client(0)
        c.register(model_values(), config, shard_bytes=20_000, model_dir=d)
        c.push(*worker_grads(0, 1), step=1)
        c.save(d, 1)
        saved = c.pull()
        c.push(*worker_grads(0, 2), step=2)
        # Step 2's shards are written, but the chief dies before publishing the index.
        c._call("Save", {m: wire.pack({"dir": d, "step": 2}) for m in range(2)})
        assert checkpoint.read_index(d)["step"] == 1
        after2 = c.pull()
        # A worker's checkpoint leaves the sharded tables to the ps shards: they are read
        # whole from the shards of any step still on disk, and only the sharded ones.
        for step, want in ((1, saved), (2, after2)):
            tables = checkpoint.load_tables(d, step, list(saved))
            assert list(tables) == ["emb"]
            np.testing.assert_array_equal(tables["emb"], want["emb"])
        assert checkpoint.load_tables(d, 3, list(saved)) == {}
    finally:
        two.stop()
    three = LocalCluster(3, 1)
    try:
        c = three.client(0)
        c.register(model_values(seed=5), config, shard_bytes=20_000, model_dir=d)
        assert c.placement.num_ps == 3 and c.placement["emb"].sharded
        assert c.restore(d) == 1
        got = c.pull()
        for n in saved:
            np.testing.assert_array_equal(got[n], saved[n])
        # The slots and counts came along: step 2 from here equals step 2 on two ps.
        c.push(*worker_grads(0, 2), step=2)
        got2 = c.pull()
        for n in saved:
            np.testing.assert_array_equal(got2[n], after2[n])
    finally:
        three.stop()


def test_row_traffic_grows_with_the_batch_not_the_table():
    sent = {}
    for rows in (50_000, 200_000):
        cluster = LocalCluster(2, 1, mode="async")
        try:
            c = cluster.client(0)
            c.register({"table": np.zeros((rows, 32), np.float32)}, Adagrad(0.1), shard_bytes=1 << 20)
            for batch in (512, 1024):
                c.bytes_sent.clear()
                c.bytes_received.clear()
                ids = np.random.default_rng(batch).integers(0, rows, size=batch)
                c.pull_rows({"table": ids})
                c.push(rows={"table": (ids, np.ones((batch, 32), np.float32))})
                sent[rows, batch] = sum(c.bytes_sent.values()) + sum(c.bytes_received.values())
        finally:
            cluster.stop()
    table_bytes = 200_000 * 32 * 4
    assert sent[200_000, 512] <= table_bytes / 100, sent
    assert abs(sent[200_000, 512] - sent[50_000, 512]) / sent[50_000, 512] < 0.05, sent   # not the table
    assert 1.8 < sent[200_000, 1024] / sent[200_000, 512] < 2.2, sent                     # the batch


def test_pull_step_equals_pull_rows_and_pull_in_one_call_per_ps():
    cluster = LocalCluster(2, 1, mode="async")
    try:
        c = cluster.client(0)
        rng = np.random.default_rng(3)
        values = {"table": rng.normal(size=(5000, 8)).astype(np.float32),
                  "w": rng.normal(size=(16, 4)).astype(np.float32), "b": rng.normal(size=(4,)).astype(np.float32)}
        c.register(values, Adagrad(0.1), shard_bytes=1 << 14)   # the table split over both ps, w and b whole
        ids = rng.integers(0, 5000, size=(64, 3))                 # repeats included
        c.bytes_sent.clear()
        c.bytes_received.clear()
        rows, dense = c.pull_step({"table": ids}, ["w", "b"])
        assert rows.keys() == {"table"} and dense.keys() == {"w", "b"}
        np.testing.assert_array_equal(rows["table"], values["table"][ids])
        for n in ("w", "b"):
            np.testing.assert_array_equal(dense[n], values[n])
        # One PullRows call per ps; the dense values' bytes of its reply are counted as PullDense's.
        assert set(c.bytes_sent) == {"PullRows"}, c.bytes_sent
        assert c.bytes_received["PullDense"] == values["w"].nbytes + values["b"].nbytes, c.bytes_received
        np.testing.assert_array_equal(c.pull_rows({"table": ids})["table"], rows["table"])
        distinct = np.unique(ids)                                 # a training step's ids: sorted, distinct
        np.testing.assert_array_equal(c.pull_step({"table": distinct}, ["b"])[0]["table"], values["table"][distinct])
        only_rows, none = c.pull_step({"table": ids[:2]}, [])
        assert none == {} and only_rows["table"].shape == (2, 3, 8)
    finally:
        cluster.stop()


def test_each_ps_listens_only_on_its_own_address_from_the_spec():
    """Bound to 127.0.0.1 as the spec says, not to every interface: another loopback
    address of this machine finds nothing listening on the port."""
    import socket

    cluster = LocalCluster(2, 1)
    try:
        c0 = cluster.client(0)  # the ps are up once a client got in
        c0.register(model_values(), SGD(0.1))
        for address in cluster.addresses:
            port = int(address.rsplit(":", 1)[1])
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.2", port), timeout=5).close()
    finally:
        cluster.stop()
