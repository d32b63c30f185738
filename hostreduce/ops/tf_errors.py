"""hostreduce's errors as the TensorFlow exception types Horovod's ops raise.

A script written for Horovod catches ``tf.errors.FailedPreconditionError`` when ranks
disagree on a tensor's shape or dtype, ``tf.errors.InvalidArgumentError`` for a bad
argument, and so on. The collectives of every face raise hostreduce's error re-made as
an instance of that TensorFlow type too (``HostReduceError`` still catches it).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

from ..errors import (CollectiveTimeoutError, ConfigError, HostReduceError, JoinedRankError, PeerLostError,
                      ReducerClosedError, TensorMismatchError, UnmatchedCollectiveError, with_framework_type)
from ..streaming.autograph import not_converted

__all__ = ["as_tf_error", "tf_errors", "checked"]

F = TypeVar("F", bound=Callable[..., Any])

# hostreduce error -> (tf.errors class, its error code), the first match in this order.
_TYPES: tuple[tuple[type, str, str], ...] = (
    (TensorMismatchError, "FailedPreconditionError", "FAILED_PRECONDITION"),
    # Ranks submitted different collectives at this point: they disagree, as a mismatch.
    (UnmatchedCollectiveError, "FailedPreconditionError", "FAILED_PRECONDITION"),
    # Horovod refuses a broadcast, all-gather, ... while a rank has joined as a precondition.
    (JoinedRankError, "FailedPreconditionError", "FAILED_PRECONDITION"),
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
    """Decorate a collective: hostreduce errors leave it as their TensorFlow types too,
    and a traced step's AutoGraph does not convert it (``streaming.autograph``)."""

    @not_converted
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


def checked(values: list[Any], status: Any, label: str) -> list[Any]:
    """``values``, or ``tf.errors.FailedPreconditionError`` from the graph when the host
    op that made them reported that the ranks disagree on the collective (``status`` 1;
    ``hostreduce.streaming.disagreement``; None eagerly, where the error is raised as is).

    TensorFlow has no op that raises an error of a chosen type with a message made at
    run time; reading a variable that does not exist raises ``FailedPreconditionError``,
    so the failing branch reads one whose name is this message (the full error, with
    every rank's values, is in this rank's log)."""
    if status is None:
        return values
    import tensorflow as tf

    message = (f"collective {label!r}: the ranks disagree on it (their shapes, dtypes, ops or roots differ, or "
               "they ran other collectives at this point, or a rank has joined and it is not an all-reduce): "
               "TensorMismatchError, UnmatchedCollectiveError or JoinedRankError; this rank's log has each rank's "
               "values. (hostreduce raises it as FailedPreconditionError, as Horovod does)")

    def fine() -> list[Any]:
        return [tf.identity(v) for v in values]

    def failed() -> list[Any]:
        out = []
        for v in values:
            handle = tf.raw_ops.VarHandleOp(dtype=v.dtype, shape=[], container="hostreduce", shared_name=message)
            out.append(tf.raw_ops.ReadVariableOp(resource=handle, dtype=v.dtype, name="ranks_disagree"))
        return out

    results = tf.cond(tf.equal(status, 0), fine, failed)
    results = list(results) if isinstance(results, (list, tuple)) else [results]
    for result, value in zip(results, values):
        result.set_shape(value.shape)
    return results
