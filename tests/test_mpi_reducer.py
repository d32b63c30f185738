"""The 'mpi' reducer under mpirun (the mpirun that belongs to mpi4py's MPI library)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi_workers"))
from mpi_launch import run_mpi  # noqa: E402

pytestmark = pytest.mark.mpi


def _mpi_available() -> str | None:
    try:
        import mpi4py  # noqa: F401

        from hostreduce.reducers._mpi_select import mpirun_for

        mpirun_for("mpi")
    except Exception as exc:  # noqa: BLE001
        return f"MPI not available: {type(exc).__name__}: {exc}"
    return None


_SKIP = _mpi_available()


@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
@pytest.mark.parametrize("np_", [1, 2])
def test_mpi_reducer_matches_numpy(np_: int) -> None:
    code, out = run_mpi("mpi", np_, "reducer_check.py", "mpi", timeout=180)
    assert code == 0, out
    for rank in range(np_):
        assert f"OK rank {rank}/{np_}" in out, out


def test_mpirun_selection() -> None:
    from hostreduce.errors import ConfigError
    from hostreduce.reducers._mpi_select import loaded_libmpi, mpirun_command, mpirun_for

    if _SKIP is None:
        assert Path(mpirun_for("mpi")).exists()
        cmd = mpirun_command("mpi", 2, ["python", "x.py"])
        assert cmd[1:3] == ["-np", "2"] and cmd[-2:] == ["python", "x.py"]
    with pytest.raises(ConfigError, match="reducer_name"):
        mpirun_for("ring")
    with pytest.raises(ConfigError, match="np"):
        mpirun_command("mpi", 0, [])
    assert isinstance(loaded_libmpi(), list)
