"""Every ps task ends when its job does not form: a chief that never logs in, one that
logs in but never registers (it failed with another ps), another secret, a ``TF_CONFIG``
whose worker or ps count differs from the ps's. The ps stops serving within its
``startup_timeout_s`` with a failure naming why (its process exits non-zero), and the
worker whose cluster differs is told that, not that its secret is wrong."""
from __future__ import annotations

import json
import secrets
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from hostreduce.errors import AuthenticationError, ClusterError
from hostreduce.processes import free_ports
from hostreduce.ps.client import PSClient
from hostreduce.ps.server import ParameterServer
from tests.ps_helpers import model_values
from tests.script_jobs import base_env

pytestmark = pytest.mark.timeout(120)

STARTUP_S = 1.5
PS_SCRIPT = Path(__file__).resolve().parent / "ps_scripts" / "serve_ps.py"


class _Serving:
    """``num_ps`` ps of a job of ``num_workers``, each serving on a thread of its own."""

    def __init__(self, num_ps: int, num_workers: int, secret: str) -> None:
        self.addresses = [f"127.0.0.1:{p}" for p in free_ports(num_ps)]
        self.servers = [ParameterServer(m, self.addresses, num_workers, secret, timeout_s=5.0,
                                        startup_timeout_s=STARTUP_S) for m in range(num_ps)]
        self.threads = [threading.Thread(target=s.serve, daemon=True) for s in self.servers]
        for s in self.servers:
            s.start()
        for t in self.threads:
            t.start()

    def ended(self) -> list[str]:
        """Each ps's failure, once every one has stopped serving by itself."""
        for t in self.threads:
            t.join(60)  # a hang guard: each ends within its startup_timeout_s
        assert not any(t.is_alive() for t in self.threads), "a ps still serves a job that never formed"
        return [s.failure or "" for s in self.servers]


def _client(addresses: list[str], rank: int, num_workers: int, secret: str) -> PSClient:
    return PSClient(addresses, rank, num_workers, secret, timeout_s=5.0, connect_timeout_s=5.0)


def test_a_ps_whose_chief_never_logs_in_stops_naming_why():
    job = _Serving(1, 2, secrets.token_hex(8))
    [failure] = job.ended()
    assert failure == ("ps task 0: the job did not form within startup_timeout_s=1.5: the chief (worker 0) never "
                       "logged in to this ps; no other worker logged in"), failure


def test_a_chief_that_logs_in_but_never_registers_is_named():
    secret = secrets.token_hex(8)
    job = _Serving(2, 2, secret)
    chief, worker = _client(job.addresses, 0, 2, secret), _client(job.addresses, 1, 2, secret)
    failures = job.ended()
    for m, failure in enumerate(failures):
        assert failure.startswith(f"ps task {m}: the job did not form within startup_timeout_s=1.5: the chief "
                                  "(worker 0) logged in"), failure
        assert "but never registered the variables" in failure and "worker(s) [1] logged in" in failure, failure
    chief.close()
    worker.close()


def test_a_registered_job_is_not_ended_by_the_startup_timeout():
    secret = secrets.token_hex(8)
    job = _Serving(1, 1, secret)
    chief = _client(job.addresses, 0, 1, secret)
    chief.register(model_values(), {"name": "sgd", "learning_rate": 0.1})
    assert not job.servers[0]._stopped.wait(3 * STARTUP_S)  # past the startup timeout, still serving
    chief.shutdown()
    assert job.ended() == [""]
    chief.close()


def test_a_worker_with_another_secret_is_refused_and_the_ps_names_it():
    job = _Serving(1, 2, secrets.token_hex(8))
    with pytest.raises(AuthenticationError, match="refused this worker's proof"):
        _client(job.addresses, 0, 2, "another secret")
    [failure] = job.ended()
    assert "the chief (worker 0) never logged in" in failure, failure
    assert "refused meanwhile: 1 connection(s) that claimed to be worker 0 (wrong or missing shared secret" in failure


@pytest.mark.parametrize("ps_workers, worker_workers", [(3, 2), (2, 3)])
def test_a_worker_count_that_differs_is_named_as_such(ps_workers: int, worker_workers: int):
    secret = secrets.token_hex(8)
    job = _Serving(1, ps_workers, secret)
    differs = (f"the cluster differs: this ps task's TF_CONFIG lists {ps_workers} worker(s) and 1 ps, worker 1's "
               f"lists {worker_workers} worker(s) and 1 ps; every task needs the same cluster")
    with pytest.raises(ClusterError) as info:
        _client(job.addresses, 1, worker_workers, secret)
    assert differs in str(info.value) and "secret" not in str(info.value), str(info.value)
    [failure] = job.ended()
    assert f"1 connection(s) that claimed to be worker 1 ({differs}" in failure, failure


def test_workers_listing_fewer_ps_are_named_and_every_ps_ends():
    secret = secrets.token_hex(8)
    job = _Serving(2, 1, secret)
    with pytest.raises(ClusterError, match=r"lists 1 worker\(s\) and 2 ps, worker 0's lists 1 worker\(s\) and 1 ps"):
        _client(job.addresses[:1], 0, 1, secret)
    failures = job.ended()
    assert "the cluster differs" in failures[0] and "never logged in" in failures[1], failures


def _tf_config(cluster: dict[str, Any], task: str, index: int) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": task, "index": index}})


def test_a_ps_process_of_a_job_that_never_formed_exits_non_zero_naming_why():
    """ps ``TF_CONFIG`` lists 3 workers while 2 run: the workers are told the counts
    differ, and the ps process exits 1 with ``JobFailedError`` naming them."""
    ps_addr, *workers = [f"127.0.0.1:{p}" for p in free_ports(4)]
    secret = secrets.token_hex(8)
    env = base_env(TF_CONFIG=_tf_config({"chief": workers[:1], "worker": workers[1:], "ps": [ps_addr]}, "ps", 0),
                   HOSTREDUCE_SECRET=secret, HOSTREDUCE_CONNECT_TIMEOUT_S="3")
    proc = subprocess.Popen([sys.executable, str(PS_SCRIPT)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        with pytest.raises(ClusterError, match="lists 3 worker"):
            PSClient([ps_addr], 0, 2, secret, timeout_s=5.0, connect_timeout_s=30.0)
        out, _ = proc.communicate(timeout=60)  # a hang guard
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out
    assert "JobFailedError: ps task 0: the job did not form within startup_timeout_s=3" in out, out
    assert "the cluster differs: this ps task's TF_CONFIG lists 3 worker(s)" in out, out
