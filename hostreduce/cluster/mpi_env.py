"""Read this process's rank from the variables an MPI or Horovod launcher sets.

Recognised launchers, checked in this order:

* Open MPI ``mpirun``: ``OMPI_COMM_WORLD_RANK``/``SIZE``/``LOCAL_RANK``/``LOCAL_SIZE``;
* MPICH / Intel MPI (Hydra): ``PMI_RANK``/``PMI_SIZE``, with ``MPI_LOCALRANKID`` and
  ``MPI_LOCALNRANKS`` for the local placement when present;
* ``horovodrun`` (gloo): ``HOROVOD_RANK``/``SIZE``/``LOCAL_RANK``/``LOCAL_SIZE``.

When a launcher gives no local placement the rank is taken to be alone on its host.

``hostreduce run`` sets the Horovod variables too (:func:`horovod_env`), beside each
worker's ``TF_CONFIG``, so that scripts and tests that read them as ``horovodrun``'s
see the same rank and size. Such a worker is a ``TF_CONFIG`` worker (its engine is the
ring): Horovod variables that agree with a ``TF_CONFIG`` are left to it, and ones that
disagree with it are an error.
"""
from __future__ import annotations

import re
from typing import Mapping, NamedTuple

from ..errors import ClusterError
from .spec import ClusterSpec
from .tf_config import TF_CONFIG, parse_tf_config

__all__ = ["Launcher", "LAUNCHERS", "HOROVOD", "HOROVOD_VARIABLES", "detect_launcher", "spec_from_mpi_env", "horovod_env"]

MPIRUN = "mpirun"
_INT_RE = re.compile(r"\s*[+-]?\d+\s*")


class Launcher(NamedTuple):
    """The environment variables one launcher family sets."""

    name: str
    rank: str
    size: str
    local_rank: str
    local_size: str


LAUNCHERS = (
    Launcher(
        "Open MPI",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    Launcher("MPICH/Hydra", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    Launcher("Horovod", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
)
HOROVOD = LAUNCHERS[-1]
HOROVOD_CROSS_RANK = "HOROVOD_CROSS_RANK"
HOROVOD_CROSS_SIZE = "HOROVOD_CROSS_SIZE"
HOROVOD_VARIABLES = (HOROVOD.rank, HOROVOD.size, HOROVOD.local_rank, HOROVOD.local_size,
                     HOROVOD_CROSS_RANK, HOROVOD_CROSS_SIZE)


def detect_launcher(env: Mapping[str, str]) -> Launcher | None:
    """The first launcher whose rank or size variable is set in ``env``, or None."""
    for launcher in LAUNCHERS:
        if launcher.rank in env or launcher.size in env:
            return launcher
    return None


def _read_int(env: Mapping[str, str], name: str, launcher: Launcher) -> int:
    if name not in env:
        raise ClusterError(
            f"`{name}` must be set when the {launcher.name} launcher variables are. "
            f"Received: {name} unset"
        )
    raw = env[name]
    if not _INT_RE.fullmatch(raw):
        raise ClusterError(f"`{name}` must be an integer. Received: {name}={raw!r}")
    return int(raw)


def _check_range(name: str, value: int, upper: int, upper_name: str) -> None:
    if not 0 <= value < upper:
        raise ClusterError(
            f"`{name}` must be in [0, {upper_name}={upper}). Received: {name}={value}"
        )


def spec_from_mpi_env(env: Mapping[str, str]) -> ClusterSpec | None:
    """The spec described by a launcher's variables in ``env``, or None if there are none.

    Also None when the only variables are Horovod's and ``env`` has a ``TF_CONFIG`` that
    they agree with (a worker of ``hostreduce run``): ``TF_CONFIG`` describes that job.

    Raises:
        ClusterError: the variables are invalid, or Horovod's disagree with ``TF_CONFIG``.
    """
    launcher = detect_launcher(env)
    if launcher is None:
        return None
    rank = _read_int(env, launcher.rank, launcher)
    size = _read_int(env, launcher.size, launcher)
    if size < 1:
        raise ClusterError(f"`{launcher.size}` must be >= 1. Received: {launcher.size}={size}")
    _check_range(launcher.rank, rank, size, launcher.size)

    local_rank, local_size = 0, 1
    if launcher.local_rank in env or launcher.local_size in env:
        local_rank = _read_int(env, launcher.local_rank, launcher)
        local_size = _read_int(env, launcher.local_size, launcher)
        if not 1 <= local_size <= size:
            raise ClusterError(
                f"`{launcher.local_size}` must be in [1, {launcher.size}={size}]. "
                f"Received: {launcher.local_size}={local_size}"
            )
        _check_range(launcher.local_rank, local_rank, local_size, launcher.local_size)
    if launcher is HOROVOD and env.get(TF_CONFIG, "").strip():
        _check_agrees_with_tf_config(env[TF_CONFIG], rank, size)
        return None
    return ClusterSpec(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        addresses=(),
        task_type="worker",
        task_index=rank,
        source=MPIRUN,
    )


def _check_agrees_with_tf_config(raw: str, rank: int, size: int) -> None:
    spec = parse_tf_config(raw, roles=True)
    if (spec.rank, spec.size) != (rank, size):
        raise ClusterError(
            f"`{HOROVOD.rank}` and `{HOROVOD.size}` must agree with `{TF_CONFIG}` when both are set "
            f"(unset one of them). Received: {HOROVOD.rank}={rank}, {HOROVOD.size}={size}, "
            f"{TF_CONFIG} for rank {spec.rank} of {spec.size}"
        )


def horovod_env(spec: ClusterSpec) -> dict[str, str]:
    """The variables ``horovodrun`` would set for the rank ``spec`` describes: its rank,
    size, local rank and size, and its host's index among the job's hosts (cross rank)
    and their number (cross size)."""
    hosts = list(dict.fromkeys(spec.hosts)) or [""]
    here = spec.hosts[spec.rank] if spec.addresses else ""
    return {
        HOROVOD.rank: str(spec.rank),
        HOROVOD.size: str(spec.size),
        HOROVOD.local_rank: str(spec.local_rank),
        HOROVOD.local_size: str(spec.local_size),
        HOROVOD_CROSS_RANK: str(hosts.index(here)),
        HOROVOD_CROSS_SIZE: str(len(hosts)),
    }
