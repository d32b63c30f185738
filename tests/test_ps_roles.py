"""Parameter-server roles without TensorFlow: ``ps`` and ``evaluator`` tasks of
``TF_CONFIG`` resolved with roles (and still refused by the ring), a ps task made from
its environment, and how its serving ends: the chief's Shutdown (with or without a
failure) or a chief that went silent."""
from __future__ import annotations

import json
import secrets
import threading
import time

import pytest

from hostreduce.cluster import resolve_cluster
from hostreduce.errors import ClusterError, ConfigError
from hostreduce.processes import free_ports
from hostreduce.ps import JobFailedError, server_from_env
from hostreduce.ps.client import PSClient
from tests.ps_helpers import model_values

pytestmark = pytest.mark.timeout(60)

CLUSTER = {"chief": ["c:1"], "worker": ["w:1", "w:2"], "ps": ["p:1", "p:2"], "evaluator": ["e:1"]}


def _env(cluster: dict, task: str, index: int, **extra: str) -> dict[str, str]:
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task, "index": index}}), **extra}


@pytest.mark.parametrize("task, index, role, rank, chief", [
    ("chief", 0, "worker", 0, True), ("worker", 1, "worker", 2, False),
    ("ps", 1, "ps", 0, False), ("evaluator", 0, "evaluator", 0, False)])
def test_roles_from_tf_config(task, index, role, rank, chief):
    spec = resolve_cluster(env=_env(CLUSTER, task, index), roles=True)
    assert (spec.role, spec.rank, spec.is_chief, spec.task_index) == (role, rank, chief, index)
    assert spec.ps_addresses == ("p:1", "p:2")
    assert spec.worker_addresses == ("c:1", "w:1", "w:2")
    assert spec.has_evaluator
    if role != "worker":  # alone in its group: never part of the ring
        assert (spec.size, spec.addresses) == (1, ())
    else:
        assert spec.addresses == spec.worker_addresses and spec.size == 3


@pytest.mark.parametrize("task", ["ps", "evaluator"])
def test_the_ring_still_refuses_ps_and_evaluator_tasks(task):
    with pytest.raises(ClusterError, match=f"all-reduce ring.*Received: task.type='{task}'"):
        resolve_cluster(env=_env(CLUSTER, task, 0))


@pytest.mark.parametrize("cluster, task, index, expected", [
    ({"ps": ["p:1"]}, "ps", 0, "at least one 'chief' or 'worker'"),
    ({"worker": ["w:1"], "ps": ["p:1"]}, "ps", 1, "`task.index` must be in [0, 1) for task type 'ps'"),
    ({"worker": ["w:1"], "ps": ["p"]}, "ps", 0, "cluster.ps[0]='p'"),
    ({"worker": ["w:1"]}, "ps", 0, "`task.type` must name a task type listed"),
])
def test_malformed_ps_specs_name_the_field(cluster, task, index, expected):
    with pytest.raises(ClusterError) as info:
        resolve_cluster(env=_env(cluster, task, index), roles=True)
    assert expected in str(info.value)


def test_server_from_env_needs_a_ps_task_and_the_secret():
    with pytest.raises(ClusterError, match="must be 'ps'.*task.type='worker'"):
        server_from_env(env=_env(CLUSTER, "worker", 0, HOSTREDUCE_SECRET="s"))
    with pytest.raises(ConfigError, match="HOSTREDUCE_SECRET"):
        server_from_env(env=_env(CLUSTER, "ps", 0))
    server = server_from_env(env=_env(CLUSTER, "ps", 1, HOSTREDUCE_SECRET="s", HOSTREDUCE_TIMEOUT_S="7"))
    assert (server.index, server.addresses, server.num_workers, server.timeout_s) == (1, ("p:1", "p:2"), 3, 7.0)
    assert server.chief_timeout_s == 28.0


def _serving(chief_timeout_s: float = 30.0):
    ps_addr, worker_addr = [f"127.0.0.1:{p}" for p in free_ports(2)]
    secret = secrets.token_hex(8)
    env = _env({"chief": [worker_addr], "ps": [ps_addr]}, "ps", 0, HOSTREDUCE_SECRET=secret)
    server = server_from_env(env=env, timeout_s=2.0, chief_timeout_s=chief_timeout_s)
    outcome: dict = {}

    def serve():
        try:
            server.serve()
            outcome["failure"] = server.failure
        except Exception as e:  # pragma: no cover - reported by the test
            outcome["error"] = e

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = PSClient([ps_addr], 0, 1, secret, timeout_s=2.0, connect_timeout_s=10.0)
    client.register(model_values(), {"name": "sgd", "learning_rate": 0.1}, step=7)
    return client, thread, outcome


def test_shutdown_ends_serving_and_tells_whether_the_job_failed():
    client, thread, outcome = _serving()
    assert client.info()["step"] == 7          # a resumed job's step
    client.shutdown()
    thread.join(10)
    assert outcome == {"failure": None}
    client, thread, outcome = _serving()
    client.shutdown(failure="ValueError: boom")
    thread.join(10)
    assert "the chief ended the job after a failure: ValueError: boom" in outcome["failure"]


def _silent_chief() -> float:
    """The test below; returns how long the ps served after the registration."""
    client, thread, outcome = _serving(chief_timeout_s=1.0)
    start = time.monotonic()
    thread.join(30)  # a hang guard: the ps serves until it gives the chief up
    took = time.monotonic() - start
    assert not thread.is_alive(), "the ps still serves a silent chief"
    assert "the chief (worker 0) has not called for" in outcome["failure"]
    client.close()
    return took


def test_a_silent_chief_ends_serving_with_a_failure():
    _silent_chief()


@pytest.mark.perf
def test_a_silent_chief_ends_serving_within_seconds():
    assert _silent_chief() < 5  # chief_timeout_s is 1


def test_serve_from_env_raises_when_the_job_failed(monkeypatch):
    from hostreduce.ps import serve as serve_mod

    class Fake:
        index, failure = 0, "ps task 0: the chief ended the job after a failure: X"

        def serve(self):
            pass

    monkeypatch.setattr(serve_mod, "server_from_env", lambda **kw: Fake())
    with pytest.raises(JobFailedError, match="after a failure: X"):
        serve_mod.serve_from_env()


def test_launcher_tasks_of_a_ps_job():
    from hostreduce.processes import job_tasks

    tasks = job_tasks("127.0.0.1", 2, 2, evaluator=True)
    assert [label for label, _ in tasks] == ["0", "1", "ps0", "ps1", "evaluator"]
    specs = [resolve_cluster(env={"TF_CONFIG": raw}, roles=True) for _, raw in tasks]
    assert [(s.role, s.rank, s.is_chief) for s in specs] == [
        ("worker", 0, True), ("worker", 1, False), ("ps", 0, False), ("ps", 0, False), ("evaluator", 0, False)]
    assert len(set(specs[0].worker_addresses + specs[0].ps_addresses)) == 4 and specs[0].has_evaluator
    assert [label for label, _ in job_tasks("127.0.0.1", 2)] == ["0", "1"]   # a ring job, as before
    assert "ps" not in json.loads(job_tasks("127.0.0.1", 2)[0][1])["cluster"]
