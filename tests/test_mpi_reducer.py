"""The 'mpi' reducer under mpirun (the mpirun that belongs to mpi4py's MPI library)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.mpi_workers.mpi_launch import mpi_skip_reason, run_mpi, timings

pytestmark = pytest.mark.mpi


_SKIP = mpi_skip_reason()


@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
@pytest.mark.parametrize("np_", [1, 2])
def test_mpi_reducer_matches_numpy(np_: int) -> None:
    code, out = run_mpi("mpi", np_, "reducer_check.py", "mpi", timeout=180)
    assert code == 0, out
    for rank in range(np_):
        assert f"OK rank {rank}/{np_}" in out, out


@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_mpi_collectives_at_4_ranks() -> None:
    """Every collective, on groups (two disjoint at once, non-consecutive ranks), p2p,
    mismatch, compression and an absent peer, at 4 ranks (2 ranks: in the test above)."""
    code, out = run_mpi("mpi", 4, "collectives_worker.py", "mpi", timeout=180)
    assert code == 0, out
    for rank in range(4):
        assert f"OK rank {rank}/4" in out, out


@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_mpi_reducer_asks_for_rabenseifners_nonblocking_allreduce_unless_the_job_chose() -> None:
    """Open MPI's own choice of nonblocking all-reduce for small groups takes twice the
    time on large buffers: the reducer sets Rabenseifner's before MPI starts, and keeps
    a value the job set (Open MPI passes ``OMPI_MCA_*`` variables to every rank)."""
    import os

    from hostreduce.reducers.mpi.reducer import NBC_ALLREDUCE_VAR

    env = {k: v for k, v in os.environ.items() if k != NBC_ALLREDUCE_VAR}
    for preset, expected in ((None, "3"), ("1", "1")):
        run_env = env if preset is None else {**env, NBC_ALLREDUCE_VAR: preset}
        code, out = run_mpi("mpi", 3, "nbc_setting.py", timeout=120, env=run_env)
        assert code == 0, out
        for rank in range(3):
            assert f"NBC rank {rank}: {expected}" in out, out


@pytest.mark.perf
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_mpi_collective_timeouts_end_within_seconds() -> None:
    """The timeouts the tests above provoke (timeout_s=0.5) end in seconds: a
    reduce-scatter without its last rank, a group without a member, a lone barrier."""
    code, out = run_mpi("mpi", 3, "collectives_worker.py", "mpi", "timeouts", timeout=180)
    assert code == 0, out
    got = timings(out)
    assert set(got) == {("dead_peer", 0), ("dead_peer", 1), ("absent_member", 0), ("barrier_timeout", 0)}, out
    for (check, rank), seconds in got.items():
        assert seconds < (5 if check == "barrier_timeout" else 10), (check, rank, seconds)


def test_mpirun_selection() -> None:
    from hostreduce.errors import ConfigError
    from hostreduce.reducers.mpi.select import loaded_libmpi, mpirun_command, mpirun_for

    if _SKIP is None:
        assert Path(mpirun_for("mpi")).exists()
        cmd = mpirun_command("mpi", 2, ["python", "x.py"])
        assert cmd[1:3] == ["-np", "2"] and cmd[-2:] == ["python", "x.py"]
    with pytest.raises(ConfigError, match="reducer_name"):
        mpirun_for("ring")
    with pytest.raises(ConfigError, match="np"):
        mpirun_command("mpi", 0, [])
    assert isinstance(loaded_libmpi(), list)
