"""Ranks that disagree on a collective, inside a graph: reported as a status instead of
an exception.

TensorFlow turns any exception raised in a Python op (``tf.numpy_function``) into
``tf.errors.UnknownError``, whatever its type. Horovod's ops raise
``tf.errors.FailedPreconditionError`` when ranks disagree on a tensor, in graphs too, and
scripts catch it. So a host op built for a face's collective (``statuses=True``) does
not raise a disagreement (``TensorMismatchError``, ``UnmatchedCollectiveError``, or
``JoinedRankError``: a collective that cannot run while a rank has joined): it
logs the error, with every rank's values, and returns status 1 next to its outputs; the
face then raises the typed error from a TensorFlow op (``hostreduce.ops.tf_errors``).
Other errors are raised as before.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import JoinedRankError, TensorMismatchError, UnmatchedCollectiveError

__all__ = ["DISAGREEMENTS", "with_status"]

DISAGREEMENTS = (TensorMismatchError, UnmatchedCollectiveError, JoinedRankError)
_log = logging.getLogger("hostreduce.streaming")


def with_status(run: Callable[..., Sequence[np.ndarray]], dtypes: Sequence[np.dtype], label: str
                ) -> Callable[..., list[np.ndarray]]:
    """``run``'s outputs and a status (int32 0), or empty outputs and status 1 when the
    ranks disagree on the collective (logged with its message)."""

    def call(*args: Any) -> list[np.ndarray]:
        try:
            outs = list(run(*args))
        except DISAGREEMENTS as exc:
            _log.error("hostreduce: %s: %s: %s", label, type(exc).__name__, exc)
            return [np.zeros(0, d) for d in dtypes] + [np.int32(1)]
        return outs + [np.int32(0)]

    return call
