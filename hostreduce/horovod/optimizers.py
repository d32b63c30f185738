"""``hostreduce.horovod.DistributedOptimizer``: Horovod's dispatch on the optimizer's type.

A TensorFlow 1 optimizer (``tf.compat.v1.train.Optimizer``) is wrapped by
:class:`hostreduce.ops.tf1_optimizer.TF1DistributedOptimizer`; a Keras one (Keras 3 or
tf_keras) by :func:`hostreduce.horovod.keras.DistributedOptimizer`. Importing this
module imports TensorFlow.
"""
from __future__ import annotations

from typing import Any

from ..ops.aggregation import ReduceSpec, check_passes
from ..ops.arguments import Average, check_gradient_args
from ..ops.compression import Compression
from ..ops.process_sets import global_process_set
from ..ops.tf1_optimizer import TF1DistributedOptimizer, is_tf1_optimizer
from . import keras as _keras

__all__ = ["DistributedOptimizer"]


def DistributedOptimizer(optimizer: Any, name: str | None = None, use_locking: bool = False, device_dense: str = "",
                         device_sparse: str = "", compression: Any = Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op: Any = Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
                         process_set: Any = global_process_set, scale_local_gradients: bool = True) -> Any:
    """Wrap ``optimizer`` so that its updates use the gradients reduced over the job.

    Args:
        optimizer: a ``tf.compat.v1.train.Optimizer`` (its ``compute_gradients``
            reduces, ``apply_gradients`` applies; ``minimize`` does both, in a graph run
            by a ``Session`` or eagerly), or a Keras optimizer (then this is
            :func:`hostreduce.horovod.keras.DistributedOptimizer`).
        name: the TensorFlow 1 optimizer's name (default ``"Distributed" + class name``),
            or the Keras optimizer's.
        use_locking: passed to the TensorFlow 1 optimizer's base class.
        device_dense, device_sparse: accepted; reductions always run in host memory.
        compression: ``Compression.none``, ``Compression.fp16`` or ``Compression.bf16``.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors.
        backward_passes_per_step: sum the gradients of this many passes locally and
            reduce and apply once per that many; ``global_step`` (TF1) or
            ``iterations`` (Keras) still counts every pass.
        op: ``Average`` (default), ``Sum``, ``Min`` or ``Max``; ``Adasum`` is refused (ConfigError).
        gradient_predivide_factor: with ``Average``, scale by ``1 / factor`` before the
            sum and ``factor / size`` after it.
        average_aggregated_gradients: divide the summed gradients by
            ``backward_passes_per_step``.
        num_groups, groups: accepted; every gradient is handed off on its own.
        process_set: reduce over these ranks only; the others keep their gradients.
        scale_local_gradients: divide the gradients of variables registered with
            ``register_local_var`` by the number of ranks.
    """
    rop = check_gradient_args(op, compression, gradient_predivide_factor, groups, process_set)
    passes = check_passes(backward_passes_per_step)
    if is_tf1_optimizer(optimizer):
        spec = ReduceSpec(rop, compression, bool(sparse_as_dense), float(gradient_predivide_factor),
                          process_set if process_set is not None else global_process_set,
                          bool(scale_local_gradients))
        return TF1DistributedOptimizer(optimizer, spec, name=name, use_locking=use_locking,
                                       backward_passes_per_step=passes,
                                       average_aggregated_gradients=bool(average_aggregated_gradients))
    return _keras.DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse, compression=compression,
        sparse_as_dense=sparse_as_dense, gradient_predivide_factor=gradient_predivide_factor, op=rop,
        backward_passes_per_step=passes, average_aggregated_gradients=average_aggregated_gradients,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)
