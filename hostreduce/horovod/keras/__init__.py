"""Horovod's Keras API on hostreduce's engines: ``import hostreduce.horovod.keras as hvd``,
as ``horovod.tensorflow.keras``.

``DistributedOptimizer`` wraps a Keras 3 (or tf_keras) optimizer so that
``model.compile(optimizer=hvd.DistributedOptimizer(opt))`` and ``model.fit`` reduce the
gradients over the job, each one as soon as the backward pass has produced it;
:mod:`.callbacks` has Horovod's broadcast, metric-average and learning-rate callbacks;
``load_model`` reads a saved model back with its optimizer wrapped and its state kept.
The process API (``init``, ``rank``, ``size``, ...) is that of :mod:`hostreduce.horovod`.
"""
from __future__ import annotations

from typing import Any

from ...errors import ConfigError
from ...ops import job as _engine
from ...ops.compression import Compression
from ...ops.job import (cross_rank, cross_size, is_initialized, local_rank, local_size, rank, shutdown,
                       size)
from ...ops.arguments import Average, Max, Min, Sum, check_compression, check_gradient_args
from ...ops.process_sets import ProcessSet, global_process_set
from ...ops.functions import broadcast_global_variables
from ...ops.optimizer import HOST, WrapperConfig, wrap_loaded_optimizer, wrap_optimizer
from ...ops.tensors import allgather as _allgather, allreduce as _allreduce, broadcast as _broadcast
from ...ops.collectives import reducescatter as _reducescatter
from ...ops.process_sets import add_process_set, init, remove_process_set
from . import callbacks, elastic

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "DistributedOptimizer", "PartialDistributedOptimizer", "load_model", "broadcast_global_variables", "callbacks",
    "elastic", "Compression", "Average", "Sum", "Min", "Max", "allreduce", "allgather", "broadcast", "reducescatter",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
]


def DistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "", device_sparse: str = "",
                         compression: Any = Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: Any = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
                         process_set: Any = global_process_set, scale_local_gradients: bool = True,
                         variables_on_host: bool = False) -> Any:
    """An optimizer like ``optimizer`` whose updates use the gradients reduced over the job.

    Args:
        optimizer: a Keras 3 or tf_keras optimizer that has not been used yet; the
            returned optimizer is a new one of the same class and configuration.
        name: the new optimizer's name (default: ``optimizer``'s).
        device_dense, device_sparse: accepted; reductions always run in host memory.
        compression: ``Compression.none``, ``Compression.fp16`` or ``Compression.bf16`` (dense gradients).
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients (an ``Embedding``'s) as
            dense tensors; otherwise their values and indices are all-gathered.
        gradient_predivide_factor: with ``Average``, scale by ``1 / factor`` before the
            sum and ``factor / size()`` after it.
        op: ``Average`` (default), ``Sum``, ``Min`` or ``Max``.
        backward_passes_per_step: sum the gradients of this many backward passes
            locally and reduce (and apply) once per that many passes; on the others
            the update only counts ``iterations``, as in Horovod. The sums are dense.
        average_aggregated_gradients: divide the summed gradients by
            ``backward_passes_per_step`` (with ``backward_passes_per_step`` > 1).
        num_groups, groups: accepted; every gradient is handed off on its own as soon as
            it is produced, so explicit grouping changes nothing.
        process_set: reduce over these ranks only (a registered ``hvd.ProcessSet``);
            ranks outside it apply their own gradients, as in Horovod.
        scale_local_gradients: divide the gradients of variables registered with
            ``register_local_var`` (see :func:`PartialDistributedOptimizer`) by the
            number of ranks.
        variables_on_host: keep every optimizer variable (slots, iterations, learning
            rate) on ``/CPU:0`` and apply the update there with TensorFlow's fused CPU
            kernels; the model must be built in host memory (``tf.device('/CPU:0')``).
            Not a Horovod argument; default False, as Horovod behaves.

    Returns:
        The wrapped optimizer, for ``model.compile(optimizer=...)`` or a custom loop's
        ``apply_gradients``. In ``compile``, leave ``jit_compile`` off.
    """
    from ...ops.aggregation import check_passes

    rop = check_gradient_args(op, compression, gradient_predivide_factor, groups, process_set)
    passes = check_passes(backward_passes_per_step)
    config = WrapperConfig(rop, compression, bool(sparse_as_dense), float(gradient_predivide_factor),
                           bool(variables_on_host), passes, bool(average_aggregated_gradients),
                           process_set, bool(scale_local_gradients))
    return wrap_optimizer(optimizer, config, name)


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "",
                                device_sparse: str = "", compression: Any = Compression.none,
                                sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                                op: Any = Average, backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False, groups: Any = None,
                                process_set: Any = global_process_set, local_layers: Any = None,
                                scale_local_gradients: bool = True) -> Any:
    """:func:`DistributedOptimizer` whose update leaves the gradients of ``local_layers``'
    trainable variables local to each worker (not reduced; divided by the number of
    ranks when ``scale_local_gradients``), as Horovod's ``horovod.keras``.

    Args:
        local_layers: a Keras layer or a list of them (None: no local layer).
        The other arguments are :func:`DistributedOptimizer`'s.
    """
    from ...ops.aggregation import layers_list

    layers = layers_list(local_layers)
    wrapped = DistributedOptimizer(optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
                                   compression=compression, sparse_as_dense=sparse_as_dense,
                                   gradient_predivide_factor=gradient_predivide_factor, op=op,
                                   backward_passes_per_step=backward_passes_per_step,
                                   average_aggregated_gradients=average_aggregated_gradients, groups=groups,
                                   process_set=process_set, scale_local_gradients=scale_local_gradients)
    for layer in layers:
        for variable in layer.trainable_weights:
            wrapped.register_local_var(variable)
    return wrapped


def allreduce(value: Any, name: str | None = None, average: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op: Any = None, compression: Any = Compression.none) -> Any:
    """All-reduce a tensor-like ``value`` (a number, a list, a NumPy array, a tensor) over
    the job: :func:`hostreduce.horovod.allreduce` on ``tf.constant(value)``. ``name``
    names the constant, as in Horovod."""
    return _allreduce(_constant(value, name), average=average, prescale_factor=prescale_factor,
                      postscale_factor=postscale_factor, op=op, compression=compression)


def allgather(value: Any, name: str | None = None) -> Any:
    """All-gather a tensor-like ``value`` along its first dimension."""
    return _allgather(_constant(value, name))


def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
    """``root_rank``'s tensor-like ``value`` on every rank."""
    return _broadcast(_constant(value, name), root_rank)


def reducescatter(value: Any, name: str | None = None, op: Any = Average) -> Any:
    """Reduce a tensor-like ``value`` over the job and scatter the result along its first dimension."""
    return _reducescatter(_constant(value, name), op=op)


def _constant(value: Any, name: str | None) -> Any:
    import tensorflow as tf

    if isinstance(value, (tf.Tensor, tf.Variable)):
        return value
    return tf.constant(value, name=name)


def load_model(filepath: Any, custom_optimizers: Any = None, custom_objects: Any = None,
               compression: Any = Compression.none, legacy_opts: bool = False,
               variables_on_host: bool = False) -> Any:
    """Load a model saved by Keras (``model.save``, ``ModelCheckpoint``) with its
    optimizer wrapped in :func:`DistributedOptimizer`, its state carried over, so that
    training resumes from the saved iteration count and slots.

    The file is read by ``tf.keras.models.load_model`` (Keras 3, or tf_keras with
    ``TF_USE_LEGACY_KERAS=1``). A model saved with a wrapped optimizer holds the plain
    optimizer class, so ``keras.models.load_model`` alone gives the plain optimizer with
    its state (outside a job, or to evaluate).

    Args:
        filepath: the saved model (a ``.keras`` file, or what that Keras's
            ``load_model`` reads).
        custom_optimizers: optimizer classes of your own the file names, as in Horovod.
        custom_objects: other custom classes or functions by name, passed to Keras.
        compression: the wrapped optimizer's ``compression`` (``Compression.none`` or
            ``Compression.fp16``).
        legacy_opts: accepted (the optimizer class is the one the file names, legacy
            tf_keras optimizers included).
        variables_on_host: load the model's variables into host memory (``/CPU:0``) and
            wrap with ``variables_on_host=True``: every optimizer variable, iterations
            and slots included, is then on ``/CPU:0`` too. Not a Horovod argument.

    Returns:
        The model; its optimizer is wrapped when the file holds one (a model saved
        without ``compile`` is returned as Keras loads it).
    """
    import contextlib

    import tensorflow as tf

    _engine.job()  # fail before reading the file when init() was not called
    check_compression(compression)
    if custom_optimizers is not None and (isinstance(custom_optimizers, (str, type))
                                          or not all(isinstance(c, type) for c in custom_optimizers)):
        raise ConfigError("`custom_optimizers` must be a list of optimizer classes. "
                          f"Received: custom_optimizers={custom_optimizers!r}")
    if custom_objects is not None and not isinstance(custom_objects, dict):
        raise ConfigError("`custom_objects` must be a dict of names to objects. "
                          f"Received: custom_objects={custom_objects!r}")
    objects = {cls.__name__: cls for cls in custom_optimizers or ()}
    objects.update(custom_objects or {})
    with tf.device(HOST) if variables_on_host else contextlib.nullcontext():
        model = tf.keras.models.load_model(filepath, custom_objects=objects or None)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return model
    config = WrapperConfig(Average, compression, variables_on_host=bool(variables_on_host))
    try:
        wrapped = wrap_loaded_optimizer(optimizer, config, model.trainable_variables, argument="model.optimizer")
    except ConfigError as exc:
        raise ConfigError(f"Could not wrap the optimizer of the model loaded from `filepath`: {exc} "
                          f"Received: filepath={filepath!r}") from exc
    model.optimizer = wrapped
    # What compile() was given, and what a later model.save() records as the optimizer.
    compile_config = getattr(getattr(model, "_compile_config", None), "config", None)
    if isinstance(compile_config, dict) and "optimizer" in compile_config:
        compile_config["optimizer"] = wrapped
    return model


# The process API's other names of horovod.tensorflow (build queries, timeline, ...):
# those hostreduce.horovod has, looked up there when first used.
_FORWARDED = ("start_timeline", "stop_timeline", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
              "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built")


def __getattr__(name: str) -> Any:
    if name in _FORWARDED:
        from ... import horovod

        return getattr(horovod, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
