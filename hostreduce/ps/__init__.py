"""Parameter-server mode, engine level: placement of variables over ps
tasks, host optimizers, the ps server, the worker's client and coordinated checkpoints.
numpy and grpc only; TensorFlow is never imported here."""
from __future__ import annotations

from .optimizers import SGD, Adagrad, Adam, HostOptimizer, RMSprop, from_config, from_keras
from .placement import DEFAULT_SHARD_BYTES, Placement, VarPlacement, VarSpec, locate, place
from .rows import sum_duplicates
from .serve import JobFailedError, serve_from_env, server_from_env

__all__ = ["SGD", "Adagrad", "Adam", "RMSprop", "HostOptimizer", "from_config", "from_keras", "DEFAULT_SHARD_BYTES",
           "Placement", "VarPlacement", "VarSpec", "locate", "place", "sum_duplicates",
           "JobFailedError", "serve_from_env", "server_from_env"]
