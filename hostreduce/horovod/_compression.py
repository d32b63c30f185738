"""Wire compression, as ``horovod.tensorflow.Compression``: ``compress(tensor)`` returns
the tensor to send and a context, ``decompress(tensor, context)`` undoes it."""
from __future__ import annotations

import abc
from typing import Any

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


class Compressor(abc.ABC):
    """What a compression does to a tensor before its collective and after it."""

    @staticmethod
    @abc.abstractmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """The tensor to send, and what ``decompress`` needs to undo the change."""

    @staticmethod
    @abc.abstractmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """The received tensor as the caller's dtype."""


class NoneCompressor(Compressor):
    """Send tensors as they are (the default)."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16; other dtypes go as they are."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        import tensorflow as tf

        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        import tensorflow as tf

        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """The available compressions: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
