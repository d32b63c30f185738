"""Horovod's TensorFlow API on hostreduce's engines: ``import hostreduce.horovod as hvd``.

A script written for ``horovod.tensorflow`` (or Graphcore's ``ipu.horovod``) runs after
changing its import line: ``hvd.init()``, ``hvd.rank()``, ``hvd.size()``, ... to shard
its data and pick its device; ``hvd.allreduce``, ``hvd.allgather``, ``hvd.broadcast``,
``hvd.broadcast_variables``, ``hvd.reducescatter``, ``hvd.alltoall`` and
``hvd.DistributedGradientTape`` eagerly or inside ``tf.function``, on the whole job or on
process sets (``hvd.add_process_set``). The job is found as the strategies find it: under ``mpirun`` from the
launcher's variables (engine: Horovod's core ops where they load, else MPI), otherwise
from ``TF_CONFIG`` (``hostreduce run`` sets it; engine: the ring), otherwise a single
process. Importing this module does not import TensorFlow.
"""
from __future__ import annotations

import importlib
from typing import Any

from ..ops.compression import Compression
from ..ops.job import (NotInitializedError, cross_rank, cross_size, is_initialized, local_rank, local_size,
                      rank, shutdown, size)
from ..ops.collectives import alltoall, grouped_reducescatter, reducescatter
from ..ops.tensors import (Adasum, Average, Max, Min, Product, ReduceOp, Sum, allgather, allreduce, broadcast,
                   broadcast_variables, grouped_allreduce)
from ..ops.process_sets import ProcessSet, add_process_set, global_process_set, init, remove_process_set
from ..ops.functions import (allgather_object, broadcast_, broadcast_global_variables, broadcast_object,
                             broadcast_object_fn, grouped_allgather, join, local_rank_op, local_size_op,
                             process_set_included_op, rank_op, size_op)
from ..ops.build import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, is_homogeneous, mpi_built,
                         mpi_enabled, mpi_threads_supported, nccl_built, rocm_built, start_timeline, stop_timeline)
from . import elastic

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "allreduce", "grouped_allreduce", "allgather", "broadcast", "broadcast_variables", "DistributedGradientTape",
    "Average", "Sum", "Min", "Max", "Adasum", "Product", "ReduceOp", "Compression", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set", "reducescatter", "grouped_reducescatter",
    "alltoall", "NotInitializedError",
    "allgather_object", "broadcast_object", "broadcast_object_fn", "grouped_allgather", "broadcast_",
    "broadcast_global_variables", "BroadcastGlobalVariablesHook", "rank_op", "size_op", "local_rank_op",
    "local_size_op", "process_set_included_op", "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built",
    "gloo_enabled", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "is_homogeneous",
    "start_timeline", "stop_timeline", "elastic", "join",
    # Optimizers, partial tape, synchronized batch normalization (loaded lazily: they need TensorFlow).
    "DistributedOptimizer", "PartialDistributedGradientTape", "SyncBatchNormalization",
]

# Names that need TensorFlow at import: loaded on first use.
_LAZY = {"DistributedGradientTape": "..ops.tape", "BroadcastGlobalVariablesHook": "..ops.hooks",
         "DistributedOptimizer": ".optimizers", "PartialDistributedGradientTape": "..ops.tape",
         "SyncBatchNormalization": "..ops.sync_batch_norm"}


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs eagerly here (a name Horovod's module also carries)."""
    import tensorflow as tf

    return bool(tf.executing_eagerly())


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    raise AttributeError(
        f"hostreduce.horovod does not provide {name!r}. It implements these names of horovod.tensorflow: "
        f"{', '.join(sorted(__all__))}; the README's 'hostreduce.horovod' section lists what is not supported."
    )
