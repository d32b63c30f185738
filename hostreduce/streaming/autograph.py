"""Keep hostreduce's graph-building code and host callbacks out of AutoGraph.

A ``tf.function`` traced with AutoGraph (the default) converts every function its code
calls, recursively, unless the function belongs to TensorFlow or Keras. A user's
training step that calls ``hvd.allreduce`` or ``DistributedGradientTape.gradient``
would therefore convert hostreduce's code too, and with it the functions that code
defines and hands to ``tf.numpy_function``: the host callbacks of every step would run
as converted code, each ``if`` and ``for`` through AutoGraph's operators. Measured with
one all-reduce of 200 KB per step at 2 ranks, that cost about 2 ms of CPU per step,
several times the collective's own cost.

* :func:`not_converted` decorates an entry point into hostreduce's graph-building code:
  called from converted code it runs as written, and so does everything it calls.
* :func:`plain` marks a host callback itself.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

__all__ = ["not_converted", "plain"]

F = TypeVar("F", bound=Callable[..., Any])


def not_converted(fn: F) -> F:
    """``fn`` runs unconverted, with AutoGraph off for whatever it calls (TensorFlow is
    imported only when ``fn`` is called)."""

    unconverted: list[Callable[..., Any]] = []  # made once, at the first call

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not unconverted:
            unconverted.append(plain(fn))
        return unconverted[0](*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def plain(fn: F) -> F:
    """Mark a callback so that AutoGraph never converts it."""
    import tensorflow as tf

    return tf.autograph.experimental.do_not_convert(fn)
