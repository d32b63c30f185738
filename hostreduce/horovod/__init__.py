"""Horovod's TensorFlow process API on hostreduce: ``import hostreduce.horovod as hvd``.

A script written for ``horovod.tensorflow`` (or Graphcore's ``ipu.horovod``) asks the
same questions of the job: ``hvd.init()``, then ``hvd.rank()``, ``hvd.size()``,
``hvd.local_rank()`` ... to shard its data and pick its device. The job is found as the
strategies find it: under ``mpirun`` from the launcher's variables, otherwise from
``TF_CONFIG`` (``hostreduce run`` sets it), otherwise a single process.
"""
from __future__ import annotations

import os
import threading
from typing import Any

from ..cluster import ClusterSpec, resolve_cluster
from ..cluster.mpi_env import spec_from_mpi_env
from ..errors import HostReduceError

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
           "cross_size", "NotInitializedError"]


class NotInitializedError(HostReduceError, ValueError):
    """A ``hostreduce.horovod`` call that needs the job came before ``init()``."""


_lock = threading.Lock()
_cluster: ClusterSpec | None = None


def init(comm: Any = None) -> None:
    """Find this process's place in the job. Safe to call more than once.

    Args:
        comm: accepted for Horovod compatibility; only None (the whole job) is supported.
    """
    global _cluster
    if comm is not None:
        raise HostReduceError(
            "`comm` is not supported: hostreduce.horovod.init() always spans the whole job. "
            f"Received: comm={comm!r}"
        )
    with _lock:
        if _cluster is None:
            _cluster = spec_from_mpi_env(os.environ) or resolve_cluster()


def shutdown() -> None:
    """Forget the job (``init()`` may be called again)."""
    global _cluster
    with _lock:
        _cluster = None


def is_initialized() -> bool:
    return _cluster is not None


def _spec() -> ClusterSpec:
    spec = _cluster
    if spec is None:
        raise NotInitializedError("hostreduce.horovod has not been initialized; call hvd.init() first.")
    return spec


def rank() -> int:
    """This process's rank in the job, 0 .. size() - 1."""
    return _spec().rank


def size() -> int:
    """Number of processes in the job."""
    return _spec().size


def local_rank() -> int:
    """This process's index among the job's processes on its host."""
    return _spec().local_rank


def local_size() -> int:
    """Number of the job's processes on this host."""
    return _spec().local_size


def _hosts(spec: ClusterSpec) -> list[str]:
    if spec.addresses:
        return list(dict.fromkeys(spec.hosts))
    return [str(i) for i in range(max(1, spec.size // max(1, spec.local_size)))]


def cross_rank() -> int:
    """Index of this process's host among the job's hosts."""
    spec = _spec()
    if spec.addresses:
        return _hosts(spec).index(spec.hosts[spec.rank])
    return spec.rank // max(1, spec.local_size)


def cross_size() -> int:
    """Number of hosts in the job."""
    return len(_hosts(_spec()))
