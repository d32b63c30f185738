"""The ring's process groups and its collectives beyond all-reduce, broadcast and
all-gather (reduce-scatter, reduce, all-to-all, send/receive, prod) across real
processes at 2 and 4 ranks on both data paths: every collective against numpy
(``collectives_check.py``, two disjoint groups at once with the same names included),
and the failures: a group or send/receive mismatch, a dead peer."""
from __future__ import annotations

import pytest

from hostreduce.testing import run_ranks, run_ranks_allow_failure
from tests import ring_group_workers as w


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["grpc", "shm"])
@pytest.mark.parametrize("size", [2, 4])
def test_every_collective_on_the_world_and_on_groups_matches_numpy(size, transport):
    assert run_ranks(w.check_everything, size, args=(transport,), timeout=200) == [transport] * size


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_a_collective_submitted_on_different_groups_fails_on_every_member(transport, tmp_path):
    outs = run_ranks(w.group_mismatch, 4, args=(transport, str(tmp_path)), timeout=60)
    for r, o in enumerate(outs):
        err = o["error"]
        assert err.startswith("TensorMismatchError") and "'x'" in err, f"rank {r}: {err}"
        assert "rank 1: group[0, 1, 2]" in err and "rank 2: group[1, 2, 3]" in err, f"rank {r}: {err}"
        assert o["after"] == 4.0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_send_and_recv_that_disagree_fail_on_both_ranks(transport):
    outs = run_ranks(w.p2p_mismatch, 2, args=(transport,), timeout=60)
    for r, o in enumerate(outs):
        assert o["shape"].startswith("TensorMismatchError") and "'p'" in o["shape"], f"rank {r}: {o}"
        assert "rank 0: (3,)" in o["shape"] and "rank 1: (4,)" in o["shape"], f"rank {r}: {o}"
        assert o["dtype"].startswith("TensorMismatchError") and "float64" in o["dtype"] and "int32" in o["dtype"]
        assert o["after"] == 2.0


def _dead_peer(size, victim, transport):
    outs = run_ranks_allow_failure(w.die_in_new_collectives, size, args=(transport, victim), timeout=60)
    assert outs[victim] == "killed"
    for r, o in enumerate(outs):
        if r != victim:
            assert o.startswith("PeerLostError"), f"rank {r}: {o}"
            assert f"rank {victim}" in o.split("s: ", 1)[1], f"rank {r}: {o}"
    return outs


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["grpc", "shm"])
@pytest.mark.parametrize("size,victim", [(2, 1), (4, 2)])
def test_a_dead_peer_in_the_new_collectives_is_named_on_every_survivor(size, victim, transport):
    _dead_peer(size, victim, transport)


@pytest.mark.perf
@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["grpc", "shm"])
@pytest.mark.parametrize("size,victim", [(2, 1), (4, 2)])
def test_a_dead_peer_in_the_new_collectives_is_named_within_seconds(size, victim, transport):
    for r, o in enumerate(_dead_peer(size, victim, transport)):
        if r != victim:
            assert float(o.split(" after ")[1].split("s:")[0]) < 10.0, f"rank {r}: {o}"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_prod_on_every_path(transport):
    outs = run_ranks(w.prod_on_every_path, 2, args=(transport,), timeout=60)
    for o in outs:
        assert all(v == 6 for v in o["ints"]) and len(o["ints"]) in (6, 7), o
        assert o["floats"] == [pytest.approx(o["expect"])] * 2, o
    if transport == "shm":
        assert all(o["stats"].get("fast_lane", 0) >= 1 for o in outs)


def _group_waits(case, error, tmp_path):
    outs = run_ranks(w.group_waits, 4, args=("shm", case, str(tmp_path)), timeout=60)
    for r, o in enumerate(outs):
        took, _, err = o.partition(" s: ")
        if case == "stall" and r != 0:
            assert err == "idle"
            continue
        assert err.startswith(error), f"rank {r}: {o}"
    return outs


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case,error", [("stall", "CollectiveTimeoutError"), ("unmatched", "UnmatchedCollectiveError")])
def test_group_collectives_that_cannot_complete_fail_instead_of_hanging(case, error, tmp_path):
    _group_waits(case, error, tmp_path)


@pytest.mark.perf
@pytest.mark.timeout(90)
@pytest.mark.parametrize("case,error", [("stall", "CollectiveTimeoutError"), ("unmatched", "UnmatchedCollectiveError")])
def test_group_collectives_that_cannot_complete_fail_within_seconds(case, error, tmp_path):
    for r, o in enumerate(_group_waits(case, error, tmp_path)):
        took, _, err = o.partition(" s: ")
        if err != "idle":
            assert float(took) < 5.0, f"rank {r}: {o}"  # timeout_s is 2
