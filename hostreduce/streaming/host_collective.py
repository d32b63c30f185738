"""Collectives other than the gradient hand-off, as one host op each: reduce-scatter,
reduce, all-to-all, send/receive, and any collective on a process group.

:func:`host_collective` adds a ``tf.numpy_function`` that copies its inputs to the host
when they exist, runs one collective on the channel's reducer and returns its outputs
into the graph (or does so at once, eagerly). Unlike :func:`exchange`, the op waits for
its own result: these collectives are used one at a time in a step, so nothing is
gained by splitting submission from the wait, and outputs whose shape depends on other
ranks (a reduce-scatter's rows, an all-to-all's received rows) come back in one piece.
Ops run in creation order on engines that match by position (``Channel.ordered``):
``tf.function`` runs stateful ops in that order by itself; in a TF1 graph run by a
``Session``, which orders none, the ops that one call creates (a group of collectives
on a process set) are chained in creation order inside :func:`in_order`.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..timeline import now_us
from .autograph import not_converted, plain
from .disagreement import with_status
from .slots import Channel

__all__ = ["host_collective", "in_order"]

_chain = threading.local()


@contextlib.contextmanager
def in_order() -> Iterator[None]:
    """Each host op created in this block (in a graph) waits for the one created before
    it, so that ranks run them in the same order. Only one call's ops belong in a block:
    an op that waited for the op of another ``session.run`` fetch would run that one
    too."""
    previous = getattr(_chain, "ops", None)
    _chain.ops = []
    try:
        yield
    finally:
        _chain.ops = previous

Run = Callable[[Any, list[np.ndarray]], Sequence[np.ndarray]]


@not_converted
def host_collective(channel: Channel, label: str, run: Run, inputs: Sequence[Any], out_dtypes: Sequence[Any],
                    out_shapes: Sequence[Any], statuses: bool = False) -> Any:
    """One host op running ``run(reducer, host_arrays) -> outputs``.

    ``out_dtypes``/``out_shapes`` describe the outputs (a shape may have ``None``
    dimensions). Returns the output tensors; with ``statuses``, ``(outputs, status)``:
    in a graph a disagreement between ranks is status 1 instead of an exception
    (``disagreement.py``; status None eagerly).
    """
    import tensorflow as tf

    def op(*arrays: np.ndarray) -> list[np.ndarray]:
        start = now_us()
        outs = [np.asarray(o) for o in run(channel.reducer(), [np.asarray(a) for a in arrays])]
        timeline = channel.timeline
        if timeline.enabled:
            timeline.span(label, start, now_us(), "reduce", timeline.reduce_row(label), {})
        return [o.astype(tf.as_dtype(d).as_numpy_dtype, copy=False) for o, d in zip(outs, out_dtypes)]

    dtypes = [tf.as_dtype(d) for d in out_dtypes]
    status = None
    chain = getattr(_chain, "ops", None)
    after = chain[-1:] if chain is not None and not tf.executing_eagerly() else []
    with tf.control_dependencies(after):
        if statuses and not tf.executing_eagerly():
            op = plain(with_status(op, [d.as_numpy_dtype for d in dtypes], label))
            *outs, status = tf.numpy_function(op, list(inputs), dtypes + [tf.int32], stateful=True,
                                              name="hostreduce_collective")
        else:
            op = plain(op)
            outs = tf.numpy_function(op, list(inputs), dtypes, stateful=True, name="hostreduce_collective")
            if not isinstance(outs, (list, tuple)):
                outs = [outs]
    if chain is not None and outs and not tf.executing_eagerly():
        chain.append(outs[0].op)
    result = []
    for out, shape in zip(outs, out_shapes):
        out.set_shape(shape)
        result.append(out)
    return (result, status) if statuses else result


def wait_result(handle: Any, channel: Channel) -> Any:
    """A collective's result, waited for up to the channel's limit."""
    return handle.wait(channel.timeout_s)
