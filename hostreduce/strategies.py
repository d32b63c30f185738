"""Distribution strategies: which reducer all-reduces the gradients, where variables
live, and how this worker's input is sharded.

A strategy owns its reducer: it is created on first use (so building a strategy does
not start servers) and released by :meth:`Strategy.close`.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

from .errors import ConfigError

__all__ = ["Strategy", "SingleProcessStrategy", "MultiWorkerStrategy", "HorovodStrategy", "InputContext"]

logger = logging.getLogger("hostreduce.strategies")


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What ``input_fn`` needs to shard its data: ``dataset.shard(num_input_pipelines,
    input_pipeline_id)``. The names follow ``tf.distribute.InputContext``."""

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        if global_batch_size % self.num_replicas_in_sync:
            raise ConfigError(
                f"`global_batch_size` must be divisible by the number of workers ({self.num_replicas_in_sync}). "
                f"Received: global_batch_size={global_batch_size}"
            )
        return global_batch_size // self.num_replicas_in_sync


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"`{name}` must be a bool. Received: {name}={value!r}")
    return value


class Strategy:
    """Base class: a cluster position, a lazily created reducer, a variable placement.

    Subclasses set :attr:`reducer_name` and may override :meth:`_resolve_cluster` and
    :meth:`_create_reducer`.
    """

    reducer_name: str = "local"
    #: True when every rank must submit collectives in the same order (MPI, Horovod
    #: core ops); False when the engine negotiates (the ring).
    ordered_submission: bool = False

    def __init__(self, variables_on_host: bool = True, config: Any = None) -> None:
        self.variables_on_host = _check_bool("variables_on_host", variables_on_host)
        self._config = config
        self._cluster: Any = None
        self._reducer: Any = None
        self._lock = threading.Lock()

    # -- cluster ---------------------------------------------------------------
    def _resolve_cluster(self) -> Any:
        from .cluster import ClusterSpec

        return ClusterSpec()

    @property
    def cluster(self) -> Any:
        if self._cluster is None:
            self._cluster = self._resolve_cluster()
        return self._cluster

    @property
    def rank(self) -> int:
        if self._reducer is not None:
            return self._reducer.rank
        return self.cluster.rank

    @property
    def size(self) -> int:
        if self._reducer is not None:
            return self._reducer.size
        return self.cluster.size

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    def input_context(self) -> InputContext:
        return InputContext(num_input_pipelines=self.size, input_pipeline_id=self.rank,
                            num_replicas_in_sync=self.size)

    # -- reducer ---------------------------------------------------------------
    def _create_reducer(self) -> Any:
        from .reducers import create_reducer

        return create_reducer(self.reducer_name, cluster=self.cluster, config=self._config)

    @property
    def reducer(self) -> Any:
        """The reducer, created on first access."""
        reducer = self._reducer
        if reducer is not None and not reducer.closed:
            return reducer
        with self._lock:
            if self._reducer is None or self._reducer.closed:
                self._reducer = self._create_reducer()
                logger.info("%s: rank %d of %d, reducer %r", type(self).__name__, self._reducer.rank,
                            self._reducer.size, self._reducer.name)
            return self._reducer

    def close(self) -> None:
        """Release the reducer (sockets, threads). Safe to call more than once."""
        if self._reducer is not None:
            self._reducer.close()
            self._reducer = None

    def __enter__(self) -> "Strategy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(variables_on_host={self.variables_on_host})"


class SingleProcessStrategy(Strategy):
    """One process, no collectives: what an Estimator uses without ``train_distribute``."""

    reducer_name = "local"

    def _create_reducer(self) -> Any:
        from .reducers.local import LocalReducer

        return LocalReducer()


class MultiWorkerStrategy(Strategy):
    """Data-parallel training over the gRPC ring, with the cluster from ``TF_CONFIG``.

    Args:
        cluster_resolver: optional ``tf.distribute.cluster_resolver.TFConfigClusterResolver``
            (or any resolver with ``cluster_spec()``, ``task_type``, ``task_id``); by
            default ``TF_CONFIG`` is read.
        variables_on_host: keep trainable variables and optimizer state on ``/CPU:0``;
            the device only reads weights. With False they stay on the default device
            and only the reduction runs on the host.
        config: a ``hostreduce.config.Config`` for the ring (default: from
            ``HOSTREDUCE_*`` variables).
    """

    reducer_name = "ring"
    ordered_submission = False

    def __init__(self, cluster_resolver: Any = None, variables_on_host: bool = True, config: Any = None) -> None:
        super().__init__(variables_on_host=variables_on_host, config=config)
        self.cluster_resolver = cluster_resolver

    def _resolve_cluster(self) -> Any:
        from .cluster import cluster_from_resolver, resolve_cluster

        if self.cluster_resolver is not None:
            return cluster_from_resolver(self.cluster_resolver)
        return resolve_cluster()


class HorovodStrategy(Strategy):
    """Data-parallel training under ``mpirun``/``horovodrun``: Horovod's all-reduce where
    Horovod loads, otherwise MPI through mpi4py.

    Args:
        variables_on_host: as for :class:`MultiWorkerStrategy`.
        config: a ``hostreduce.config.Config``.
        reducer: force ``"horovod"`` or ``"mpi"`` (default: ``HOSTREDUCE_REDUCER`` when
            set); otherwise Horovod is tried first and MPI is used when Horovod cannot
            be loaded (every rank decides alike, since every rank has the same
            installation).
    """

    ordered_submission = True

    def __init__(self, variables_on_host: bool = True, config: Any = None, reducer: str | None = None) -> None:
        super().__init__(variables_on_host=variables_on_host, config=config)
        if reducer not in (None, "horovod", "mpi"):
            raise ConfigError(f"`reducer` must be 'horovod', 'mpi' or None. Received: reducer={reducer!r}")
        if reducer is None:
            reducer = _reducer_from_env()
        self._forced = reducer
        self.reducer_name = reducer or ("horovod" if _horovod_importable() else "mpi")

    def _create_reducer(self) -> Any:
        from .reducers import create_reducer

        if self.reducer_name == "horovod" and self._forced is None:
            try:
                return create_reducer("horovod", cluster=self.cluster, config=self._config)
            except ImportError as exc:
                logger.warning("Horovod cannot be loaded (%s); using the 'mpi' reducer", str(exc).splitlines()[0])
                self.reducer_name = "mpi"
        return create_reducer(self.reducer_name, cluster=self.cluster, config=self._config)

    def _resolve_cluster(self) -> Any:
        import os

        from .cluster import resolve_cluster

        # Under mpirun the launcher's variables describe the job, even if a TF_CONFIG
        # was left in the environment.
        return resolve_cluster(env={k: v for k, v in os.environ.items() if k != "TF_CONFIG"})


def _reducer_from_env() -> str | None:
    """``HOSTREDUCE_REDUCER`` when it names an engine that runs under mpirun."""
    import os

    value = os.environ.get("HOSTREDUCE_REDUCER", "").strip().lower()
    if not value:
        return None
    if value not in ("horovod", "mpi"):
        raise ConfigError(
            "HorovodStrategy runs under mpirun with the 'horovod' or 'mpi' reducer. "
            f"Received: HOSTREDUCE_REDUCER={value!r}"
        )
    return value


def _horovod_importable() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("horovod.tensorflow") is not None
    except (ImportError, ValueError):
        return False
