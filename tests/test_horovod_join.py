"""``hvd.join()``: a rank out of data joins, the others' all-reduces complete with its
zeros, other collectives fail with ``JoinedRankError`` (``FailedPreconditionError``
from the faces), and every rank's join returns the last rank to join.

The ring's coordinator is tested directly (pure logic); the Horovod face runs Horovod's
own join test on CPU (tests/hvd_workers/join.py) on the ring, under mpirun with the MPI
engine and, where Horovod is built, with the 'horovod' engine.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from hostreduce.reducers.ring.messages import (JOIN_NAME, AllReduce, Barrier, Joined, Plan, decode, encode,
                                               steps)
from hostreduce.reducers.ring.negotiation import Coordinator

HERE = Path(__file__).resolve().parent


def entry(name, kind="allreduce", dtype="float32", shape=(4,), op="sum", root=0, group=None):
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    e = {"name": name, "kind": kind, "dtype": dtype, "shape": list(shape), "op": op, "root": root,
         "nbytes": nbytes}
    if group is not None:
        e["group"] = list(group)
    return e


def join():
    return entry(JOIN_NAME, kind="join", shape=(0,))


def coordinator(size=2, timeout=30.0, clock=None, threshold=1 << 20):
    plans: list[dict] = []
    kwargs = {} if clock is None else {"clock": clock}
    return Coordinator(size, threshold, plans.extend, timeout, **kwargs), plans


# ---------------------------------------------------------------- the coordinator
def test_a_joined_rank_counts_for_the_others_allreduces_with_zeros_and_the_last_join_ends_it():
    coord, plans = coordinator()
    coord.on_ready(1, [join()])
    assert plans == []
    coord.on_ready(0, [entry("a", dtype="int64", shape=(2, 3), op="mean")])
    (item,) = plans
    assert item["kind"] == "allreduce" and item["names"] == ["a"]
    assert item["joined"] == [1] and item["zeros"] == [["int64", [2, 3]]] and item["op"] == "mean"
    assert "gather" not in item
    coord.on_ready(0, [join()])
    assert plans[1] == {"kind": "join", "names": [JOIN_NAME], "last": 0}


def test_what_waited_only_for_the_joining_rank_runs_when_it_joins_and_the_job_is_unjoined_after():
    coord, plans = coordinator(size=3)
    coord.on_ready(0, [entry("a")])
    coord.on_ready(2, [entry("a"), entry("b")])
    coord.on_ready(1, [join()])
    assert [(i["names"], i["joined"]) for i in plans] == [(["a"], [1])]
    coord.on_ready(0, [join()])   # b: rank 2 alone, with the zeros of ranks 0 and 1
    assert plans[1]["names"] == ["b"] and plans[1]["joined"] == [0, 1]
    coord.on_ready(2, [join()])
    assert [i["kind"] for i in plans] == ["allreduce", "allreduce", "join"]
    assert plans[2]["last"] == 2
    coord.on_ready(0, [entry("c")])   # no rank is joined any more
    assert len(plans) == 3
    coord.on_ready(1, [entry("c")])
    coord.on_ready(2, [entry("c")])
    assert plans[3]["names"] == ["c"] and "joined" not in plans[3]


def test_allreduces_with_joined_ranks_fuse_with_their_zeros_and_never_take_the_gather_path():
    coord, plans = coordinator(threshold=1 << 20)
    coord.on_ready(1, [join()])
    coord.on_ready(0, [{**entry("a"), "_data": b"x" * 16}, {**entry("b", shape=(3,)), "_data": b"y" * 12}])
    (item,) = plans
    assert item["names"] == ["a", "b"] and item["zeros"] == [["float32", [4]], ["float32", [3]]]
    assert "gather" not in item and "_parts" not in item


@pytest.mark.parametrize("kind", ["broadcast", "allgather", "reducescatter", "alltoall", "reduce"])
def test_other_collectives_of_the_job_fail_on_the_ranks_that_submitted_them(kind):
    coord, plans = coordinator(size=3)
    coord.on_ready(2, [join()])
    coord.on_ready(0, [entry("x", kind=kind)])
    assert plans == []
    coord.on_ready(1, [entry("x", kind=kind)])
    (item,) = plans
    assert item["kind"] == "error" and item["etype"] == "joined" and item["ranks"] == [0, 1]
    assert "'x'" in item["error"] and "[2] have joined" in item["error"]


def test_a_send_to_a_joined_rank_fails_at_once():
    coord, plans = coordinator()
    coord.on_ready(1, [join()])
    coord.on_ready(0, [entry("s", kind="send", root=1)])
    (item,) = plans
    assert item["etype"] == "joined" and item["ranks"] == [0]


def test_barriers_pass_joined_ranks():
    coord, plans = coordinator(size=3)
    coord.on_ready(1, [join()])
    coord.on_ready(0, [entry("__barrier__/1", kind="barrier")])
    coord.on_ready(2, [entry("__barrier__/1", kind="barrier")])
    (item,) = plans
    assert item["kind"] == "barrier" and item["joined"] == [1]


def test_process_groups_are_not_joined():
    coord, plans = coordinator(size=3)
    coord.on_ready(1, [join()])
    coord.on_ready(2, [entry("g", group=(1, 2))])
    assert plans == []
    coord.on_ready(0, [entry("g0", group=(0, 1)), entry("w")])
    coord.on_ready(2, [entry("w")])
    assert [i["names"] for i in plans] == [["w"]]


def test_mismatches_among_the_ranks_that_did_not_join_are_still_reported():
    coord, plans = coordinator(size=3)
    coord.on_ready(0, [join()])
    coord.on_ready(1, [entry("m", shape=(4,))])
    coord.on_ready(2, [entry("m", shape=(5,))])
    (item,) = plans
    assert item["etype"] == "mismatch" and "rank 1: (4,), rank 2: (5,)" in item["error"]


def test_a_rank_that_closes_without_joining_fails_the_join():
    coord, plans = coordinator(size=3)
    coord.on_ready(0, [join()])
    coord.on_ready(1, [join()])
    coord.mark_departed(2)
    (item,) = plans
    assert item["etype"] == "departed" and item["names"] == [JOIN_NAME] and item["ranks"] == [0, 1]
    assert "[2]" in item["error"]


def test_a_join_fails_when_the_others_announce_nothing_for_the_timeout():
    now = [0.0]
    coord, plans = coordinator(size=3, timeout=5.0, clock=lambda: now[0])
    coord.on_ready(1, [join()])
    now[0] = 4.0
    coord.on_ready(0, [entry("a")])   # activity: the wait starts again
    coord.on_ready(2, [entry("a")])
    now[0] = 8.0
    coord.check_stalls()
    assert [i["kind"] for i in plans] == ["allreduce"]
    now[0] = 9.5
    coord.check_stalls()
    item = plans[-1]
    assert item["etype"] == "stall" and item["names"] == [JOIN_NAME] and item["ranks"] == [1]
    assert "ranks [0, 2] neither joined" in item["error"]
    coord.on_ready(0, [entry("b")])   # the failed join no longer counts
    assert len(plans) == 2


def test_a_join_fails_as_lost_when_a_rank_that_did_not_join_stopped_answering():
    now = [0.0]
    coord, plans = coordinator(size=2, timeout=5.0, clock=lambda: now[0])
    coord.on_ready(0, [join()])
    now[0] = 6.0
    coord.check_stalls(lambda missing: f"rank {missing[0]} has not answered")
    (item,) = plans
    assert item["etype"] == "lost" and item["error"] == "rank 1 has not answered"


def test_ranks_all_waiting_while_one_has_joined_fail_at_once():
    now = [0.0]
    coord, plans = coordinator(size=3, clock=lambda: now[0])
    coord.on_ready(0, [join()])
    coord.on_ready(1, [entry("p")])
    coord.on_ready(2, [entry("q")])
    for rank, name in ((0, JOIN_NAME), (1, "p"), (2, "q")):
        coord.on_blocked(rank, name)
    coord.check_blocked()
    now[0] = 1.0
    coord.check_blocked()
    (item,) = plans
    assert item["etype"] == "unmatched" and "rank 0 has joined" in item["error"]


def test_steps_with_joined_ranks_travel_unchanged():
    items = [{"kind": "allreduce", "names": ["a", "b"], "sid": 3, "joined": [1], "op": "mean",
              "zeros": [["float16", [2, 3]], ["int32", []]]},
             {"kind": "barrier", "names": ["__barrier__/2"], "joined": [0, 2]},
             {"kind": "join", "names": [JOIN_NAME], "last": 2}]
    plan = steps(items)
    assert plan[0] == AllReduce(["a", "b"], sid=3, joined=(1,), zeros=[["float16", [2, 3]], ["int32", []]], op="mean")
    assert plan[1] == Barrier(["__barrier__/2"], joined=(0, 2)) and plan[2] == Joined([JOIN_NAME], 2)
    assert decode(encode(Plan(0, plan))) == Plan(0, plan)


# ---------------------------------------------------------------- Horovod's join test, per engine
@pytest.mark.tf
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_horovod_join_on_the_ring(transport: str) -> None:
    """On one host: shared memory with the fast lane, and gRPC (with the small
    all-reduces that travel with their announcements)."""
    from hostreduce.testing import run_ranks
    from tests.hvd_workers import join as worker

    got = run_ranks(worker.rank_main, 2, timeout=280, env={"HOSTREDUCE_TRANSPORT": transport})
    assert got == [worker.CHECKS, worker.CHECKS]


def _mpirun_join(reducer: str, *args: str) -> None:
    from tests.hvd_workers import join as worker
    from tests.script_jobs import base_env, run_mpirun

    checks = 1 if args else worker.CHECKS
    job = run_mpirun(HERE / "hvd_workers" / "join.py", args, env=base_env(), timeout=280, reducer=reducer)
    assert job.returncode == 0, job.output
    assert sorted(re.findall(rf"RESULT rank (\d)/2: checks={checks}(?!\d)", job.output)) == ["0", "1"], job.output


def _mpi_missing() -> str | None:
    from tests.mpi_workers.mpi_launch import mpi_skip_reason

    return mpi_skip_reason()


@pytest.mark.tf
@pytest.mark.slow
def test_horovod_join_under_mpirun_on_the_mpi_engine() -> None:
    reason = _mpi_missing()
    if reason:
        pytest.skip(reason)
    _mpirun_join("mpi")


@pytest.mark.tf
@pytest.mark.slow
@pytest.mark.mpi
def test_horovod_join_under_mpirun_on_horovods_core() -> None:
    from tests.mpi_workers.mpi_launch import horovod_skip_reason

    reason = horovod_skip_reason()
    if reason:
        pytest.skip(reason)
    # One join per process: from the second on, Horovod 0.28.1's TensorFlow join is not
    # reliable on CPU (docs/guides/horovod_compatibility.md).
    _mpirun_join("horovod", "once")


# ---------------------------------------------------------------- the ring's join under faults
def test_a_peer_killed_while_the_other_has_joined_fails_the_join() -> None:
    from hostreduce.testing import run_ranks_allow_failure
    from tests.hvd_workers import join as worker

    got = run_ranks_allow_failure(worker.ring_join_peer_killed, 2, timeout=120)
    assert got[0] == "killed" and got[1] == "PeerLostError", got


def test_a_peer_that_closes_without_joining_fails_the_join() -> None:
    from hostreduce.testing import run_ranks
    from tests.hvd_workers import join as worker

    got = run_ranks(worker.ring_join_peer_closed, 2, timeout=120)
    assert got[1] == "closed" and got[0].startswith("PeerLostError") and "[1]" in got[0], got


def test_a_join_fails_when_the_others_run_nothing_for_the_timeout(tmp_path: Path) -> None:
    from hostreduce.testing import run_ranks
    from tests.hvd_workers import join as worker

    assert run_ranks(worker.ring_join_stalls, 2, args=(str(tmp_path),), timeout=120) == ["waited",
                                                                                          "CollectiveTimeoutError"]
