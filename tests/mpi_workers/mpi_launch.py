"""Start a worker script under ``mpirun`` for tests, never waiting forever.

The job runs in its own session; on timeout mpirun gets SIGTERM (it stops its ranks),
then every process left in the session (ranks may sit in process groups of their own)
gets SIGKILL, so no orphaned rank outlives the test.
"""
from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent


def run_mpi(reducer_name: str, np: int, script: str, *args: str, timeout: float = 240.0,
            env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``mpirun -np NP python WORKERS/script args`` with the reducer's mpirun.

    Returns ``(exit status, combined output)``; raises ``TimeoutError`` (after killing the
    process group) when the job runs past ``timeout`` seconds.
    """
    from hostreduce.reducers.mpi.select import mpirun_command

    cmd = mpirun_command(reducer_name, np, [sys.executable, str(WORKERS / script), *args])
    full_env = dict(os.environ if env is None else env)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH", "")]))
    # Never let a setting of the surrounding shell redirect mpi4py to another library.
    full_env.pop("MPI4PY_LIBMPI", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, cwd=str(ROOT), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            out = ""
        _kill_session(proc.pid)
        if proc.poll() is None:
            out += proc.communicate()[0] or ""
        raise TimeoutError(f"{' '.join(cmd)} did not finish within {timeout} s; output:\n{out}") from None
    return proc.returncode, out


def timings(output: str) -> dict[tuple[str, int], float]:
    """The ``TIMING <check> rank R: <s> s`` lines of a check's output, by (check, rank)."""
    return {(m[1], int(m[2])): float(m[3]) for m in re.finditer(r"TIMING (\w+) rank (\d+): ([0-9.]+) s", output)}


def mpi_skip_reason() -> str | None:
    """Why MPI tests cannot run here (no mpi4py, or no mpirun for its library), or None."""
    try:
        import mpi4py  # noqa: F401

        from hostreduce.reducers.mpi.select import mpirun_for

        mpirun_for("mpi")
    except Exception as exc:  # noqa: BLE001 - any failure means: skip, and say why
        return f"MPI not available: {type(exc).__name__}: {exc}"
    return None


HOROVOD_BUILD_HINT = "build it with scripts/build_horovod.sh"


@functools.lru_cache(maxsize=None)
def horovod_skip_reason() -> str | None:
    """Why the 'horovod' engine cannot run here (Horovod not built, or no mpirun for its
    MPI library), or None. Horovod is imported in a child process, so that this process
    loads neither TensorFlow nor Horovod's MPI library."""
    import importlib.util

    if importlib.util.find_spec("horovod") is None:
        return f"horovod not importable: No module named 'horovod'; {HOROVOD_BUILD_HINT}"
    probe = subprocess.run([sys.executable, "-c", "import horovod.tensorflow"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        lines = [line for line in probe.stderr.strip().splitlines() if line.strip()]
        return f"horovod not importable: {lines[-1] if lines else 'exit ' + str(probe.returncode)}; {HOROVOD_BUILD_HINT}"
    try:
        from hostreduce.reducers.mpi.select import mpirun_for

        mpirun_for("horovod")
    except Exception as exc:  # noqa: BLE001
        return f"horovod is installed but has no mpirun: {exc}"
    return None


def _kill_session(sid: int) -> None:
    """SIGKILL every process whose session id is ``sid`` (Linux /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
            if int(fields[3]) == sid:  # state ppid pgrp session
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            continue
