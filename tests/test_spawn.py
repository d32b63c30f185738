"""Tests of the multi-process test harness ``hostreduce.testing.spawn``."""
from __future__ import annotations

import json
import os
import time

import pytest

from hostreduce.testing import (
    RankFailedError,
    RankOutcome,
    RankTimeoutError,
    run_ranks,
    run_ranks_allow_failure,
)


class _PeerGone(RuntimeError):
    pass


def _identity(rank: int, world_size: int, tag: str) -> dict:
    cfg = json.loads(os.environ["TF_CONFIG"])
    return {
        "rank": rank,
        "world_size": world_size,
        "tag": tag,
        "task": cfg["task"],
        "cluster": cfg["cluster"]["worker"],
        "secret": os.environ["HOSTREDUCE_SECRET"],
        "pid": os.getpid(),
        "extra": os.environ.get("SPAWN_TEST_EXTRA"),
        "removed": os.environ.get("SPAWN_TEST_REMOVED"),
        "tf_loaded": "tensorflow" in __import__("sys").modules,
    }


def _raise_on_rank1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise _PeerGone("peer 0 stopped answering")
    time.sleep(60)
    return rank


def _hang_on_last(rank: int, world_size: int) -> int:
    if rank == world_size - 1:
        time.sleep(60)
    return rank


def _rank1_dies(rank: int, world_size: int) -> int:
    if rank == 1:
        os.kill(os.getpid(), 9)
    if rank == 2:
        raise ValueError("bad value on rank 2")
    return rank * 10


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is not running.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _write_pid_then(rank: int, world_size: int, path: str) -> None:
    with open(f"{path}.{rank}", "w") as f:
        f.write(str(os.getpid()))
    if rank == 0:
        time.sleep(0.5)
        raise RuntimeError("rank 0 gives up")
    time.sleep(60)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_in_rank_order(world_size: int) -> None:
    os.environ["SPAWN_TEST_REMOVED"] = "present-in-parent"
    try:
        results = run_ranks(
            _identity, world_size, args=("t",), timeout=30,
            env={"SPAWN_TEST_EXTRA": "x", "SPAWN_TEST_REMOVED": None},
        )
    finally:
        del os.environ["SPAWN_TEST_REMOVED"]
    assert [r["rank"] for r in results] == list(range(world_size))
    assert all(r["world_size"] == world_size and r["tag"] == "t" for r in results)
    assert [r["task"] for r in results] == [{"type": "worker", "index": i} for i in range(world_size)]
    cluster = results[0]["cluster"]
    assert len(cluster) == world_size and len(set(cluster)) == world_size
    assert all(a.startswith("127.0.0.1:") for a in cluster)
    assert all(r["cluster"] == cluster for r in results)
    assert len({r["secret"] for r in results}) == 1 and len(results[0]["secret"]) == 64
    assert len({r["pid"] for r in results}) == world_size and os.getpid() not in {r["pid"] for r in results}
    assert all(r["extra"] == "x" and r["removed"] is None for r in results)
    assert not any(r["tf_loaded"] for r in results)


@pytest.mark.timeout(60)
def test_fresh_secret_per_call() -> None:
    a = run_ranks(_identity, 1, args=("a",))[0]["secret"]
    b = run_ranks(_identity, 1, args=("b",))[0]["secret"]
    assert a != b


@pytest.mark.timeout(60)
def test_raising_rank_fails_fast_with_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank 1 .*_PeerGone: peer 0 stopped answering") as info:
        run_ranks(_raise_on_rank1, 3, timeout=30)
    assert time.monotonic() - start < 15  # the other ranks sleep 60 s; they were killed
    err = info.value
    assert isinstance(err, AssertionError)
    assert err.rank == 1 and err.exc_type == "_PeerGone"
    assert "Traceback (most recent call last)" in str(err) and "_raise_on_rank1" in str(err)


@pytest.mark.timeout(60)
def test_other_ranks_are_dead_after_failure(tmp_path) -> None:
    base = str(tmp_path / "pid")
    with pytest.raises(RankFailedError, match="rank 0 gives up"):
        run_ranks(_write_pid_then, 3, args=(base,), timeout=30)
    pids = [int(open(f"{base}.{r}").read()) for r in range(3)]
    assert not any(_pid_alive(p) for p in pids)


@pytest.mark.timeout(60)
def test_hanging_rank_times_out() -> None:
    start = time.monotonic()
    with pytest.raises(RankTimeoutError, match=r"ranks \[.*2\] of 3 had not finished after 3 s") as info:
        run_ranks(_hang_on_last, 3, timeout=3)
    assert 2 in info.value.ranks  # ranks 0 and 1 normally finish; a loaded machine may delay them
    assert time.monotonic() - start < 15


@pytest.mark.timeout(60)
def test_allow_failure_reports_every_rank() -> None:
    outcomes = run_ranks_allow_failure(_rank1_dies, 4, timeout=30)
    assert outcomes[0] == 0 and outcomes[3] == 30
    assert outcomes[1] == "killed" and isinstance(outcomes[1], RankOutcome) and outcomes[1].exitcode == -9
    assert outcomes[2].startswith("ValueError: bad value on rank 2")
    assert outcomes[2].kind == "error" and "Traceback" in outcomes[2].traceback


@pytest.mark.timeout(60)
def test_allow_failure_timeout() -> None:
    outcomes = run_ranks_allow_failure(_hang_on_last, 2, timeout=3)
    assert outcomes[0] in (0, "timeout") and outcomes[1] == "timeout"
    assert outcomes[1].kind == "timeout"


@pytest.mark.timeout(60)
def test_killed_rank_raises_in_run_ranks() -> None:
    with pytest.raises(RankFailedError, match="rank 1 .*killed"):
        run_ranks(_rank1_dies, 2, timeout=30)


@pytest.mark.timeout(30)
def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size=0"):
        run_ranks(_identity, 0)
    with pytest.raises(ValueError, match="timeout=-1"):
        run_ranks(_identity, 1, timeout=-1)
    with pytest.raises(TypeError, match="top-level"):
        run_ranks(lambda r, w: r, 1)
