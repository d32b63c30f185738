"""Tests of the multi-process test harness ``hostreduce.testing.spawn``."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from hostreduce.testing import (
    RankFailedError,
    RankOutcome,
    RankTimeoutError,
    preload,
    run_ranks,
    run_ranks_allow_failure,
)


@pytest.fixture(autouse=True)
def fresh_ranks():
    """These tests are about ranks started as fresh interpreters (the suite's conftest
    preloads TensorFlow for every other test); the preloading tests turn it on."""
    before = preload(None)
    yield
    preload(before)


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


def _print_and_identify(rank: int, world_size: int, tag: str) -> dict:
    print(f"rank {rank} says hello", flush=True)
    return _identity(rank, world_size, tag)


def _block_for_ever() -> None:
    """What a hung rank does: never return (the harness kills it)."""
    threading.Event().wait()


def _raise_on_rank1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise _PeerGone("peer 0 stopped answering")
    _block_for_ever()
    return rank


def _hang_on_last(rank: int, world_size: int) -> int:
    if rank == world_size - 1:
        _block_for_ever()
    return rank


def _stuck_in_a_named_function(rank: int, world_size: int, marker: str) -> int:
    if rank == world_size - 1:
        _waits_here_for_ever(marker)
    return rank


def _waits_here_for_ever(marker: str) -> None:
    with open(marker, "w"):
        pass  # from now on this function is on the rank's stack, whenever the time is up
    _block_for_ever()


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
    with open(f"{path}.{rank}.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(f"{path}.{rank}.tmp", f"{path}.{rank}")
    if rank == 0:  # gives up once every rank has written its pid (or after a minute)
        deadline = time.monotonic() + 60
        while not all(os.path.exists(f"{path}.{r}") for r in range(world_size)) and time.monotonic() < deadline:
            time.sleep(0.01)
        raise RuntimeError("rank 0 gives up")
    _block_for_ever()


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


@pytest.mark.timeout(60)  # the hang guard: failing fast is the only way this test ends in time
def test_raising_rank_fails_fast_with_traceback() -> None:
    # The other ranks never end and the run's own timeout is far off: only the failure
    # of rank 1 can end the run.
    with pytest.raises(RankFailedError, match=r"rank 1 .*_PeerGone: peer 0 stopped answering") as info:
        run_ranks(_raise_on_rank1, 3, timeout=3600)
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
    # Rank 2 never ends: only the run's timeout ends the run (before the test's own).
    with pytest.raises(RankTimeoutError, match=r"ranks \[.*2\] of 3 had not finished after 3 s") as info:
        run_ranks(_hang_on_last, 3, timeout=3)
    assert 2 in info.value.ranks  # ranks 0 and 1 normally finish; a loaded machine may delay them


def _until_the_rank_was_stuck(run, marker: Path):
    """``run(timeout)`` of ``_stuck_in_a_named_function``: with a short timeout, and again
    with a long one if a loaded machine had not even brought the rank into the function
    when the short one was up. Returns what the run returned or raised."""
    for timeout in (3, 60):
        try:
            result = run(timeout)
        except RankTimeoutError as e:
            result = e
        if marker.exists():
            return result
    pytest.fail("the rank never reached the function it hangs in")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("preloaded", [False, True])
def test_a_hung_ranks_timeout_error_shows_its_stack(tmp_path: Path, preloaded: bool) -> None:
    if preloaded:
        pytest.importorskip("tensorflow")
        preload(["tensorflow"])
    marker = tmp_path / "stuck"
    err = _until_the_rank_was_stuck(
        lambda timeout: run_ranks(_stuck_in_a_named_function, 2, args=(str(marker),), timeout=timeout), marker)
    assert isinstance(err, RankTimeoutError), err
    assert 1 in err.ranks, err
    # Every thread's stack, the function it hangs in on top of the one that called it.
    assert "_waits_here_for_ever" in err.stacks[1] and "_stuck_in_a_named_function" in err.stacks[1], err
    assert "--- rank 1 ---" in str(err) and err.stacks[1] in str(err)
    assert "most recent call first" in err.stacks[1], err


@pytest.mark.timeout(180)
def test_a_hung_ranks_timeout_outcome_has_its_stack(tmp_path: Path) -> None:
    marker = tmp_path / "stuck"
    outcomes = _until_the_rank_was_stuck(
        lambda timeout: run_ranks_allow_failure(_stuck_in_a_named_function, 2, args=(str(marker),), timeout=timeout),
        marker)
    assert outcomes[1] == "timeout" and outcomes[1].kind == "timeout", outcomes
    assert "_waits_here_for_ever" in outcomes[1].traceback, outcomes[1].traceback


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


@pytest.mark.timeout(120)
def test_preloaded_ranks_fork_from_the_server_with_the_callers_environment_and_output(capfd) -> None:
    pytest.importorskip("tensorflow")
    preload(["tensorflow"])
    os.environ["SPAWN_TEST_REMOVED"] = "present-in-parent"
    try:
        results = run_ranks(_print_and_identify, 2, args=("p",), timeout=90,
                            env={"SPAWN_TEST_EXTRA": "x", "SPAWN_TEST_REMOVED": None})
        # a variable TensorFlow reads when it is imported, set for the ranks: fresh ranks
        fresh = run_ranks(_identity, 2, args=("f",), timeout=90, env={"TF_USE_LEGACY_KERAS": "0"})
    finally:
        del os.environ["SPAWN_TEST_REMOVED"]
    assert all(r["tf_loaded"] for r in results), results
    assert all(r["extra"] == "x" and r["removed"] is None for r in results)
    assert [r["task"] for r in results] == [{"type": "worker", "index": i} for i in range(2)]
    assert not any(r["tf_loaded"] for r in fresh), fresh
    out = capfd.readouterr().out
    assert "rank 0 says hello" in out and "rank 1 says hello" in out, out


@pytest.mark.timeout(120)
def test_preloaded_ranks_still_fail_fast_and_die_with_the_run(tmp_path) -> None:
    pytest.importorskip("tensorflow")
    preload(["tensorflow"])
    base = str(tmp_path / "pid")
    with pytest.raises(RankFailedError) as info:
        run_ranks(_write_pid_then, 2, args=(base,), timeout=60)
    assert info.value.rank == 0 and "rank 0 gives up" in str(info.value)
    pid = int(open(f"{base}.1").read())
    deadline = time.monotonic() + 10
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pid_alive(pid)
    with pytest.raises(RankTimeoutError):
        run_ranks(_hang_on_last, 2, timeout=3)


def test_preload_checks_its_argument() -> None:
    with pytest.raises(TypeError, match="`modules` must be a list of module names or None. Received: modules='numpy'"):
        preload("numpy")
