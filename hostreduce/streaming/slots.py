"""The host side of a hand-off: one :class:`Slot` per collective site of a program.

A slot owns the host buffer that a device tensor is copied into, the collective in
flight on it, and its timeline spans. The device tensor's memory is only valid while
TensorFlow runs the hand-off callback, so the callback copies it (into a buffer kept
from step to step, or a fresh array for an all-gather, whose size changes) and submits
the collective asynchronously; :meth:`Slot.wait` later returns the result.

All-reduces of a group travel in fusion buckets (``buckets.py``): a slot's handle then
completes when its bucket does.

This module knows nothing of TensorFlow: ``handoff.py`` puts the callbacks into graphs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import ConfigError, HostReduceError
from ..reducers.base import Handle, ReduceOp
from ..reducers.handle import LinkedHandle
from ..timeline import HANDOFF_ROW, Timeline, now_us
from .buckets import BucketHook, Fusion

__all__ = ["Collective", "Channel", "Slot", "KINDS", "fuse"]

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
        bucket_bytes: fusion bucket size (``buckets.py``). None: the engine's
            ``fusion_threshold_bytes`` where the engine is ordered, and one tensor per
            bucket on the ring (its coordinator fuses); 0: one tensor per bucket.
        bucket_hook: ``hook(reducer, bucket) -> Handle`` that all-reduces each bucket
            (None: the hook given to ``register_bucket_hook``, else the reducer's
            ``allreduce_async``).
    """

    reducer: Callable[[], Any]
    ordered: bool
    timeline: Timeline = dataclasses.field(default_factory=lambda: Timeline(None))
    timeout_s: float | None = None
    bucket_bytes: int | None = None
    bucket_hook: BucketHook | None = None

    def __post_init__(self) -> None:
        b = self.bucket_bytes
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 0):
            raise ConfigError(f"`bucket_bytes` must be an integer >= 0 or None. Received: bucket_bytes={b!r}")
        if self.bucket_hook is not None and not callable(self.bucket_hook):
            raise ConfigError("`bucket_hook` must be a callable hook(reducer, bucket) -> Handle or None. "
                              f"Received: bucket_hook={self.bucket_hook!r}")

    def resolved_bucket_bytes(self) -> int:
        """The bucket size in bytes (creates the reducer when it takes the engine's)."""
        if self.bucket_bytes is not None:
            return self.bucket_bytes
        if not self.ordered:
            return 0
        # The engine's own config: a strategy built with an explicit Config passed it there.
        config = getattr(self.reducer(), "_config", None)
        if config is None:
            from ..config import Config

            config = Config.from_env()
        return int(config.fusion_threshold_bytes)


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
        # What the bucket layout knows before the first hand-off (None: unknown).
        self.spec_shape: tuple[int, ...] | None = None if shape is None else tuple(int(d) for d in shape)
        self.spec_dtype: np.dtype | None = None if dtype is None else np.dtype(dtype)
        self.fusion: Fusion | None = None
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
        if self.fusion is not None and self.collective.kind == "allreduce":
            shared = len(self.fusion.bucket_of(self).slots) > 1  # lays the buckets out at the first hand-off
            if shared and value.shape != self.spec_shape:
                raise HostReduceError(f"Tensor {self.label!r}: shape {value.shape} differs from the shape its "
                                      f"fusion bucket was laid out for, {self.spec_shape}")
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
        if self.fusion is not None and collective.kind == "allreduce":
            self._start_in_bucket(handoff_start)
            return
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

    def _start_in_bucket(self, handoff_start: float | None) -> None:
        """Hand the tensor to its bucket; its handle completes when the bucket does."""
        assert self.fusion is not None and self.buffer is not None
        handle = self.handle = LinkedHandle(self.name)
        self.submit_time_us = now_us()
        timeline = self.channel.timeline
        if handoff_start is not None and timeline.enabled:
            timeline.span(f"hand-off {self.label}", handoff_start, self.submit_time_us, "handoff", HANDOFF_ROW,
                          {"bytes": int(self.buffer.nbytes), "index": self.index})
        self.fusion.started(self, handle)

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


def fuse(slots: Sequence[Slot], channel: Channel) -> None:
    """Make ``slots`` (one hand-off group, in index order) share fusion buckets."""
    fusion = Fusion(slots, channel)
    for slot in slots:
        slot.fusion = fusion
