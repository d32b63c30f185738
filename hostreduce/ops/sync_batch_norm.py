"""``SyncBatchNormalization``: a Keras ``BatchNormalization`` whose training-time batch
statistics are those of the whole job's batch (Horovod's ``hvd.SyncBatchNormalization``).

In training each rank computes its batch's per-channel mean and mean of squares and
one all-reduce (Sum) adds them up, weighted by each rank's number of elements (its
unmasked ones with a mask): the mean and variance are then exactly those of the
concatenated global batch, also when the ranks' batches differ in size. Inference
uses the moving statistics, as the plain layer does. The base class is the
``BatchNormalization`` of the Keras that ``tf.keras`` is when this module is imported
(Keras 3, or tf_keras with ``TF_USE_LEGACY_KERAS=1``). Importing this module imports
TensorFlow.
"""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from ..errors import ConfigError
from . import job as _engine
from .arguments import Sum
from .tensors import allreduce

__all__ = ["SyncBatchNormalization"]


class SyncBatchNormalization(tf.keras.layers.BatchNormalization):
    """Batch normalization with the statistics of the whole job's batch in training.

    Args:
        fused: accepted for Horovod's signature; only False (the default) is allowed, as
            in Horovod. It is not passed on (Keras 3 has no ``fused``).
        **kwargs: ``tf.keras.layers.BatchNormalization``'s arguments (``axis``,
            ``momentum``, ``epsilon``, ...). ``name`` defaults to
            ``"sync_batch_normalization"``.
    """

    def __init__(self, fused: Any = False, **kwargs: Any) -> None:
        if fused is None or fused is True:
            raise ConfigError("SyncBatchNormalization does not support a fused kernel: pass `fused=False` or "
                              f"leave it out. Received: fused={fused!r}")
        if not kwargs.get("name"):
            kwargs["name"] = "sync_batch_normalization"
        if _legacy_keras():
            kwargs["fused"] = False
        super().__init__(**kwargs)

    def _moments(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        # Keras 3 calls _moments(inputs, mask), tf_keras _moments(inputs, reduction_axes, keep_dims).
        mean, variance = super()._moments(inputs, *args, **kwargs)
        if _engine.size() == 1:
            return mean, variance
        mask = kwargs.get("mask", args[0] if args and not _legacy_keras() else None)
        dtype = mean.dtype
        if mask is None:
            count = tf.cast(tf.size(inputs), dtype) / tf.cast(tf.size(mean), dtype)
        else:
            count = tf.reduce_sum(tf.cast(mask, dtype))
        local = tf.concat([tf.reshape(mean * count, [-1]), tf.reshape((variance + tf.square(mean)) * count, [-1]),
                           tf.reshape(count, [1])], axis=0)
        total = allreduce(local, op=Sum)
        channels = tf.size(mean)
        sums, squares, n = total[:channels], total[channels:2 * channels], total[2 * channels]
        global_mean = sums / n
        global_variance = tf.maximum(squares / n - tf.square(global_mean), 0.0)
        return tf.reshape(global_mean, tf.shape(mean)), tf.reshape(global_variance, tf.shape(variance))


def _legacy_keras() -> bool:
    """Whether the base class is tf_keras's (whose ``_moments`` and ``fused`` differ)."""
    return tf.keras.layers.BatchNormalization.__module__.startswith("tf_keras")
