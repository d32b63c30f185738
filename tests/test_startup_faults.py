"""Start-up that strangers cannot break: bad handshakes are refused and logged while the
ring still forms; a cluster spec that lists one endpoint twice, or nests too deeply, is a
ConfigError; a rank whose port is taken fails at once and its peers learn why; a rank
that waits for a missing peer says so."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from hostreduce.cluster.tf_config import parse_tf_config
from hostreduce.config import Config
from hostreduce.errors import ClusterError, ConfigError
from hostreduce.processes import free_ports, tf_config
from hostreduce.testing import run_ranks, run_ranks_allow_failure
from tests import startup_workers as w


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 4])
def test_ring_forms_and_trains_through_100_bad_handshakes(size):
    outs = run_ranks(w.train_through_a_flood, size, args=(100,), timeout=90)
    statuses = outs[0]["statuses"]
    assert sum(statuses.values()) == 100, statuses
    for key, n in statuses.items():
        kind, code = key.split(":")
        expected = "UNAUTHENTICATED" if kind in ("wrong-proof", "bad-metadata") else "INVALID_ARGUMENT"
        assert code == expected, statuses
    for o in outs:
        assert o["sums"] == [sum(r + step for r in range(size)) for step in range(5)], o


def _port_taken(size, victim):
    outs = run_ranks_allow_failure(w.port_taken, size, args=(victim,), timeout=60)
    mine = outs[victim]
    assert mine.startswith("ClusterError") and "cannot listen on '127.0.0.1:" in mine, mine
    for r, o in enumerate(outs):
        if r != victim:  # told why, not a timeout of connect_timeout_s (30 s)
            assert o.startswith("PeerLostError") and f"rank {victim} " in o and "cannot listen" in o, f"rank {r}: {o}"
    return outs


@pytest.mark.timeout(90)
@pytest.mark.parametrize("size,victim", [(2, 1), (4, 2)])
def test_a_taken_port_fails_that_rank_at_once_and_its_peers_soon(size, victim):
    _port_taken(size, victim)


@pytest.mark.perf
@pytest.mark.timeout(90)
@pytest.mark.parametrize("size,victim", [(2, 1), (4, 2)])
def test_a_taken_port_fails_every_rank_within_seconds(size, victim):
    for r, o in enumerate(_port_taken(size, victim)):
        took = float(o.split(" after ")[1].split("s:")[0])
        assert took < 10.0, f"rank {r}: {o}"  # far below connect_timeout_s=30


def _tf(workers, index=0):
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})


@pytest.mark.parametrize("a,b", [
    ("localhost:5000", "127.0.0.1:5000"),
    ("[::1]:5000", "[0:0:0:0:0:0:0:1]:5000"),
    ("[::ffff:127.0.0.1]:5000", "127.0.0.1:5000"),
    ("Host-1:5000", "host-1.:5000"),
])
def test_one_endpoint_under_two_spellings_is_a_config_error(a, b):
    with pytest.raises(ConfigError, match=r"`cluster\.worker\[1\]` repeats the address of `cluster\.worker\[0\]`"):
        parse_tf_config(_tf([a, "h:1", b]).replace('"h:1", ', ""))


def test_distinct_loopback_endpoints_are_accepted():
    assert parse_tf_config(_tf(["127.0.0.1:5000", "127.0.0.2:5000", "[::1]:5000", "localhost:5001"])).size == 4


@pytest.mark.parametrize("raw,field", [
    ("[" * 100_000 + "]" * 100_000, "`TF_CONFIG`"),
    ('{"cluster": {"worker": ' + "[" * 100_000 + "]" * 100_000 + '}, "task": {"type": "worker", "index": 0}}',
     "`TF_CONFIG`"),
    ('{"cluster": {"worker": [' + "[" * 900 + "]" * 900 + ']}, "task": {"type": "worker", "index": 0}}',
     "`cluster.worker`"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": ' + "[" * 900 + "]" * 900 + "}}",
     "`task.index`"),
])
def test_deeply_nested_tf_config_is_a_config_error(raw, field):
    with pytest.raises(ClusterError) as info:
        parse_tf_config(raw)
    assert str(info.value).startswith(field), info.value


@pytest.mark.timeout(30)
def test_a_missing_peer_is_reported_once_while_waiting(monkeypatch, caplog):
    from hostreduce.reducers.ring import grpc_mesh
    from hostreduce.reducers.ring.reducer import RingReducer

    monkeypatch.setattr(grpc_mesh, "_WAIT_NOTICE_S", 0.3)
    addresses = [f"127.0.0.1:{p}" for p in free_ports(2)]
    cluster = parse_tf_config(tf_config(addresses, 0))
    config = Config(secret="s" * 16, transport="grpc", connect_timeout_s=1.5)
    with caplog.at_level(logging.WARNING, logger="hostreduce.ring"), pytest.raises(ClusterError) as info:
        RingReducer(cluster=cluster, config=config).allreduce("x", np.ones(1, np.float32))
    notices = [r for r in caplog.records if "waiting for rank 1" in r.getMessage()]
    assert len(notices) == 1, [r.getMessage() for r in caplog.records]
    assert notices[0].levelno == logging.WARNING
    assert addresses[1] in notices[0].getMessage() and "HOSTREDUCE_CONNECT_TIMEOUT_S" in notices[0].getMessage()
    assert f"rank 1 at {addresses[1]!r}" in str(info.value) and "HOSTREDUCE_CONNECT_TIMEOUT_S" in str(info.value)
