"""A parameter server facing processes without the job's secret, on 127.0.0.1: calls
held open with their request never sent (on every method, the handshake's included),
unknown methods, random bytes and HTTP/2 garbage, and large unauthenticated messages.

None of it holds a handler thread or makes the ps read a body: a sync job running
meanwhile ends bit for bit as an undisturbed one, the chief's Shutdown ends every ps,
each stranger's call is refused at once and logged by class (as ``ps task K``), and a
ps process's peak resident memory stays within a bound while it refuses 4 x 128 MiB
unauthenticated pushes, and 4 x 128 MiB pushes of an authenticated worker over the
ps's receive limit (``ps_max_message_bytes``: refused by gRPC from their length)."""
from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from hostreduce.errors import ConfigError
from hostreduce.processes import free_ports
from hostreduce.ps import Adam, wire
from hostreduce.ps.client import PSClient
from hostreduce.ps.handshake import SESSION_KEY, login
from tests.ps_helpers import LocalCluster, model_values, worker_grads
from tests.ps_strangers import GARBAGE_PER_PS, HELD_PER_PS, Strangers

pytestmark = pytest.mark.timeout(240)

PS_SCRIPT = Path(__file__).resolve().parent / "ps_scripts" / "serve_ps.py"
STEPS = 4


def _sync_job(cluster: LocalCluster) -> dict[str, bytes]:
    """Two workers train STEPS sync steps; the final values' bytes. The chief then ends
    the job."""
    clients = [cluster.client(r, timeout_s=10.0) for r in range(2)]
    clients[0].register(model_values(), Adam(0.01), shard_bytes=20_000)
    clients[1].wait_ready()
    errors: list[BaseException] = []

    def train(rank: int) -> None:
        try:
            for step in range(1, STEPS + 1):
                dense, rows = worker_grads(rank, step)
                clients[rank].pull_step({"emb": rows["emb"][0]}, ["dense/kernel", "dense/bias"])
                clients[rank].push(dense, rows, step=step)
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    threads = [threading.Thread(target=train, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    out = {n: v.tobytes() for n, v in clients[1].pull().items()}
    clients[0].shutdown()
    for c in clients:
        c.close()
    return out


def test_held_calls_garbage_and_unknown_methods_leave_a_sync_job_undisturbed(caplog):
    undisturbed = LocalCluster(2, 2, timeout_s=10.0)
    try:
        expected = _sync_job(undisturbed)
    finally:
        undisturbed.stop_and_join()
    cluster = LocalCluster(2, 2, timeout_s=10.0)
    strangers = Strangers(cluster.addresses)
    try:
        with caplog.at_level(logging.WARNING, logger="hostreduce.ps"):
            strangers.hold(HELD_PER_PS)
            strangers.refused()  # before the job, so that no answer races the ps's end
            strangers.garbage(GARBAGE_PER_PS)
            got = _sync_job(cluster)
            for t in cluster.threads:  # the chief's Shutdown ended every ps
                t.join(30)
            assert not any(t.is_alive() for t in cluster.threads), "a ps did not take the chief's Shutdown"
            ended = strangers.close()
    finally:
        strangers.release.set()
        cluster.stop_and_join()
    assert got == expected
    # Every held call was refused at once, without its request: none was left to time out.
    # (On a machine loaded enough, a few of the 2 x 200 connections are not set up in
    # time and end UNAVAILABLE on the stranger's side: never a call the ps let through.)
    dropped = sum(n for what, n in ended.items() if what.endswith(" UNAVAILABLE"))
    answered = {what for what in ended if not what.endswith(" UNAVAILABLE")}
    assert answered == {"Push UNAUTHENTICATED", "PullRows UNAUTHENTICATED", "Shutdown UNAUTHENTICATED",
                        "Register UNAUTHENTICATED", "Hello INVALID_ARGUMENT", "Login UNAUTHENTICATED"}, ended
    assert dropped <= HELD_PER_PS // 20, ended
    assert sum(ended.values()) == 2 * HELD_PER_PS
    said = [r.getMessage() for r in caplog.records if r.name == "hostreduce.ps"]
    for kind in ("call without a valid session", "malformed handshake", "invalid rank", "unknown method"):
        assert any(m.startswith("ps task 0: refused a call from") and kind in m for m in said), (kind, said[:20])
    # Past the first ones of a kind, the refusals are counted and logged with their count.
    assert any(m.startswith("ps task 0: refused in the last") and "more of 'unknown method'" in m for m in said), said
    assert not any("rank 2" in m or "rank 3" in m for m in said)


def _vm(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(field)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc/<pid>/status")
def test_large_messages_are_never_read(tmp_path):
    """A ps process whose receive limit is 16 MiB refuses 4 concurrent 128 MiB pushes
    without a session (unread: UNAUTHENTICATED), then 4 from an authenticated worker on
    its own connection (over the limit: RESOURCE_EXHAUSTED from gRPC): its peak resident
    memory grows by less than one of those messages (it buffered none of them), the job then trains and
    ends, and the ps exits 0."""
    ps_addr, worker_addr = [f"127.0.0.1:{p}" for p in free_ports(2)]
    secret = secrets.token_hex(8)
    env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": {"chief": [worker_addr], "ps": [ps_addr]},
                                                 "task": {"type": "ps", "index": 0}}),
               HOSTREDUCE_SECRET=secret, HOSTREDUCE_PS_MAX_MESSAGE_BYTES=str(16 << 20),
               PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    proc = subprocess.Popen([sys.executable, str(PS_SCRIPT)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        chief = PSClient([ps_addr], 0, 1, secret, timeout_s=10.0, connect_timeout_s=60.0)
        chief.register(model_values(), Adam(0.01), shard_bytes=20_000)
        chief.push(*worker_grads(0, 1), step=1)
        before = _vm(proc.pid, "VmHWM")
        body = bytes(128 << 20)
        codes = {}
        for who in ("stranger", "worker"):
            channel = grpc.insecure_channel(ps_addr, options=[("grpc.max_send_message_length", -1),
                                                              ("grpc.use_local_subchannel_pool", 1)])
            meta: tuple = ()
            if who == "worker":
                meta = ((SESSION_KEY, login(channel, wire.SERVICE, secret, 0, 0, 1, ps_addr,
                                            time.monotonic() + 30, num_ps=1)),)
            calls = [channel.unary_unary(f"/{wire.SERVICE}/Push").future(body, timeout=60, metadata=meta)
                     for _ in range(4)]
            codes[who] = [c.exception(60).code() for c in calls]
            channel.close()
        del body
        peak = _vm(proc.pid, "VmHWM")
        chief.push(*worker_grads(0, 2), step=2)
        assert chief.info()["step"] == 2
        chief.shutdown()
        chief.close()
        out, _ = proc.communicate(timeout=60)  # a hang guard
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert codes == {"stranger": [grpc.StatusCode.UNAUTHENTICATED] * 4,
                     "worker": [grpc.StatusCode.RESOURCE_EXHAUSTED] * 4}, codes
    print(f"ps peak resident memory {before / 2**20:.0f} MiB before, {peak / 2**20:.0f} MiB after")
    # What the connections' flow-control windows let in before the refusals (more on a
    # loaded machine), never one whole message of the eight.
    assert peak - before < 128 << 20, (before, peak)
    assert proc.returncode == 0, out


def test_a_push_over_the_receive_limit_is_a_config_error_naming_the_setting():
    cluster = LocalCluster(1, 1, max_message_bytes=1 << 20)
    try:
        c = cluster.client(0)
        c.register(model_values(), Adam(0.01), shard_bytes=20_000)
        with pytest.raises(ConfigError, match="ps_max_message_bytes"):
            c._call("Push", {0: wire.pack({"step": 1, "dense": [], "rows": []}, [np.zeros(1 << 19)])})
        c.push(*worker_grads(0, 1), step=1)  # the job goes on
        assert c.info()["step"] == 1
    finally:
        cluster.stop_and_join()
