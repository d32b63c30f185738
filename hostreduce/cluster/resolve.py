"""Decide where this process sits in the job, from the most explicit source available.

Precedence: explicit arguments > ``TF_CONFIG`` > mpirun/Horovod environment > a single
process. The environment is only read, never written.
"""
from __future__ import annotations

import operator
import os
from typing import Any, Mapping, Sequence

from ..errors import ClusterError
from .mpi_env import HOROVOD, detect_launcher, spec_from_mpi_env
from .spec import ClusterSpec
from .tf_config import TF_CONFIG, check_addresses, cluster_from_resolver, local_placement, parse_tf_config

__all__ = ["resolve_cluster", "cluster_from_resolver"]

ARGUMENTS = "arguments"
SINGLE = "single"


def _as_int(name: str, value: Any) -> int:
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ClusterError(f"`{name}` must be an integer. Received: {name}={value!r}")


def _from_arguments(rank: Any, size: Any, addresses: Sequence[str] | None) -> ClusterSpec:
    """The spec described by explicit ``rank``/``size``/``addresses`` arguments."""
    ring: tuple[str, ...] = ()
    if addresses is not None:
        ring = check_addresses(addresses)
        if not ring and size is None:
            raise ClusterError("`addresses` must not be empty. Received: addresses=[]")
    if size is not None:
        size = _as_int("size", size)
        if size < 1:
            raise ClusterError(f"`size` must be >= 1. Received: size={size}")
        if ring and len(ring) != size:
            raise ClusterError(
                f"`size` must equal the number of `addresses` ({len(ring)}). Received: size={size}"
            )
    elif ring:
        size = len(ring)
    if rank is None:
        if size not in (None, 1):
            raise ClusterError(
                f"`rank` must be given when the job has more than one rank. "
                f"Received: rank=None, size={size}"
            )
        rank = 0
    rank = _as_int("rank", rank)
    if size is None:
        if rank != 0:
            raise ClusterError(
                f"`size` or `addresses` must be given along with `rank`. Received: rank={rank}"
            )
        size = 1
    if not 0 <= rank < size:
        raise ClusterError(f"`rank` must be in [0, {size}). Received: rank={rank}")
    local_rank, local_size = local_placement(ring, rank) if ring else (0, 1)
    return ClusterSpec(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        addresses=ring,
        task_type="worker",
        task_index=rank,
        source=ARGUMENTS,
    )


def resolve_cluster(
    rank: int | None = None,
    size: int | None = None,
    addresses: Sequence[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    roles: bool = False,
) -> ClusterSpec:
    """Resolve this process's :class:`ClusterSpec`.

    Args:
        rank: this process's rank. Required with ``size`` or ``addresses`` unless the job
            has a single rank.
        size: number of ranks; inferred from ``addresses`` when omitted.
        addresses: ``host:port`` of every rank, indexed by rank. Ranks that share a host
            get consecutive local ranks in rank order.
        env: environment to read ``TF_CONFIG`` and launcher variables from; defaults to
            ``os.environ``.
        roles: accept ``ps`` and ``evaluator`` tasks in ``TF_CONFIG`` (parameter-server
            mode); otherwise such a task is an error, since it cannot join the ring.

    When any of ``rank``, ``size`` or ``addresses`` is given, only the arguments are
    used. Otherwise a non-empty ``TF_CONFIG`` is used, then the variables of an Open MPI,
    MPICH/Hydra or Horovod launcher, and finally a single-process spec (rank 0 of 1).
    Horovod's variables beside ``TF_CONFIG`` (``hostreduce run`` sets both) must agree with it.

    Raises:
        ClusterError: the arguments, ``TF_CONFIG`` or launcher variables are invalid, or
            Horovod's variables disagree with ``TF_CONFIG``.
    """
    if rank is not None or size is not None or addresses is not None:
        return _from_arguments(rank, size, addresses)
    env = os.environ if env is None else env
    raw = env.get(TF_CONFIG)
    if raw is not None and raw.strip():
        spec = parse_tf_config(raw, roles=roles)
        if detect_launcher(env) is HOROVOD:
            spec_from_mpi_env(env)  # raises unless they agree with TF_CONFIG
        return spec
    spec = spec_from_mpi_env(env)
    if spec is not None:
        return spec
    return ClusterSpec(source=SINGLE)
