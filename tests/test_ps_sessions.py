"""Sessions bound to their connection, and the deadline every authenticated call carries,
on 127.0.0.1.

A worker's session token, seen on the network, is useless on any other connection: the
call is refused unread (the ps's byte count does not move, nothing changes) while the
job goes on; the token is dead once the worker closed its client. A worker whose
channel reconnects logs in again by itself. A call without a deadline, or with one
further than the ps allows, is refused unread; a call whose request never comes holds
its handler thread only until its deadline."""
from __future__ import annotations

import threading
from typing import Any

import grpc
import numpy as np
import pytest

from hostreduce.errors import ConfigError
from hostreduce.ps import Adam, wire
from hostreduce.ps.handshake import REBIND, SESSION_KEY, login
from tests.ps_helpers import LocalCluster, assert_same_bits, model_values, worker_grads

pytestmark = pytest.mark.timeout(120)


def _own_connection(addr: str) -> Any:
    """A channel on a TCP connection of its own (not shared with this process's others)."""
    return grpc.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1)])


def _token(client: Any, m: int) -> str:
    return dict(client._meta[m])[SESSION_KEY]


def _registered(cluster: LocalCluster) -> Any:
    client = cluster.client(0)
    client.register(model_values(), Adam(0.01), shard_bytes=20_000)
    return client


def test_a_token_stolen_onto_another_connection_is_refused_unread_and_the_job_goes_on():
    undisturbed = LocalCluster(2, 1, mode="async")
    try:
        c = _registered(undisturbed)
        for step in (1, 2):
            c.push(*worker_grads(0, step), step=step)
        expected = undisturbed.snapshots()
    finally:
        undisturbed.stop_and_join()
    cluster = LocalCluster(2, 1, mode="async")
    try:
        c = _registered(cluster)
        c.push(*worker_grads(0, 1), step=1)
        before = cluster.snapshots()
        push = wire.pack({"step": 2, "dense": ["dense/kernel"], "rows": []}, [np.ones((16, 4), np.float32)])
        for m, server in enumerate(cluster.servers):
            read = dict(server.bytes_in)
            with _own_connection(cluster.addresses[m]) as thief:
                for method, body in (("Push", push), ("Info", wire.pack({})), ("Shutdown", wire.pack({}))):
                    with pytest.raises(grpc.RpcError) as info:
                        thief.unary_unary(f"/{wire.SERVICE}/{method}")(
                            body, timeout=10, metadata=((SESSION_KEY, _token(c, m)),))
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, info.value)
                    assert REBIND in info.value.details(), info.value.details()
            assert server.bytes_in == read  # refused before its body was read
        assert_same_bits(cluster.snapshots(), before)
        c.push(*worker_grads(0, 2), step=2)  # the worker's own connection still works
        assert c.logins == 2                 # without logging in again
        assert_same_bits(cluster.snapshots(), expected)
    finally:
        cluster.stop_and_join()


def test_a_token_is_dead_once_its_client_closed():
    cluster = LocalCluster(1, 2)
    try:
        _registered(cluster)
        c = cluster.client(1)
        token = _token(c, 0)
        assert c.info()["step"] == 0
        c.close()
        with _own_connection(cluster.addresses[0]) as thief:
            with pytest.raises(grpc.RpcError) as info:
                thief.unary_unary(f"/{wire.SERVICE}/Info")(wire.pack({}), timeout=10,
                                                           metadata=((SESSION_KEY, token),))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "without a valid session" in info.value.details(), info.value.details()
    finally:
        cluster.stop_and_join()


def test_a_worker_whose_connection_changed_logs_in_again_by_itself():
    """The ps sees the worker's calls come from another connection than the one it
    logged in on (as after a reconnection): the worker's next calls log in again,
    once per ps, and succeed; the sync job's result is an undisturbed one's."""
    results = []
    for moved in (False, True):
        cluster = LocalCluster(2, 1)
        try:
            c = _registered(cluster)
            c.push(*worker_grads(0, 1), step=1)
            if moved:
                for server in cluster.servers:
                    sessions = server.gate._sessions
                    for token, (rank, _) in list(sessions.items()):
                        sessions[token] = (rank, "ipv4:127.0.0.1:1")  # the connection it logged in on is gone
            c.push(*worker_grads(0, 2), step=2)
            c.pull_rows({"emb": np.arange(10)})
            assert c.logins == (4 if moved else 2)
            results.append(cluster.snapshots())
            c.shutdown()
        finally:
            cluster.stop_and_join()
    assert_same_bits(results[1], results[0])


def _session_channel(cluster: LocalCluster, rank: int) -> tuple[Any, tuple]:
    """A channel of its own to ps 0 and the session worker ``rank`` logged in there with."""
    import time

    channel = _own_connection(cluster.addresses[0])
    token = login(channel, wire.SERVICE, cluster.secret, rank, 0, cluster.num_workers, cluster.addresses[0],
                  time.monotonic() + 10, num_ps=len(cluster.addresses))
    return channel, ((SESSION_KEY, token),)


def test_an_authenticated_call_needs_a_bounded_deadline_and_a_held_one_ends_at_it():
    cluster = LocalCluster(1, 2, timeout_s=5.0)
    server = cluster.servers[0]
    release = threading.Event()

    def never():
        release.wait(60)
        return
        yield

    try:
        c = _registered(cluster)
        channel, meta = _session_channel(cluster, 1)
        with channel:
            for timeout in (None, server.call_limit_s("Push") + 60):
                with pytest.raises(grpc.RpcError) as info:
                    channel.unary_unary(f"/{wire.SERVICE}/Push")(wire.pack({"step": 1, "dense": [], "rows": []}),
                                                                 timeout=timeout, metadata=meta)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "must carry a deadline of at most" in info.value.details(), info.value.details()
            # Calls whose request never comes, as many as the handler threads: each holds
            # one only until its deadline, then the job goes on.
            held = [channel.stream_unary(f"/{wire.SERVICE}/Push").future(never(), timeout=2.0, metadata=meta)
                    for _ in range(4 * cluster.num_workers + 8)]
            codes = {f.exception(30).code() for f in held}
            assert codes == {grpc.StatusCode.DEADLINE_EXCEEDED}, codes
            release.set()
        assert c.info()["step"] == 0
    finally:
        release.set()
        cluster.stop_and_join()


def test_the_client_maps_a_refused_deadline_to_a_config_error():
    cluster = LocalCluster(1, 1)
    try:
        c = _registered(cluster)
        with pytest.raises(ConfigError, match="must carry a deadline of at most"):
            c._call("Info", {0: wire.pack({})}, timeout=10**4)
    finally:
        cluster.stop_and_join()


def test_sessions_per_worker_are_bounded():
    from hostreduce.ps.handshake import MAX_SESSIONS_PER_WORKER

    cluster = LocalCluster(1, 1)
    try:
        clients = [cluster.client(0) for _ in range(MAX_SESSIONS_PER_WORKER + 5)]
        assert len(cluster.servers[0].gate._sessions) == MAX_SESSIONS_PER_WORKER
        assert clients[-1].info()["step"] == 0
    finally:
        cluster.stop_and_join()
