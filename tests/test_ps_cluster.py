"""Parameter servers and workers as separate processes on localhost (the spawn harness
of the ring tests): sync training equals global-batch Keras training, and a killed ps
makes every worker fail with an error naming it (within timeout_s: the perf test)."""
from __future__ import annotations

import secrets

import numpy as np
import pytest

from hostreduce.processes import free_ports
from hostreduce.testing import run_ranks, run_ranks_allow_failure
from tests import ps_workers as pw
from tests.ps_helpers import keras_reference, max_rel, model_values


def _cluster(num_ps):
    return [f"127.0.0.1:{p}" for p in free_ports(num_ps)], secrets.token_hex(16)


@pytest.mark.timeout(90)
def test_sync_two_ps_two_worker_processes_equal_keras_global_batch(tmp_path):
    addrs, secret = _cluster(2)
    config = {"name": "adam", "learning_rate": 0.01}
    outs = run_ranks(pw.sync_training, 4, args=(addrs, 2, secret, config, 3, str(tmp_path)), timeout=60,
                     transport_env=False)
    assert outs[:2] == ["served", "served"]
    ref = keras_reference(config, 2, 3)
    for out in outs[2:]:
        for n, raw in out.items():
            got = np.frombuffer(raw, dtype=np.float32).reshape(model_values()[n].shape)
            assert max_rel(got, ref[n]) <= 1e-5, n


KILLED_PS_TIMEOUT_S = 3.0


def _killed_ps(tmp_path):
    addrs, secret = _cluster(2)
    outs = run_ranks_allow_failure(pw.killed_ps, 4, args=(addrs, 2, secret, KILLED_PS_TIMEOUT_S, str(tmp_path)),
                                   timeout=60, transport_env=False)
    assert outs[1] == "killed"
    for out in outs[2:]:
        assert isinstance(out, dict), out
        assert f"ps task 1 at '{addrs[1]}'" in out["error"]
    assert outs[0] == "served"                 # the chief still ended the job on ps 0
    assert len(outs[2]["shutdown_lost"]) == 1 and "ps task 1" in outs[2]["shutdown_lost"][0]
    return outs


@pytest.mark.timeout(90)
def test_a_killed_ps_makes_every_worker_fail_naming_it(tmp_path):
    _killed_ps(tmp_path)


@pytest.mark.perf
@pytest.mark.timeout(90)
def test_a_killed_ps_makes_every_worker_fail_within_timeout_s(tmp_path):
    for out in _killed_ps(tmp_path)[2:]:
        assert out["after_s"] < KILLED_PS_TIMEOUT_S, out
