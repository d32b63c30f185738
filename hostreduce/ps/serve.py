"""A ``ps`` task of a ``TF_CONFIG`` cluster becoming a parameter server: its address and
the number of workers from ``TF_CONFIG``, the job's secret and timeout from the same
``HOSTREDUCE_*`` settings as the ring's (``Config``), then serving until the chief ends
the job.

The chief's strategy sends a heartbeat, so a ps whose chief died without ending the job
stops after ``chief_timeout_s`` with an error instead of serving forever; a ps whose job
never formed (its chief never registered) stops after ``startup_timeout_s``, naming why.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

from ..errors import ClusterError, ConfigError, JobFailedError

__all__ = ["serve_from_env", "server_from_env", "JobFailedError"]

log = logging.getLogger("hostreduce.ps")


def server_from_env(*, mode: str = "sync", reduce: str = "mean", timeout_s: float | None = None,
                    chief_timeout_s: float | None = None, env: Mapping[str, str] | None = None,
                    cluster: Any = None, config: Any = None, nonfinite: str = "apply",
                    startup_timeout_s: float | None = None) -> Any:
    """The :class:`ParameterServer` of this ``ps`` task (not started).

    Args:
        mode: ``"sync"`` or ``"async"``.
        reduce: how a sync step combines the workers' gradients: ``"mean"`` (what a
            ring all-reduce of the same job gives) or ``"sum"``.
        timeout_s: the longest wait for a worker (default ``HOSTREDUCE_TIMEOUT_S``, 30).
        chief_timeout_s: end when the chief is silent this long (default 4 x timeout_s).
        env: where ``TF_CONFIG`` and ``HOSTREDUCE_*`` are read (default ``os.environ``).
        cluster: a ``ClusterSpec`` resolved with roles, instead of ``TF_CONFIG``.
        config: a ``Config`` (secret, timeout), instead of ``HOSTREDUCE_*``.
        startup_timeout_s: end with a failure when the chief has not registered the
            variables within this time (default ``HOSTREDUCE_CONNECT_TIMEOUT_S``, 60).
        nonfinite: a pushed gradient holding NaN or Inf is applied (``"apply"``, as
            TensorFlow's optimizers do) or refused (``"refuse"``).
    """
    from ..cluster import resolve_cluster
    from ..config import Config
    from ..transport.grpc_options import read_pem
    from .server import ParameterServer

    spec = resolve_cluster(env=env, roles=True) if cluster is None else cluster
    if spec.task_type != "ps":
        raise ClusterError("`task.type` must be 'ps' for this process to serve as a parameter server. "
                           f"Received: task.type={spec.task_type!r} (source {spec.source!r})")
    config = Config.from_env(env) if config is None else config
    if not config.secret:
        raise ConfigError("A parameter server needs the job's shared secret to admit only its workers: set "
                          "HOSTREDUCE_SECRET to the same value in every task. Received: secret=None")
    timeout = config.timeout_s if timeout_s is None else float(timeout_s)
    return ParameterServer(spec.task_index, list(spec.ps_addresses), len(spec.worker_addresses), config.secret,
                           mode=mode, timeout_s=timeout, reduce=reduce,
                           chief_timeout_s=4 * timeout if chief_timeout_s is None else chief_timeout_s,
                           tune_malloc=config.tune_malloc, nonfinite=nonfinite,
                           startup_timeout_s=config.connect_timeout_s if startup_timeout_s is None
                           else startup_timeout_s, max_message_bytes=config.ps_max_message_bytes,
                           tls=(read_pem(config.ps_tls_cert, "ps_tls_cert"), read_pem(config.ps_tls_key, "ps_tls_key"))
                           if config.ps_tls_cert else None)


def serve_from_env(**kwargs: Any) -> None:
    """Serve as this ``ps`` task until the chief ends the job (arguments as for
    :func:`server_from_env`). Returns when the job succeeded; raises
    :class:`JobFailedError` when the chief ended it after a failure or was lost."""
    server = server_from_env(**kwargs)
    server.serve()
    if server.failure:
        raise JobFailedError(server.failure)
    log.info("ps task %d: the chief ended the job", server.index)
