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
from .ps_training.coordinator import ParameterServerSurface
from .tf_strategy.surface import DistributeSurface

__all__ = ["Strategy", "SingleProcessStrategy", "MultiWorkerStrategy", "HorovodStrategy", "ParameterServerStrategy",
           "InputContext"]

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

    @property
    def config(self) -> Any:
        """The engine's ``hostreduce.config.Config`` as given (None: from ``HOSTREDUCE_*``)."""
        return self._config

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


class SingleProcessStrategy(DistributeSurface, Strategy):
    """One process, no collectives: what an Estimator uses without ``train_distribute``."""

    reducer_name = "local"

    def _create_reducer(self) -> Any:
        from .reducers.local import LocalReducer

        return LocalReducer()


class MultiWorkerStrategy(DistributeSurface, Strategy):
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
        communication_options: ``MultiWorkerMirroredStrategy``'s argument, accepted so
            that its scripts run unchanged; the ring's settings come from ``config``.
        fused_apply: in ``scope()``, Keras 3 SGD and Adam update with fused CPU kernels
            (the default, as hostreduce's other faces); False: Keras's own update ops.

    The ``tf.distribute.Strategy`` methods (``scope``, ``run``, ``reduce``, distributed
    datasets) make it a drop-in for ``tf.distribute.MultiWorkerMirroredStrategy()``
    (``docs/guides/tf_distribute.md``).
    """

    reducer_name = "ring"
    ordered_submission = False

    def __init__(self, cluster_resolver: Any = None, variables_on_host: bool = True, config: Any = None,
                 communication_options: Any = None, fused_apply: bool = True) -> None:
        super().__init__(variables_on_host=variables_on_host, config=config)
        self.cluster_resolver = cluster_resolver
        self.fused_apply = _check_bool("fused_apply", fused_apply)
        if communication_options is not None:  # tf.distribute.MultiWorkerMirroredStrategy's argument
            logger.info("MultiWorkerStrategy: communication_options=%r is not used: the ring reduces in host "
                        "memory, its fusion and timeout from hostreduce's Config", communication_options)

    def _resolve_cluster(self) -> Any:
        from .cluster import cluster_from_resolver, resolve_cluster

        if self._cluster_resolver is not None:
            return cluster_from_resolver(self._cluster_resolver)
        return resolve_cluster()


class HorovodStrategy(DistributeSurface, Strategy):
    """Data-parallel training under ``mpirun``/``horovodrun``: Horovod's all-reduce where
    Horovod loads, otherwise MPI through mpi4py.

    Args:
        variables_on_host: as for :class:`MultiWorkerStrategy`.
        config: a ``hostreduce.config.Config``.
        reducer: force ``"horovod"`` or ``"mpi"`` (default: ``HOSTREDUCE_REDUCER`` when
            set); otherwise Horovod is tried first and MPI is used when Horovod cannot
            be loaded (every rank decides alike, since every rank has the same
            installation).
        fused_apply: as for :class:`MultiWorkerStrategy`.
    """

    ordered_submission = True

    def __init__(self, variables_on_host: bool = True, config: Any = None, reducer: str | None = None,
                 fused_apply: bool = True) -> None:
        super().__init__(variables_on_host=variables_on_host, config=config)
        self.fused_apply = _check_bool("fused_apply", fused_apply)
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


class ParameterServerStrategy(ParameterServerSurface, Strategy):
    """Data-parallel training with the variables on parameter servers: the ``ps`` tasks
    of ``TF_CONFIG``, which run the same script.

    Each step every worker pulls the variables it reads (an embedding table's rows of
    its batch only), computes the gradients on its device and pushes them (an
    embedding's as rows); the ps apply them with host kernels, optimizer slots beside
    their variable. On a ``ps`` task the Estimator's ``train``/``train_and_evaluate``
    serve until the chief ends the job, then end the process with status 0; on the
    ``evaluator`` task ``train_and_evaluate`` evaluates each new checkpoint.

    Args:
        sync: True: each step the ps average the workers' gradients and apply once (the
            result of all-reduce training on the global batch); a worker lost or late
            by ``timeout_s`` fails the step on every worker with an error naming its
            rank. False: each worker's gradients are applied as they arrive, and each
            worker trains on its own: one that fails or is lost is logged, the others
            go on.
        shard_bytes: variables of at least this many bytes are split by rows over every
            ps; smaller ones are placed whole, balanced by bytes. A worker never holds a
            split table whole: it caches the rows of its batch (it must be read only
            through row lookups, e.g. an ``Embedding`` layer).
        timeout_s: the longest wait for a ps, or (sync) for another worker's gradients
            of a step (default ``HOSTREDUCE_TIMEOUT_S``).
        sparse: how momentum and Adam update an embedding's rows: ``"keras"`` (exactly
            as the Keras optimizer does: Keras 3's as on the dense gradient; tf_keras's
            legacy SGD and RMSprop with momentum only the rows in the batch) or
            ``"lazy"`` (only the rows in the batch).
        nonfinite: what a ps does with a pushed gradient holding NaN or Inf:
            ``"apply"`` (what TensorFlow's optimizers do) or ``"refuse"`` (the push
            fails with ``NonFiniteGradientError``, in sync mode its step for every
            worker, and nothing of it is applied). Read on the ``ps`` tasks.
        cluster_resolver: as for :class:`MultiWorkerStrategy`.
        config: a ``hostreduce.config.Config`` (secret, timeouts; the workers' ring).

    With ``sync=True`` the training tasks also form the gRPC ring for the Estimator's
    small collectives (the start step, when the data ends, logging); with ``sync=False``
    training involves no other worker (``hostreduce/estimator/team.py``). ``evaluate()``
    on the training tasks combines their metrics over the ring in both modes. Gradients
    and variables travel only between workers and ps. The chief ends the job (its ps
    exit) once every other worker's process has ended or is lost.
    """

    reducer_name = "ring"
    parameter_servers = True

    def __init__(self, sync: bool = True, shard_bytes: int | None = None, timeout_s: float | None = None,
                 sparse: str = "keras", cluster_resolver: Any = None, config: Any = None,
                 nonfinite: str = "apply") -> None:
        from .ps.placement import DEFAULT_SHARD_BYTES

        super().__init__(variables_on_host=True, config=config)
        self.sync = _check_bool("sync", sync)
        shard_bytes = DEFAULT_SHARD_BYTES if shard_bytes is None else shard_bytes
        if not isinstance(shard_bytes, int) or isinstance(shard_bytes, bool) or shard_bytes < 1:
            raise ConfigError(f"`shard_bytes` must be an integer >= 1. Received: shard_bytes={shard_bytes!r}")
        if timeout_s is not None and (not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool)
                                      or not timeout_s > 0):
            raise ConfigError(f"`timeout_s` must be a number > 0 or None. Received: timeout_s={timeout_s!r}")
        if sparse not in ("keras", "lazy"):
            raise ConfigError(f"`sparse` must be 'keras' or 'lazy'. Received: sparse={sparse!r}")
        if nonfinite not in ("apply", "refuse"):
            raise ConfigError(f"`nonfinite` must be 'apply' or 'refuse'. Received: nonfinite={nonfinite!r}")
        self.shard_bytes, self.sparse, self._timeout_s = shard_bytes, sparse, timeout_s
        self.nonfinite = nonfinite
        self.cluster_resolver = cluster_resolver
        self._job: Any = None

    def _resolve_cluster(self) -> Any:
        from .cluster import cluster_from_resolver, resolve_cluster
        from .errors import ClusterError

        spec = (cluster_from_resolver(self.cluster_resolver, roles=True) if self.cluster_resolver is not None
                else resolve_cluster(roles=True))
        if not spec.ps_addresses:
            raise ClusterError("ParameterServerStrategy needs `ps` tasks in the cluster (TF_CONFIG's "
                               f"cluster.ps). Received: a cluster without ps (source {spec.source!r}, "
                               f"task {spec.task_type!r} {spec.task_index})")
        return spec

    def _engine_config(self) -> Any:
        from .config import Config

        return self._config if self._config is not None else Config.from_env()

    @property
    def role(self) -> str:
        """``"worker"`` (the chief too), ``"ps"`` or ``"evaluator"``."""
        return self.cluster.role

    @property
    def is_chief(self) -> bool:
        return self.cluster.is_chief

    @property
    def timeout_s(self) -> float:
        return float(self._timeout_s or self._engine_config().timeout_s)

    @property
    def job(self) -> Any:
        """This training task's :class:`hostreduce.ps.job.PSJob`, connected on first use."""
        if self._job is None:
            from .errors import ClusterError, ConfigError as _ConfigError
            from .ps.job import PSJob

            if self.role != "worker":
                raise ClusterError(f"only training tasks talk to the ps as workers. Received: task.type="
                                   f"{self.cluster.task_type!r}")
            cfg = self._engine_config()
            if not cfg.secret:
                raise _ConfigError("ParameterServerStrategy needs the job's shared secret: set HOSTREDUCE_SECRET "
                                   "to the same value in every task. Received: secret=None")
            spec = self.cluster
            from .transport.grpc_options import read_pem

            self._job = PSJob(spec.ps_addresses, spec.rank, spec.size, cfg.secret, timeout_s=self.timeout_s,
                              connect_timeout_s=cfg.connect_timeout_s,
                              tls_ca=read_pem(cfg.ps_tls_ca, "ps_tls_ca") if cfg.ps_tls_ca else None)
        return self._job

    def keras_optimizer(self, optimizer: Any) -> Any:
        """``optimizer`` (Keras 3 or tf_keras SGD, Adam, Adagrad or RMSprop, not used yet)
        for ``model.compile`` or ``apply_gradients``, with the variables and its slots on
        the ps: each step pushes the gradients and pulls the variables back
        (``hostreduce/ps_training/keras.py``).
        On a ``ps`` task this call serves until the chief ends the job, then exits 0."""
        from .ps_training.keras import keras_optimizer

        return keras_optimizer(self, optimizer)

    def scope(self) -> Any:
        """Build the Keras model in this block: each table the ps split by rows (at least
        ``shard_bytes``) is then never whole on a worker, only the rows its steps look up."""
        from .ps_training.keras import variable_scope

        return variable_scope(self)

    def keras_variables(self) -> dict[str, Any]:
        """The Keras model's trainable variables as the ps hold them, by path (tables
        whole: a full copy each)."""
        from .ps_training.keras import pull_variables

        return pull_variables(self)

    def serve(self) -> None:
        """On a ``ps`` task: serve until the chief ends the job (``JobFailedError`` if it failed)."""
        from .ps.serve import serve_from_env

        serve_from_env(mode="sync" if self.sync else "async", reduce="mean", timeout_s=self.timeout_s,
                       cluster=self.cluster, config=self._engine_config(), nonfinite=self.nonfinite)

    def close(self) -> None:
        """Release the ring; the ps connection stays until the process exits (the chief
        ends the job then)."""
        super().close()

    def __repr__(self) -> str:
        return f"ParameterServerStrategy(sync={self.sync}, shard_bytes={self.shard_bytes})"


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
