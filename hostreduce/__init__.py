"""hostreduce: host-offloaded gradient reduction for TensorFlow data-parallel training.

The public API. Engine names import nothing heavy; the training names (Estimator,
strategies, ...) load TensorFlow on first use. Every public module is an attribute too,
imported on first use: ``import hostreduce as npu`` then ``npu.distribute.all_reduce``,
``npu.hccl.allreduce`` or ``hostreduce.horovod.rank()`` work without importing the
module by name first.
"""
from __future__ import annotations

import importlib
from typing import Any

from .cluster import ClusterSpec, cluster_from_resolver, resolve_cluster
from .config import Config
from .errors import (AuthenticationError, ClusterError, CollectiveTimeoutError, ConfigError,
                     HostReduceError, JoinedRankError, NonFiniteGradientError, PeerLostError, ReducerClosedError,
                     RoleError, SpecError, TensorMismatchError, UnmatchedCollectiveError, UnsupportedCallError)
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

# TF Adapter's top-level names, for scripts whose ``import npu_device as npu`` became
# ``import hostreduce as npu``; left out of __all__ (``open`` would shadow the builtin).
_PORTED: dict[str, str] = {"open": ".tf_adapter.device"}

# Public modules: imported on first access as attributes (``hostreduce.distribute``).
_MODULES: tuple[str, ...] = (
    "cluster", "config", "distribute", "elastic", "errors", "estimator", "hccl", "horovod", "host", "launch", "ops", "processes",
    "progress", "ps", "ps_training", "reducers", "streaming", "strategies", "testing", "tf_adapter", "tf_strategy",
    "timeline", "transport", "version")

__all__ = [
    "AuthenticationError", "ClusterError", "ClusterSpec", "CollectiveTimeoutError", "Config",
    "ConfigError", "Handle", "HostReduceError", "JoinedRankError", "NonFiniteGradientError", "PeerLostError",
    "ReduceOp", "Reducer", "ReducerClosedError", "RoleError", "SpecError", "TensorMismatchError",
    "UnmatchedCollectiveError", "UnsupportedCallError",
    "available_reducers", "cluster_from_resolver", "create_reducer", "register_reducer", "resolve_cluster",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        module = _LAZY.get(name) or _PORTED.get(name)
        if module is None:
            raise AttributeError(f"module 'hostreduce' has no attribute {name!r}")
        value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_MODULES, *_PORTED})
