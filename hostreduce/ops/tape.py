"""``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient()`` returns the
gradients reduced over the job.

In a ``tf.function`` step each gradient gets a hand-off op in the step's graph
(:func:`hostreduce.streaming.exchange`), which starts its reduction on the host as soon
as the backward pass has produced it; the reduced values come back through wait ops
that the optimizer's update reads. Reductions of the last layers thus overlap the
backward pass of the first ones.
"""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from ..errors import ConfigError
from . import job as _engine
from .aggregation import ReduceSpec, layers_list, reduce_some
from .compression import Compression
from .arguments import Average, check_gradient_args
from .process_sets import global_process_set

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape"]


class _DistributedGradientTape(tf.GradientTape):
    """Records on the same tape as the wrapped one; ``gradient()`` reduces."""

    def __init__(self, tape: tf.GradientTape, spec: ReduceSpec) -> None:
        super().__init__(persistent=tape._persistent,
                         watch_accessed_variables=getattr(tape, "_watch_accessed_variables", True))
        self._tape = tape._tape  # the recording so far (None if the tape was never entered)
        self._hvd_spec = spec
        self.process_set = spec.process_set
        self.scale_local_gradients = spec.scale_local_gradients

    def register_local_source(self, source: Any) -> None:
        """Leave the gradient of ``source`` local to this worker (not reduced); it is
        divided by the number of ranks when ``scale_local_gradients`` is True, as in Horovod."""
        self._hvd_spec.register_local(source)

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None, use_generic_names: bool = False,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        """The gradients of ``target`` with respect to ``sources``, reduced over the job.

        ``use_generic_names`` is accepted (collective names never depend on TensorFlow
        name scopes here).
        """
        gradients = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat = tf.nest.flatten(gradients)
        return tf.nest.pack_sequence_as(gradients, reduce_some(self._hvd_spec, flat, flat_sources))

    def get_local_and_global_gradients(self, target: Any, sources: Any, output_gradients: Any = None,
                                       use_generic_names: bool = False) -> tuple[list[Any], list[Any]]:
        """``gradient()``'s result split in two lists of (source, gradient) pairs: those of
        the sources registered as local, and the others (reduced)."""
        flat_sources = tf.nest.flatten(sources)
        gradients = tf.nest.flatten(self.gradient(target, sources, output_gradients, use_generic_names))
        local, reduced = [], []
        for s, g in zip(flat_sources, gradients):
            (local if self._hvd_spec.is_local(s) else reduced).append((s, g))
        return local, reduced


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                            compression: Any = Compression.none, sparse_as_dense: bool = False, op: Any = Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                            process_set: Any = global_process_set, scale_local_gradients: bool = True) -> Any:
    """Wrap ``gradtape`` so that ``gradient()`` returns gradients reduced over the job.

    Args:
        gradtape: a ``tf.GradientTape``, before, during or after recording.
        device_dense, device_sparse: accepted; reductions always run in host memory.
        compression: ``Compression.none``, ``Compression.fp16`` or ``Compression.bf16`` (dense gradients).
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors;
            otherwise their values and indices are all-gathered (as Horovod does).
        op: ``Average`` (default), ``Sum``, ``Min`` or ``Max``.
        gradient_predivide_factor: with ``Average``, scale by ``1 / factor`` before
            the sum and ``factor / size()`` after it.
        num_groups, groups: accepted; every gradient is already handed off on its own
            as soon as it is produced, so explicit grouping changes nothing.
        process_set: reduce over these ranks only (a registered ``hvd.ProcessSet``);
            on ranks outside it ``gradient()`` returns the local gradients, as in Horovod.
        scale_local_gradients: divide the gradients of sources registered with
            ``register_local_source`` by the number of ranks.
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise ConfigError(f"`gradtape` must be a tf.GradientTape. Received: {type(gradtape).__name__}")
    rop = check_gradient_args(op, compression, gradient_predivide_factor, groups, process_set)
    _engine.job()  # fail here, not at gradient(), when init() was not called
    spec = ReduceSpec(rop, compression, bool(sparse_as_dense), float(gradient_predivide_factor),
                      process_set if process_set is not None else global_process_set, bool(scale_local_gradients))
    return _DistributedGradientTape(gradtape, spec)


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                                   compression: Any = Compression.none, sparse_as_dense: bool = False,
                                   op: Any = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: Any = None, process_set: Any = global_process_set,
                                   local_layers: Any = None, scale_local_gradients: bool = True) -> Any:
    """:func:`DistributedGradientTape` that leaves the gradients of ``local_layers``'
    trainable variables local to each worker (not reduced; divided by the number of
    ranks when ``scale_local_gradients``).

    Args:
        local_layers: a Keras layer (Keras 3 or tf_keras) or a list of them; None: no
            local layer (then this is :func:`DistributedGradientTape`).
        The other arguments are :func:`DistributedGradientTape`'s.
    """
    layers = layers_list(local_layers)
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    for layer in layers:
        for variable in layer.trainable_weights:
            tape.register_local_source(variable)
    return tape

