"""The host side of a hand-off: one :class:`Slot` per collective site of a program.

A slot owns the host buffer that a device tensor is copied into, the collective in
flight on it, and its timeline spans. The device tensor's memory is only valid while
TensorFlow runs the hand-off callback, so the callback copies it (into a buffer kept
from step to step, or a fresh array for an all-gather, whose size changes) and submits
the collective asynchronously; :meth:`Slot.wait` later returns the result.

This module knows nothing of TensorFlow: ``handoff.py`` puts the callbacks into graphs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from ..errors import ConfigError, HostReduceError
from ..reducers.base import ReduceOp
from ..timeline import HANDOFF_ROW, Timeline, now_us

__all__ = ["Collective", "Channel", "Slot", "KINDS"]

KINDS = ("allreduce", "broadcast", "allgather")


@dataclasses.dataclass(frozen=True)
class Collective:
    """What to do with one tensor.

    Attributes:
        kind: ``allreduce``, ``broadcast`` or ``allgather`` (concatenation along axis 0;
            ranks may differ in the first dimension).
        name: the collective's name, equal on every rank (the ring matches by name).
        op: the reduction of an ``allreduce``: ``mean``, ``sum``, ``min`` or ``max``.
        root: the rank whose tensor a ``broadcast`` sends.
        label: what the timeline calls the tensor (e.g. its variable); default ``name``.
        compression: an ``allreduce``'s wire compression (``fp16``, ``bf16``, ``none``;
            None: the reducer's default).
    """

    kind: str
    name: str
    op: str = "mean"
    root: int = 0
    label: str = ""
    compression: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"`kind` must be one of {KINDS}. Received: kind={self.kind!r}")
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"`name` must be a non-empty string. Received: name={self.name!r}")
        object.__setattr__(self, "op", ReduceOp.parse(self.op).value)

    @property
    def display(self) -> str:
        return self.label or self.name


@dataclasses.dataclass(frozen=True)
class Channel:
    """Where hand-offs go.

    Attributes:
        reducer: zero-argument callable returning the reducer (so it can be created
            lazily, and replaced after a restart).
        ordered: the engine needs every rank to submit collectives in the same order
            (MPI, Horovod's core ops driven from Python); the ring negotiates by name.
        timeline: where hand-off and reduction spans go.
        timeout_s: longest blocking wait for one collective's result (None: no limit
            beyond the engine's own fault detection).
    """

    reducer: Callable[[], Any]
    ordered: bool
    timeline: Timeline = dataclasses.field(default_factory=lambda: Timeline(None))
    timeout_s: float | None = None


class Slot:
    """One collective site: host buffer, collective in flight, timeline spans.

    Args:
        collective: what to do with the tensor.
        channel: the reducer, timeline and wait limit.
        index: position of the tensor in its group (shown in the timeline).
        shape, dtype: preallocate the buffer (otherwise it is sized by the first tensor).
    """

    def __init__(self, collective: Collective, channel: Channel, index: int = 0,
                 shape: tuple[int, ...] | None = None, dtype: Any = None) -> None:
        self.collective = collective
        self.channel = channel
        self.index = index
        self.buffer: np.ndarray | None = None if shape is None else np.zeros(shape, dtype)
        self.handle: Any = None
        self.staged = False
        self.submit_time_us = 0.0

    @property
    def name(self) -> str:
        return self.collective.name

    @property
    def label(self) -> str:
        return self.collective.display

    # -- device -> host -----------------------------------------------------------
    def stage(self, value: np.ndarray, timed: bool = False) -> None:
        """Copy ``value`` (valid only for the duration of the callback) to the host.

        ``timed``: record the copy as a hand-off span (when the collective starts later).
        """
        start = now_us() if timed else 0.0
        self._settle_previous()
        value = np.asarray(value)
        if self.collective.kind == "allgather":
            self.buffer = np.array(value, copy=True)  # its size may change from step to step
        else:
            buffer = self.buffer
            if buffer is None or buffer.shape != value.shape:
                buffer = self.buffer = np.empty(value.shape, value.dtype if buffer is None else buffer.dtype)
            np.copyto(buffer, value, casting="same_kind")
        self.staged = True
        timeline = self.channel.timeline
        if timed and timeline.enabled:
            timeline.span(f"hand-off {self.label}", start, now_us(), "handoff", HANDOFF_ROW,
                          {"bytes": int(self.buffer.nbytes), "index": self.index})

    def hand_off(self, value: np.ndarray) -> None:
        """Copy ``value`` and start its collective at once."""
        start = now_us()
        self.stage(value)
        self.start(start)

    def start(self, handoff_start: float | None = None) -> None:
        """Start the collective on the staged buffer.

        ``handoff_start``: when the copy began (recorded as a hand-off span).
        """
        if not self.staged or self.buffer is None:
            raise HostReduceError(f"Tensor {self.label!r} was never handed to the host")
        self.staged = False
        collective, buffer = self.collective, self.buffer
        reducer = self.channel.reducer()
        if collective.kind == "allreduce":
            handle = reducer.allreduce_async(collective.name, buffer, op=collective.op, out=buffer,
                                             compression=collective.compression)
        elif collective.kind == "broadcast":
            handle = reducer.broadcast_async(collective.name, buffer, root=collective.root)
        else:
            handle = reducer.allgather_async(collective.name, buffer)
        submitted = now_us()
        self.submit_time_us = submitted
        self.handle = handle
        timeline = self.channel.timeline
        if timeline.enabled:
            label, index = self.label, self.index
            if handoff_start is not None:
                timeline.span(f"hand-off {label}", handoff_start, submitted, "handoff", HANDOFF_ROW,
                              {"bytes": int(buffer.nbytes), "index": index})
            row = timeline.reduce_row(label)
            handle.add_done_callback(
                lambda _h, s=submitted, r=row, n=f"{collective.kind} {label}":
                timeline.span(n, s, now_us(), "reduce", r, {"index": index}))

    # -- host -> device -----------------------------------------------------------
    def wait(self, timeout: float | None = None) -> np.ndarray:
        """Block until the collective is done (``timeout``: default the channel's);
        return its result."""
        handle = self.handle
        if handle is None:
            raise HostReduceError(f"Tensor {self.label!r} was never handed to the host")
        self.handle = None
        result = handle.wait(self.channel.timeout_s if timeout is None else timeout)
        if self.collective.kind == "allreduce":
            assert self.buffer is not None
            if result is not None and result is not self.buffer:
                np.copyto(self.buffer, result)
            return self.buffer
        return result

    def _settle_previous(self) -> None:
        # A collective whose result was never collected (its wait was pruned from the
        # graph, or a step failed half-way) may still read or write the buffer.
        handle, self.handle = self.handle, None
        if handle is not None and not handle.done():
            try:
                handle.wait(self.channel.timeout_s)
            except HostReduceError:
                pass
