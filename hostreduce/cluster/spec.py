"""The immutable description of one rank's place in the job."""
from __future__ import annotations

import dataclasses

from ..errors import ClusterError

__all__ = ["ClusterSpec"]


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Where this process sits in a data-parallel job.

    Attributes:
        rank: this worker's index in the ring, 0 .. size-1 (the chief is rank 0).
        size: number of workers taking part in collectives.
        local_rank: index among the workers on this host.
        local_size: number of workers on this host.
        addresses: ``host:port`` of every rank, indexed by rank; empty when the job was
            started by mpirun (the MPI runtime connects the ranks itself).
        task_type: ``chief`` or ``worker`` (``TF_CONFIG``); ``worker`` otherwise. With
            roles (parameter-server mode) also ``ps`` or ``evaluator``: such a task is
            alone in its collective group (rank 0 of 1, no addresses).
        task_index: the index within ``task_type``.
        source: where the spec came from: ``arguments``, ``TF_CONFIG``, ``mpirun`` or
            ``single``.
        ps_addresses: ``host:port`` of every ``ps`` task of the cluster (``TF_CONFIG``).
        worker_addresses: ``host:port`` of every training task (the chief, then the
            workers), whatever this task's type.
        has_evaluator: whether the cluster lists an ``evaluator`` task.
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    addresses: tuple[str, ...] = ()
    task_type: str = "worker"
    task_index: int = 0
    source: str = "single"
    ps_addresses: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    worker_addresses: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    has_evaluator: bool = dataclasses.field(default=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("rank", "size", "local_rank", "local_size", "task_index"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ClusterError(f"`{name}` must be an integer. Received: {name}={value!r}")
        if self.size < 1:
            raise ClusterError(f"`size` must be >= 1. Received: size={self.size}")
        if not 0 <= self.rank < self.size:
            raise ClusterError(f"`rank` must be in [0, {self.size}). Received: rank={self.rank}")
        if not 0 <= self.local_rank < self.local_size:
            raise ClusterError(
                f"`local_rank` must be in [0, local_size={self.local_size}). Received: local_rank={self.local_rank}"
            )
        if self.addresses and len(self.addresses) != self.size:
            raise ClusterError(
                f"`addresses` must have one entry per rank ({self.size}). Received: {len(self.addresses)} addresses"
            )

    @property
    def role(self) -> str:
        """``ps``, ``evaluator``, or ``worker`` for every training task (the chief too)."""
        return self.task_type if self.task_type in ("ps", "evaluator") else "worker"

    @property
    def is_chief(self) -> bool:
        return self.rank == 0 and self.role == "worker"

    @property
    def address(self) -> str | None:
        """This rank's own ``host:port``, or None when the spec has no addresses."""
        return self.addresses[self.rank] if self.addresses else None

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(a.rsplit(":", 1)[0] for a in self.addresses)
