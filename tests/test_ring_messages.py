"""The ring's control protocol: every message round-trips through the one codec, the
coordinator's plan items become typed steps, and malformed input is a ValueError."""
from __future__ import annotations

import numpy as np
import pytest

from hostreduce.reducers.ring import messages as m
from hostreduce.reducers.ring.negotiation import decide_data_path


def entry(name: str, **extra) -> m.Entry:
    return {"name": name, "kind": "allreduce", "dtype": "float32", "shape": [4], "op": "sum", "root": 0,
            "nbytes": 16, **extra}


PLAN = m.Plan(0, [m.AllReduce(["a", "b"], True, {"a": [b"x"]}), m.Broadcast(["c"]), m.AllGather(["d"], [1, 2]),
                  m.Barrier(["__barrier__/1"]), m.Fail(m.Cause.MISMATCH, ["e"], [0, 1], "differ")])


@pytest.mark.parametrize("msg", [
    m.Beat(3), m.Join(1, "auto", 65536, True, False, "host", 123, 456, 5000), m.Welcome(0, transport="shm", token="ab"),
    m.Welcome(0, transport="tcp", token="ab", ports=[5000, 5001]),
    m.Welcome(0, error="Every worker needs the same `chunk_bytes` setting"), m.Ready(2, [entry("a"), entry("b")]),
    m.Blocked(1, "a"), m.Blocked(1, None), PLAN, m.Departed(0), m.PeerFailure(2, "ValueError: boom", [2]),
], ids=lambda msg: type(msg).__name__)
def test_every_message_round_trips(msg):
    got = m.decode(m.encode(msg))
    assert type(got) is type(msg) and got == msg


def test_rank_0s_gathered_parts_never_travel():
    got = m.decode(m.encode(PLAN))
    assert got.steps[0].parts is None and PLAN.steps[0].parts == {"a": [b"x"]}


def test_plan_items_become_steps():
    items = [{"kind": "allreduce", "names": ["a"]}, {"kind": "allreduce", "names": ["b"], "gather": True,
                                                     "_parts": {"b": [1, 2]}},
             {"kind": "allgather", "names": ["g"], "counts": [2, 0]},
             {"kind": "error", "etype": "unmatched", "names": ["x"], "ranks": [0, 1], "error": "no"}]
    assert m.steps(items) == [m.AllReduce(["a"]), m.AllReduce(["b"], True), m.AllGather(["g"], [2, 0]),
                              m.Fail(m.Cause.UNMATCHED, ["x"], [0, 1], "no")]
    assert m.steps(items)[1].parts == {"b": [1, 2]}


def test_long_announcements_split_into_atomic_pipe_writes():
    msg = m.Ready(1, [entry(f"grad/{i:04d}") for i in range(300)])
    parts = m.encode_split(msg, 4092)
    assert len(parts) > 1 and all(len(p) <= 4092 for p in parts)
    assert [e["name"] for p in parts for e in m.decode(p).entries] == [e["name"] for e in msg.entries]


def test_inline_data_is_a_view_and_must_add_up():
    data = np.arange(4, dtype=np.float32)
    payload = m.encode(m.Ready(1, [entry("a", _data=data), entry("b")]))
    got = m.decode(memoryview(payload)).entries
    np.testing.assert_array_equal(np.frombuffer(got[0]["_data"], np.float32), data)
    assert "_data" not in got[1]
    with pytest.raises(ValueError, match="does not match"):
        m.decode(payload[:-1])


@pytest.mark.parametrize("payload,match", [
    (b"\x01", "too short"),
    (b"\x63\x02\x00\x00\x00[]", "unknown control message code 99"),
    (b"\x01\x02\x00\x00\x00[]", "malformed Beat"),
    (b"\x06\x0d\x00\x00\x00[0,[[99,[]]]]", "unknown plan step code 99"),
    (b"\x01\x03\x00\x00\x00[1]x", "does not match"),
])
def test_malformed_messages_are_value_errors(payload, match):
    with pytest.raises(ValueError, match=match):
        m.decode(payload)


def test_data_path_decision_names_a_disagreeing_setting():
    joins = [m.Join(r, "auto", 65536, True, True, "h", 10 + r, 0) for r in range(2)]
    welcome = decide_data_path(joins[::-1])
    assert welcome.transport == "shm" and len(welcome.token) == 16 and not welcome.error
    # Between hosts, TCP, with every rank's data port; gRPC when told.
    apart = decide_data_path([m.Join(1, "auto", 65536, True, True, "other", 11, 0, 4321),
                              m.Join(0, "auto", 65536, True, True, "h", 10, 0, 1234)])
    assert apart.transport == "tcp" and apart.ports == [1234, 4321]
    told = decide_data_path([m.Join(r, "grpc", 65536, True, True, f"h{r}", 10 + r, 0) for r in range(2)])
    assert told.transport == "grpc" and told.ports == []
    bad = decide_data_path([joins[0], m.Join(1, "auto", 1024, True, True, "h", 11, 0)])
    assert bad.error == "Every worker needs the same `chunk_bytes` setting. Received: rank 0: 65536, rank 1: 1024"
