"""Horovod's questions about how it was built and what the job runs on, answered for
hostreduce: MPI where mpi4py is installed (the MPI engine), no Gloo, NCCL, DDL, oneCCL,
CUDA or ROCm collectives (every reduction runs on the host), and the timeline.
"""
from __future__ import annotations

import importlib.util
import os
import sys

from ..errors import ConfigError
from . import job as _engine

__all__ = ["mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
           "ddl_built", "ccl_built", "cuda_built", "rocm_built", "is_homogeneous", "start_timeline",
           "stop_timeline"]


def mpi_built() -> bool:
    """Whether the MPI engine can run here (mpi4py is installed)."""
    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """Whether this job was started by ``mpirun`` (its engine is then MPI or Horovod's core)."""
    return _engine.job().cluster.source == "mpirun"


def mpi_threads_supported() -> bool:
    """Whether MPI was started with ``MPI_THREAD_MULTIPLE`` (False until the MPI engine has started it)."""
    if not mpi_enabled():
        raise ConfigError("mpi_threads_supported() needs a job started by mpirun; this job was not. "
                          f"Received: job source={_engine.job().cluster.source!r}")
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized():
        return False
    return bool(mpi.Query_thread() == mpi.THREAD_MULTIPLE)


def gloo_built() -> bool:
    """False: hostreduce's own ring takes Gloo's place."""
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> int:
    """0: no NCCL (Horovod returns NCCL's version number when built with it)."""
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def is_homogeneous() -> bool:
    """Whether every host runs the same number of the job's processes."""
    spec = _engine.job().cluster
    if not spec.addresses:
        return spec.size % max(1, spec.local_size) == 0
    counts: dict[str, int] = {}
    for host in spec.hosts:
        counts[host] = counts.get(host, 0) + 1
    return len(set(counts.values())) == 1


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording this job's timeline: rank 0 writes ``file_path``, rank r > 0
    ``<file_path>.rank<r>`` (Chrome trace format), on :func:`stop_timeline` and at exit.
    ``mark_cycles`` is accepted (hostreduce has no fusion cycles to mark)."""
    if not isinstance(file_path, (str, os.PathLike)) or not os.fspath(file_path):
        raise ConfigError(f"`file_path` must be a non-empty path. Received: file_path={file_path!r}")
    job = _engine.job()
    path = os.path.abspath(os.fspath(file_path))
    job.timeline.start(path if job.cluster.rank == 0 else f"{path}.rank{job.cluster.rank}")


def stop_timeline() -> None:
    """Write the timeline started by :func:`start_timeline` and stop recording."""
    _engine.job().timeline.stop()
