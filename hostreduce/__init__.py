"""hostreduce: host-offloaded gradient reduction for TensorFlow data-parallel training.

The public API. Engine names import nothing heavy; the training names (Estimator,
strategies, ...) load TensorFlow on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

from .cluster import ClusterSpec, cluster_from_resolver, resolve_cluster
from .config import Config
from .errors import (AuthenticationError, ClusterError, CollectiveTimeoutError, ConfigError,
                     HostReduceError, PeerLostError, ReducerClosedError, SpecError,
                     TensorMismatchError, UnmatchedCollectiveError)
from .reducers import Handle, ReduceOp, Reducer, available_reducers, create_reducer, register_reducer

from .version import __version__

# Training API: name -> module that defines it (imported lazily, it needs TensorFlow).
_LAZY: dict[str, str] = {
    **{name: ".estimator" for name in (
        "Estimator", "EstimatorSpec", "EvalSpec", "InputContext", "ModeKeys", "RunConfig", "TrainSpec",
        "compute_gradients", "host_train_spec", "train_and_evaluate")},
    **{name: ".strategies" for name in (
        "HorovodStrategy", "MultiWorkerStrategy", "ParameterServerStrategy", "SingleProcessStrategy", "Strategy")},
    "Timeline": ".timeline",
}

__all__ = [
    "AuthenticationError", "ClusterError", "ClusterSpec", "CollectiveTimeoutError", "Config",
    "ConfigError", "Handle", "HostReduceError", "PeerLostError", "ReduceOp", "Reducer",
    "ReducerClosedError", "SpecError", "TensorMismatchError", "UnmatchedCollectiveError", "available_reducers",
    "cluster_from_resolver", "create_reducer", "register_reducer", "resolve_cluster",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hostreduce' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
