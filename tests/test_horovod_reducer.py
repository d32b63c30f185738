"""The 'horovod' reducer under the mpirun of the MPI library Horovod links against.

Skipped, with the reason, only when Horovod is not importable; build it with
scripts/build_horovod.sh.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.mpi_workers.mpi_launch import horovod_skip_reason, run_mpi, timings

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def horovod_ready() -> None:
    reason = horovod_skip_reason()
    if reason is not None:
        pytest.skip(reason)


def test_horovod_reducer_matches_numpy(horovod_ready: None) -> None:
    code, out = run_mpi("horovod", 2, "reducer_check.py", "horovod", timeout=240)
    assert code == 0, out
    for rank in range(2):
        assert f"OK rank {rank}/2" in out, out


@pytest.mark.slow
def test_horovod_collectives_at_4_ranks(horovod_ready: None) -> None:
    """The full collective set on process sets at 4 ranks (2 ranks: in the test above)."""
    code, out = run_mpi("horovod", 4, "collectives_worker.py", "horovod", timeout=400)
    assert code == 0, out
    for rank in range(4):
        assert f"OK rank {rank}/4" in out, out


@pytest.mark.perf
def test_horovod_collective_timeouts_end_within_seconds(horovod_ready: None) -> None:
    """The timeouts the tests above provoke (timeout_s=0.5) end in seconds: a
    reduce-scatter without its last rank, a lone barrier."""
    code, out = run_mpi("horovod", 2, "collectives_worker.py", "horovod", "timeouts", timeout=240)
    assert code == 0, out
    got = timings(out)
    assert set(got) == {("dead_peer", 0), ("barrier_timeout", 0)}, out
    for (check, rank), seconds in got.items():
        assert seconds < (5 if check == "barrier_timeout" else 10), (check, rank, seconds)


def test_horovod_mpirun_is_not_the_wheel(horovod_ready: None) -> None:
    from hostreduce.reducers.mpi.select import horovod_libmpi, mpirun_for

    lib = horovod_libmpi()
    assert lib is not None and lib.name.startswith("libmpi.so")
    assert Path(mpirun_for("horovod")).exists()
    assert Path(mpirun_for("horovod")).resolve() != Path(mpirun_for("mpi")).resolve()


def test_missing_horovod_error_names_the_build_script(monkeypatch: pytest.MonkeyPatch) -> None:
    from hostreduce.reducers import horovod as mod

    monkeypatch.setitem(sys.modules, "horovod", None)  # makes `import horovod...` fail
    monkeypatch.delitem(sys.modules, "horovod.tensorflow", raising=False)
    with pytest.raises(mod.HorovodUnavailableError, match="build_horovod.sh") as info:
        mod.import_horovod()
    assert isinstance(info.value, ImportError)
