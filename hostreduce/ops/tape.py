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
from .compression import Compression
from .arguments import Average, check_compression, check_process_set, resolve_op
from .process_sets import global_process_set
from .tensors import reduce_gradients

__all__ = ["DistributedGradientTape"]


def _key(source: Any) -> Any:
    ref = getattr(source, "ref", None)
    return ref() if callable(ref) else id(source)


def _label(source: Any, index: int) -> str:
    return str(getattr(source, "path", None) or getattr(source, "name", None) or f"source{index}")


class _DistributedGradientTape(tf.GradientTape):
    """Records on the same tape as the wrapped one; ``gradient()`` reduces."""

    def __init__(self, tape: tf.GradientTape, compression: Any, sparse_as_dense: bool, op: Any,
                 predivide: float, scale_local_gradients: bool) -> None:
        super().__init__(persistent=tape._persistent,
                         watch_accessed_variables=getattr(tape, "_watch_accessed_variables", True))
        self._tape = tape._tape  # the recording so far (None if the tape was never entered)
        self._hvd_compression = compression
        self._hvd_sparse_as_dense = sparse_as_dense
        self._hvd_op = op
        self._hvd_predivide = predivide
        self._hvd_scale_local = scale_local_gradients
        self._hvd_local: set[Any] = set()

    def register_local_source(self, source: Any) -> None:
        """Leave the gradient of ``source`` local to this worker (not reduced); it is
        divided by ``size()`` when ``scale_local_gradients`` is True, as in Horovod."""
        self._hvd_local.add(_key(source))

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None, use_generic_names: bool = False,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        """The gradients of ``target`` with respect to ``sources``, reduced over the job.

        ``use_generic_names`` is accepted (collective names never depend on TensorFlow
        name scopes here).
        """
        gradients = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat = tf.nest.flatten(gradients)
        todo = [i for i, (s, g) in enumerate(zip(flat_sources, flat))
                if g is not None and _key(s) not in self._hvd_local]
        world = _engine.size()
        reduced = reduce_gradients([flat[i] for i in todo], [_label(flat_sources[i], i) for i in todo],
                                   op=self._hvd_op, compression=self._hvd_compression,
                                   sparse_as_dense=self._hvd_sparse_as_dense, predivide=self._hvd_predivide)
        out = list(flat)
        for i, g in zip(todo, reduced):
            out[i] = g
        if self._hvd_scale_local and self._hvd_local:
            for i, s in enumerate(flat_sources):
                g = out[i]
                if g is None or _key(s) not in self._hvd_local:
                    continue
                if isinstance(g, tf.IndexedSlices):
                    out[i] = tf.IndexedSlices(g.values / tf.cast(world, g.values.dtype), g.indices, g.dense_shape)
                else:
                    out[i] = g / tf.cast(world, g.dtype)
        return tf.nest.pack_sequence_as(gradients, out)


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
        process_set: only the whole job is supported.
        scale_local_gradients: divide the gradients of sources registered with
            ``register_local_source`` by ``size()``.
    """
    check_process_set(process_set)
    check_compression(compression)
    if not isinstance(gradtape, tf.GradientTape):
        raise ConfigError(f"`gradtape` must be a tf.GradientTape. Received: {type(gradtape).__name__}")
    rop = resolve_op(op)
    if gradient_predivide_factor != 1.0 and rop is not Average:
        raise ConfigError("`gradient_predivide_factor` needs op=Average. "
                          f"Received: gradient_predivide_factor={gradient_predivide_factor!r}, op={rop!r}")
    if groups is not None and not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ConfigError("`groups` must be a positive integer or a list of lists of variables. "
                          f"Received: groups={groups!r}")
    _engine.job()  # fail here, not at gradient(), when init() was not called
    return _DistributedGradientTape(gradtape, compression, bool(sparse_as_dense), rop,
                                    float(gradient_predivide_factor), bool(scale_local_gradients))
