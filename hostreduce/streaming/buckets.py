"""Fusion buckets: the all-reduces of one hand-off group travel as a few flat buffers.

A group is the tensors handed off together (one step's gradients). Before the first
hand-off, the group's all-reduces are laid out into buckets (:func:`plan_buckets`): in
hand-off order, last tensor first (the order a backward pass produces gradients in),
each tensor joins the open bucket of its dtype, op and compression while that bucket
stays within ``fusion_threshold_bytes``; a tensor that would overflow it closes it, and
one larger than a bucket gets a bucket of its own. Each bucket owns one flat buffer, and
its tensors' host buffers are views into it, so handing a tensor off copies it straight
into its bucket and the result needs no copy back.

A bucket is submitted when its last tensor has been handed off: when it is full, or,
for the last buckets of the group, when the group's last tensor (the end of the
backward pass) arrives. The layout depends only on the group's names, shapes, dtypes,
ops and the threshold, and engines that need one submission order (MPI, Horovod) run a
group's hand-offs in a fixed order, so every rank closes the same buckets in the same
order. Every tensor's handle completes when its bucket does.

The ring fuses in its coordinator instead (what is ready on every rank, by name, with
no wait for a bucket to fill), so on the ring every bucket holds one tensor unless
``Channel.bucket_bytes`` asks otherwise (``handoff.exchange`` asks for buckets of small
tensors).

The communication hook. Each bucket goes to the reducer through a hook, ``hook(reducer,
bucket) -> Handle``, as PyTorch DDP's communication hooks do: ``bucket.buffer`` is the
flat buffer, ``bucket.names`` the tensors' collective names, ``bucket.op`` the
reduction, ``bucket.compression`` the wire compression. The handle's result is the
reduced flat buffer: the bucket's own (reduced in place; ``None`` means the same), or
any array of as many elements, which is copied back (so a hook may, e.g., send float16
on the wire). The default hook is ``reducer.allreduce_async(bucket.name, bucket.buffer,
op=bucket.op, out=bucket.buffer, compression=bucket.compression)``. Set one per channel
(``Channel(..., bucket_hook=fn)``) or for the process (:func:`register_bucket_hook`,
which also reaches the Estimator's channel). A hook must submit exactly one collective
per bucket, in the order it is called, on engines that match collectives by position.
"""
from __future__ import annotations

import zlib

import dataclasses
import threading
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from ..errors import ConfigError, HostReduceError
from ..reducers.handle import LinkedHandle
from ..timeline import now_us

__all__ = ["Bucket", "BucketHook", "default_bucket_hook", "register_bucket_hook", "plan_buckets"]


@dataclasses.dataclass
class Bucket:
    """What a communication hook receives (a new one for every submission).

    Attributes:
        name: the bucket's collective name, equal on every rank (a lone tensor's own name).
        names: the collective names of its tensors, in buffer order.
        op: ``mean``, ``sum``, ``min`` or ``max``.
        buffer: the tensors' values, flattened and concatenated (one dtype); a lone
            tensor's in its own shape, so that the engine compares shapes across ranks.
        index: the bucket's position in its group's layout.
        compression: the wire compression its tensors asked for (``None``: the config's).
    """

    name: str
    names: tuple[str, ...]
    op: str
    buffer: np.ndarray
    index: int = 0
    compression: str | None = None

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)


BucketHook = Callable[[Any, Bucket], Any]


def default_bucket_hook(reducer: Any, bucket: Bucket) -> Any:
    """All-reduce the bucket's flat buffer in place on ``reducer``."""
    extra = {} if bucket.compression is None else {"compression": bucket.compression}
    return reducer.allreduce_async(bucket.name, bucket.buffer, op=bucket.op, out=bucket.buffer, **extra)


_registered: BucketHook | None = None


def register_bucket_hook(hook: BucketHook | None) -> BucketHook | None:
    """Use ``hook(reducer, bucket) -> Handle`` for every bucket of every channel that has
    no hook of its own; ``None`` restores the default. Returns the previous hook."""
    global _registered
    if hook is not None and not callable(hook):
        raise ConfigError(f"`hook` must be a callable hook(reducer, bucket) -> Handle or None. Received: {hook!r}")
    previous, _registered = _registered, hook
    return previous


def plan_buckets(entries: Sequence[tuple[Hashable, int] | None], limit: int) -> list[list[int]]:
    """Lay ``entries`` (in hand-off order) out into buckets; return positions per bucket.

    Each entry is ``(key, nbytes)`` (tensors may share a bucket only with equal keys: dtype
    and op) or ``None`` (a bucket of its own: size unknown when laying out). Buckets come
    in submission order: by the position of their last entry. Pure, so every rank that
    calls it with equal entries gets the same buckets.
    """
    done: list[list[int]] = []
    open_: dict[Hashable, tuple[list[int], int]] = {}
    for pos, entry in enumerate(entries):
        if entry is None:
            done.append([pos])
            continue
        key, nbytes = entry
        members, total = open_.get(key, ([], 0))
        if members and total + nbytes > limit:
            done.append(members)
            members, total = [], 0
        open_[key] = (members + [pos], total + nbytes)
    done.extend(members for members, _ in open_.values())
    return sorted(done, key=lambda members: members[-1])


class _Bucket:
    def __init__(self, index: int, slots: list[Any], buffer: np.ndarray) -> None:
        self.index, self.slots, self.buffer = index, slots, buffer
        names = tuple(s.name for s in slots)
        name = names[0]
        if len(names) > 1:
            # The engine sees one flat buffer: the members' shapes travel in its name, so
            # ranks whose tensors differ in shape but not in size do not reduce together.
            shapes = ";".join(str(s.spec_shape) for s in slots)
            name = f"bucket:{names[0]}..{names[-1]}#{zlib.crc32(shapes.encode()):08x}"
        first = slots[0].collective
        self.spec = Bucket(name, names, first.op, buffer, index, first.compression)
        self.started: dict[int, Any] = {}   # slot position -> its tensor's handle, this step


class Fusion:
    """The buckets of one group of slots (their all-reduces), and their submission.

    ``slots`` are in index order; hand-offs run last first. The layout is made at the
    group's first hand-off, when the reducer (and so the bucket size) is known.
    """

    def __init__(self, slots: Sequence[Any], channel: Any) -> None:
        self._slots = list(slots)
        self._channel = channel
        self._lock = threading.Lock()
        self._of: dict[int, _Bucket] | None = None   # id(slot) -> its bucket

    def bucket_of(self, slot: Any) -> _Bucket:
        with self._lock:
            if self._of is None:
                self._of = self._layout()
            return self._of[id(slot)]

    def _layout(self) -> dict[int, _Bucket]:
        limit = self._channel.resolved_bucket_bytes()
        order = [s for s in reversed(self._slots) if s.collective.kind == "allreduce"]
        entries = [None if s.spec_shape is None else ((s.spec_dtype.str, s.collective.op, s.collective.compression),
                                                      _size(s.spec_shape) * s.spec_dtype.itemsize)
                   for s in order]
        of: dict[int, _Bucket] = {}
        for index, positions in enumerate(plan_buckets(entries, limit)):
            slots = [order[p] for p in positions]
            if len(slots) == 1:  # its own buffer, viewed flat when it is submitted
                bucket = _Bucket(index, slots, np.empty(0))
            else:
                bucket = _Bucket(index, slots, np.zeros(sum(_size(s.spec_shape) for s in slots), slots[0].spec_dtype))
                at = 0
                for s in slots:
                    n = _size(s.spec_shape)
                    s.buffer = bucket.buffer[at:at + n].reshape(s.spec_shape)
                    at += n
            for s in slots:
                of[id(s)] = bucket
        return of

    def started(self, slot: Any, handle: Any) -> None:
        """``slot`` was handed off (its handle completes with its bucket); submit the
        bucket if that was its last tensor."""
        bucket = self.bucket_of(slot)
        with self._lock:
            key = id(slot)
            if key in bucket.started:  # an earlier step stopped half-way through this bucket
                stale, bucket.started = bucket.started, {}
                for h in stale.values():
                    h.set_error(HostReduceError(f"Bucket {bucket.spec.name!r} was abandoned: the step that "
                                                "filled it ended before all of its tensors were handed off"))
            bucket.started[key] = handle
            if len(bucket.started) < len(bucket.slots):
                return
            handles, bucket.started = bucket.started, {}
        self._submit(bucket, handles)

    def _submit(self, bucket: _Bucket, handles: dict[int, Any]) -> None:
        lone = len(bucket.slots) == 1
        flat = bucket.slots[0].buffer.reshape(-1) if lone else bucket.buffer
        spec = dataclasses.replace(bucket.spec, buffer=bucket.slots[0].buffer if lone else flat)
        channel = self._channel
        hook = channel.bucket_hook or _registered or default_bucket_hook
        try:
            handle = hook(channel.reducer(), spec)
        except BaseException as exc:
            for h in handles.values():
                h.set_error(exc)
            raise
        submitted = now_us()
        for s in bucket.slots:
            s.submit_time_us = submitted
        for h in handles.values():
            if isinstance(h, LinkedHandle):
                h.inner = handle
        timeline = channel.timeline
        if timeline.enabled:
            first = bucket.slots[0]
            if len(bucket.slots) == 1:
                what, args = first.label, {"index": first.index}
            else:
                what = f"bucket {bucket.index} ({len(bucket.slots)} tensors)"
                args = {"indices": [s.index for s in bucket.slots], "tensors": [s.label for s in bucket.slots],
                        "bytes": spec.nbytes}
            row = timeline.reduce_row(what)
            handle.add_done_callback(lambda _h: timeline.span(f"allreduce {what}", submitted, now_us(), "reduce",
                                                              row, args))
        handle.add_done_callback(lambda h: _complete(spec, flat, bucket.slots, handles, h))


def _complete(spec: Bucket, flat: np.ndarray, slots: list[Any], handles: dict[int, Any], done: Any) -> None:
    """The bucket's collective finished: its result lands in the flat buffer, and each
    tensor's handle completes with the tensor's view of it."""
    try:
        result = done.wait(0)
        if result is not None and result is not flat:
            result = np.asarray(result)
            if result.size != flat.size:
                raise HostReduceError(f"Bucket {spec.name!r}: the hook's result has {result.size} elements, "
                                      f"the bucket {flat.size}")
            np.copyto(flat, result.reshape(-1), casting="same_kind")
    except BaseException as exc:  # noqa: BLE001 - delivered to each tensor's waiter
        for h in handles.values():
            h.set_error(exc)
        return
    for s in slots:
        handles[id(s)].set_result(s.buffer)


def _size(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64))
