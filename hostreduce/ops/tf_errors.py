"""hostreduce's errors as the TensorFlow exception types Horovod's ops raise.

A script written for Horovod catches ``tf.errors.FailedPreconditionError`` when ranks
disagree on a tensor's shape or dtype, ``tf.errors.InvalidArgumentError`` for a bad
argument, and so on. The collectives of every face raise hostreduce's error re-made as
an instance of that TensorFlow type too (``HostReduceError`` still catches it).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

from ..errors import (CollectiveTimeoutError, ConfigError, HostReduceError, PeerLostError, ReducerClosedError,
                      TensorMismatchError, UnmatchedCollectiveError, with_framework_type)

__all__ = ["as_tf_error", "tf_errors"]

F = TypeVar("F", bound=Callable[..., Any])

# hostreduce error -> (tf.errors class, its error code), the first match in this order.
_TYPES: tuple[tuple[type, str, str], ...] = (
    (TensorMismatchError, "FailedPreconditionError", "FAILED_PRECONDITION"),
    # Ranks submitted different collectives at this point: they disagree, as a mismatch.
    (UnmatchedCollectiveError, "FailedPreconditionError", "FAILED_PRECONDITION"),
    (CollectiveTimeoutError, "DeadlineExceededError", "DEADLINE_EXCEEDED"),
    (PeerLostError, "UnavailableError", "UNAVAILABLE"),
    (ReducerClosedError, "AbortedError", "ABORTED"),
    (ConfigError, "InvalidArgumentError", "INVALID_ARGUMENT"),
)


def as_tf_error(error: BaseException) -> BaseException:
    """``error`` as an instance of its TensorFlow type too (unchanged if it has none)."""
    if not isinstance(error, HostReduceError):
        return error
    import tensorflow as tf

    if isinstance(error, tf.errors.OpError):
        return error
    for ours, class_name, code_name in _TYPES:
        if isinstance(error, ours):
            message, code = str(error), getattr(tf.errors, code_name)

            def init(new: Any) -> None:
                tf.errors.OpError.__init__(new, None, None, message, code)

            return with_framework_type(error, getattr(tf.errors, class_name), init)
    return error


def tf_errors(fn: F) -> F:
    """Decorate a collective: hostreduce errors leave it as their TensorFlow types too."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except HostReduceError as exc:
            converted = as_tf_error(exc)
            if converted is exc:
                raise
            raise converted.with_traceback(exc.__traceback__) from exc.__cause__

    return wrapper  # type: ignore[return-value]
