"""Hand each ``host_call`` tensor to the reducer the moment the device produces it.

:meth:`HostCallExchange.attach` adds one ``tf.numpy_function`` per tensor to the step's
graph. TensorFlow runs an op as soon as its inputs exist, so the op for a gradient
fires when the backward pass has produced that gradient, not when the whole backward
pass ends: the reductions of the last layers overlap the gradient computation of the
first ones. The callback copies the tensor into a preallocated host buffer (the
tensor's memory is only valid during the callback) and submits an in-place all-reduce.

Engines that negotiate (the ring) accept tensors in any order, so the ops are
stateless and unordered. Engines that need the same submission order on every rank
(MPI, Horovod's core ops driven from Python) get ops chained in reverse variable order,
which is the order a backward pass produces gradients in.

With ``defer=True`` the ops only copy; :meth:`HostCallExchange.wait` then submits every
reduction at once after the step's device program has finished (the sequential
schedule: whole backward pass, then reduction, then apply).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ..timeline import HANDOFF_ROW, Timeline, now_us

__all__ = ["HostCallExchange"]


class HostCallExchange:
    """Host buffers, in-graph hand-off ops and pending reductions of one program.

    Args:
        prefix: collective names are ``{prefix}/{index}``; equal on every rank.
        specs: ``(shape, numpy dtype)`` of each ``host_call`` tensor.
        reducer: zero-argument callable returning the reducer (created lazily).
        ordered: submit in a fixed order (reverse of ``specs``) on every rank.
        timeline: where hand-off and reduction spans go.
        labels: human-readable name of each tensor (the variable it belongs to).
        defer: copy each tensor when it is produced, but submit the reductions only
            in :meth:`wait` (in the fixed reverse order, on every rank alike).
    """

    def __init__(self, prefix: str, specs: Sequence[tuple[tuple[int, ...], Any]], reducer: Callable[[], Any],
                 ordered: bool, timeline: Timeline, labels: Sequence[str] | None = None,
                 defer: bool = False) -> None:
        self.prefix = prefix
        self.buffers = [np.zeros(shape, dtype) for shape, dtype in specs]
        self.names = [f"{prefix}/{i}" for i in range(len(self.buffers))]
        self.labels = list(labels) if labels is not None else list(self.names)
        self._reducer = reducer
        self._ordered = ordered
        self._timeline = timeline
        self.defer = defer
        self._copied = [False] * len(self.buffers)
        self._handles: list[Any] = [None] * len(self.buffers)
        self.submit_times_us: list[float] = [0.0] * len(self.buffers)

    def __len__(self) -> int:
        return len(self.buffers)

    def attach(self, tensors: Sequence[Any]) -> list[Any]:
        """Add the hand-off ops for ``tensors`` to the graph being traced.

        Returns one token tensor per tensor; the step function must return them so
        the ops are not pruned.
        """
        import tensorflow as tf

        tokens: list[Any] = [None] * len(tensors)
        order = range(len(tensors) - 1, -1, -1)
        for i in order:
            tokens[i] = tf.numpy_function(self._make_callback(i), [tensors[i]], tf.int32,
                                          stateful=self._ordered, name=f"hostreduce_handoff_{i}")
        return tokens

    def _make_callback(self, index: int) -> Callable[[np.ndarray], np.ndarray]:
        def handoff(value: np.ndarray) -> np.ndarray:
            self._submit(index, value)
            return np.int32(index)

        return handoff

    def _submit(self, index: int, value: np.ndarray) -> None:
        start = now_us()
        buffer = self.buffers[index]
        np.copyto(buffer, value.reshape(buffer.shape), casting="same_kind")
        if self.defer:
            self._copied[index] = True
            if self._timeline.enabled:
                self._timeline.span(f"hand-off {self.labels[index]}", start, now_us(), "handoff", HANDOFF_ROW,
                                    {"bytes": buffer.nbytes, "index": index})
            return
        self._start_reduction(index, start)

    def _start_reduction(self, index: int, handoff_start: float | None) -> None:
        buffer = self.buffers[index]
        handle = self._reducer().allreduce_async(self.names[index], buffer, op="mean", out=buffer)
        submitted = now_us()
        self.submit_times_us[index] = submitted
        self._handles[index] = handle
        timeline = self._timeline
        if timeline.enabled:
            label = self.labels[index]
            if handoff_start is not None:
                timeline.span(f"hand-off {label}", handoff_start, submitted, "handoff", HANDOFF_ROW,
                              {"bytes": buffer.nbytes, "index": index})
            row = timeline.reduce_row(label)
            handle.add_done_callback(
                lambda _h, s=submitted, r=row, n=label: timeline.span(f"allreduce {n}", s, now_us(), "reduce", r,
                                                                    {"index": index})
            )

    def wait(self, timeout: float | None = None) -> list[np.ndarray]:
        """Block until every reduction of this step is done; return the buffers."""
        if self.defer:
            for i in range(len(self.buffers) - 1, -1, -1):
                if not self._copied[i]:
                    raise RuntimeError(f"host_call tensor {self.labels[i]!r} was never handed to the host")
                self._start_reduction(i, None)
            self._copied = [False] * len(self.buffers)
        for i, handle in enumerate(self._handles):
            if handle is None:
                raise RuntimeError(f"host_call tensor {self.labels[i]!r} was never handed to the host")
            result = handle.wait(timeout)
            if result is not None and result is not self.buffers[i]:
                np.copyto(self.buffers[i], result)
        self._handles = [None] * len(self.buffers)
        return self.buffers
