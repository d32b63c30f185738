"""Hand each tensor to the reducer the moment the device produces it.

A hand-off op is a ``tf.numpy_function`` in the step's graph. TensorFlow runs an op as
soon as its inputs exist, so the op for a gradient fires when the backward pass has
produced that gradient, not when the whole backward pass ends: the reductions of the
last layers overlap the gradient computation of the first ones. The op copies the
tensor to the host and submits an asynchronous collective (``slots.py``).

Two faces share these ops:

* :func:`exchange` (``tf.function`` steps, eager code): a hand-off op per tensor, then a
  wait op per tensor that returns the collective's result into the graph. The wait ops
  depend on every hand-off of their group, so no TensorFlow thread blocks in a wait
  while a tensor of the group still has to be handed off (blocked threads could
  otherwise starve the backward pass that would produce it).
* :class:`HostCallExchange` (the Estimator): hand-off ops in the device program; the
  host program then either waits for every result and applies them at once, or has a
  wait op per tensor (:meth:`HostCallExchange.wait_ops`), so that each variable's
  update runs as soon as its own reduction is done.

Buckets. The all-reduces of a group (one call of :func:`exchange`, one Estimator
program) are fused into buckets (``buckets.py``): a bucket is submitted when its last
tensor is handed off, and each wait op returns when its tensor's bucket is reduced.

Small tensors. On an engine that negotiates by name (the ring), :func:`exchange` fuses
each run of consecutive small all-reduces of a group (tensors of at most
:data:`SMALL_BUCKET_BYTES` together, in hand-off order; ``Channel.bucket_bytes`` unset)
into one bucket, and hands a bucket off with one op and waits for it with one op.
Each op a step runs costs TensorFlow's call into Python, and each collective costs the
engine's negotiation, whatever the tensor's size: for a model of a few small tensors
(MNIST's) those per-tensor costs, not the bytes, set the step time. A bucket starts
when its last tensor exists, as before; tensors larger than the limit still go alone,
as soon as each exists.

Ordering. Engines that negotiate (the ring) accept tensors in any order, so a group's
hand-off ops are unordered. Engines that need the same submission order on every rank
(``Channel.ordered``: MPI, Horovod's core ops driven from Python) get stateful ops, each
with a control dependency on the one created before it, so that a group's hand-offs run
in the order they were created in ``tf.function`` and in a TF1 graph alike (a
``Session`` orders no stateful ops by itself); a group's ops are created in reverse
order, the order a backward pass produces gradients in. :func:`exchange` with
``chained=True`` (single collectives outside a group) orders them on every engine, which
also keeps independent collectives from blocking each other's threads.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import ConfigError
from ..reducers.base import SUPPORTED_DTYPES
from ..timeline import Timeline
from .autograph import not_converted, plain
from .disagreement import with_status
from .slots import Channel, Collective, Slot, fuse

__all__ = ["HostCallExchange", "SMALL_BUCKET_BYTES", "exchange", "handoff_ops"]

# The most bytes a bucket of small all-reduces holds when exchange() fuses them on an
# engine that negotiates by name (the ring). Up to about this size a ring all-reduce
# costs its fixed per-collective time whatever the bytes (N = 2, one host: 0.13 ms at
# 1 KiB and 0.20 ms at 256 KiB in shared memory, 1.4 and 1.8 ms over gRPC), so fusing
# saves per-tensor costs; a smaller limit keeps a bucket within a layer or two, so that
# it starts early in the backward pass.
SMALL_BUCKET_BYTES = 256 << 10


def handoff_ops(slots: Sequence[Slot], tensors: Sequence[Any], stateful: bool, defer: bool = False) -> list[Any]:
    """Add one hand-off op per tensor to the graph being traced, last tensor first.

    Returns one int32 token per tensor (in the order of ``tensors``); something must
    depend on each token (or the ops must be stateful) so that TensorFlow does not
    prune the op. See :func:`_unit_handoffs` for ``stateful``.
    """
    units = _single_units(len(slots))
    tokens = _unit_handoffs(slots, tensors, units, stateful, defer)
    by_index: list[Any] = [None] * len(slots)
    for unit, token in zip(units, tokens):
        by_index[unit[0]] = token
    return by_index


def _unit_handoffs(slots: Sequence[Slot], tensors: Sequence[Any], units: Sequence[Sequence[int]], stateful: bool,
                   defer: bool = False) -> list[Any]:
    """Add one hand-off op per unit (a list of slot indices), in the order of ``units``;
    return one int32 token per unit.

    ``stateful`` ops (an ordered engine, or a chained group) also wait for the hand-off
    created before them. ``tf.function`` orders stateful ops by itself; a TF1 graph run
    by a ``Session`` does not, and its executor starts the ops of a group in whatever
    order their inputs become ready, which differs from rank to rank (an engine that
    matches collectives by position, Horovod's core ops, then pairs different tensors).
    """
    import tensorflow as tf

    tokens: list[Any] = []
    previous: list[Any] = []
    for unit in units:
        with tf.control_dependencies(previous):
            token = tf.numpy_function(_handoff_callback([slots[i] for i in unit], defer), [tensors[i] for i in unit],
                                      tf.int32, stateful=stateful, name=f"hostreduce_handoff_{unit[0]}")
        if stateful:
            previous = [token]
        tokens.append(token)
    return tokens


def _single_units(count: int) -> list[list[int]]:
    """Every slot its own unit, last first (the order a backward pass produces them)."""
    return [[i] for i in range(count - 1, -1, -1)]


def _handoff_callback(members: Sequence[Slot], defer: bool) -> Callable[..., np.ndarray]:
    @plain
    def handoff(*values: np.ndarray) -> np.ndarray:
        for slot, value in zip(members, values):
            if defer:
                slot.stage(value, timed=True)
            else:
                slot.hand_off(value)
        return np.int32(members[0].index)

    return handoff


def _wait_callback(members: Sequence[Slot]) -> Callable[..., list[np.ndarray]]:
    @plain
    def wait(*_token: Any) -> list[np.ndarray]:
        return [slot.wait() for slot in members]

    return wait


def _check_dtype(tensor: Any, collective: Collective) -> None:
    dtype = np.dtype(tensor.dtype.as_numpy_dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise ConfigError(
            f"Tensor {collective.display!r}: dtype must be one of {[str(d) for d in SUPPORTED_DTYPES]}. "
            f"Received: dtype={tensor.dtype.name}"
        )
    if dtype == np.bool_ and collective.kind in ("allreduce", "reducescatter", "reduce"):
        raise ConfigError(f"Tensor {collective.display!r}: a reduction needs a numeric dtype; bool tensors can be "
                          f"broadcast or all-gathered. Received: dtype={tensor.dtype.name}")


@not_converted
def exchange(channel: Channel, tensors: Sequence[Any], collectives: Sequence[Collective], *,
             chained: bool = False, statuses: bool = False) -> Any:
    """Run one collective per tensor through the host reducer; return the results.

    This is the one entry point for code that has tensors (the Horovod API, optimizer
    wrappers): in a ``tf.function`` it adds a hand-off op and a wait op per tensor to the
    graph being traced, so each collective starts as soon as its tensor exists; eagerly
    it submits every collective (last first) and then waits for them.

    Args:
        channel: the reducer, ordering requirement, timeline and wait limit.
        tensors: ``tf.Tensor``-convertible values, one per collective.
        collectives: what to do with each tensor; names must be equal on every rank.
        chained: submit in the order of ``tensors`` reversed, after whatever stateful op
            the graph created before (one collective at a time, or a group that must
            not overlap others); otherwise only ordered engines are chained.
        statuses: in a graph, each wait op also returns a status (``disagreement.py``):
            a disagreement between ranks is status 1 instead of an exception; the
            result is then ``(results, statuses)`` (statuses None eagerly).

    Returns:
        One tensor per input: the reduced (or broadcast, or gathered) value, with the
        input's dtype; an all-gather's first dimension is unknown in a graph.
    """
    import tensorflow as tf

    if len(tensors) != len(collectives):
        raise ConfigError(f"`collectives` must have one entry per tensor ({len(tensors)}). "
                          f"Received: {len(collectives)} collectives")
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for tensor, collective in zip(tensors, collectives):
        _check_dtype(tensor, collective)
    batched = not chained and not channel.ordered and channel.bucket_bytes is None
    if batched:  # fuse runs of small all-reduces (see the module's docstring)
        channel = dataclasses.replace(channel, bucket_bytes=SMALL_BUCKET_BYTES)
    slots = [Slot(c, channel, index=i, **_static_spec(t, c)) for i, (t, c) in enumerate(zip(tensors, collectives))]
    fuse(slots, channel)
    if not tensors:
        return ([], []) if statuses else []
    if tf.executing_eagerly():
        for i in range(len(slots) - 1, -1, -1):
            slots[i].hand_off(tensors[i].numpy())
        done = [tf.convert_to_tensor(slot.wait()) for slot in slots]
        return (done, None) if statuses else done
    units = _units(slots) if batched else _single_units(len(slots))
    return _graph_ops(slots, tensors, units, stateful=chained or channel.ordered, statuses=statuses)


def _units(slots: Sequence[Slot]) -> list[list[int]]:
    """The group's slots as hand-off units, each in hand-off order (last index first): the
    members of each bucket of several all-reduces, and every other slot alone."""
    units: list[list[int]] = []
    seen: set[int] = set()
    for i in range(len(slots) - 1, -1, -1):
        if i in seen:
            continue
        slot = slots[i]
        unit = [i]
        if slot.fusion is not None and slot.collective.kind == "allreduce":
            members = slot.fusion.bucket_of(slot).slots
            if len(members) > 1:
                unit = [m.index for m in members]
        seen.update(unit)
        units.append(unit)
    return units


def _graph_ops(slots: Sequence[Slot], tensors: Sequence[Any], units: Sequence[Sequence[int]], stateful: bool,
               statuses: bool) -> Any:
    """:func:`exchange`'s graph ops: one hand-off op and one wait op per unit. Every
    wait op depends on every hand-off of the group; wait ops are stateful (each runs
    even if its result is unused, so no collective is left in flight on a buffer that
    the next step reuses) and are created in the order of ``units``."""
    import tensorflow as tf

    tokens = _unit_handoffs(slots, tensors, units, stateful)
    results: list[Any] = [None] * len(slots)
    status: list[Any] = [None] * len(slots)
    with tf.control_dependencies(tokens):
        for unit, token in zip(units, tokens):
            members = [slots[i] for i in unit]
            dtypes = [tensors[i].dtype for i in unit]
            wait = _wait_callback(members)
            if statuses:
                label = members[0].collective.display if len(members) == 1 else \
                    f"{members[0].collective.display} .. {members[-1].collective.display}"
                wait = plain(with_status(wait, [d.as_numpy_dtype for d in dtypes], label))
                *outs, unit_status = tf.numpy_function(wait, [token], dtypes + [tf.int32], stateful=True,
                                                       name=f"hostreduce_wait_{unit[0]}")
            else:
                outs = tf.numpy_function(wait, [token], dtypes, stateful=True, name=f"hostreduce_wait_{unit[0]}")
                unit_status = None
            for i, out in zip(unit, outs):
                tensor, slot = tensors[i], slots[i]
                if slot.collective.kind == "allgather":
                    if tensor.shape.rank is not None:
                        out.set_shape([None] + tensor.shape.as_list()[1:])
                else:
                    out.set_shape(tensor.shape)
                results[i], status[i] = out, unit_status
    return (results, status) if statuses else results


def _static_spec(tensor: Any, collective: Collective) -> dict[str, Any]:
    """An all-reduce's shape and dtype where the graph knows them, for the bucket layout."""
    if collective.kind != "allreduce" or not tensor.shape.is_fully_defined():
        return {}
    return {"shape": tuple(tensor.shape.as_list()), "dtype": tensor.dtype.as_numpy_dtype}


class HostCallExchange:
    """Host buffers, in-graph hand-off ops and pending reductions of one Estimator program.

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
        self.channel = Channel(reducer, ordered, timeline)
        names = [f"{prefix}/{i}" for i in range(len(specs))]
        labels = list(labels) if labels is not None else names
        self.slots = [Slot(Collective("allreduce", names[i], "mean", label=labels[i]), self.channel, i, shape, dtype)
                      for i, (shape, dtype) in enumerate(specs)]
        fuse(self.slots, self.channel)
        self.defer = defer
        self.timeout: float | None = None
        self.failure: BaseException | None = None

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def buffers(self) -> list[np.ndarray]:
        return [slot.buffer for slot in self.slots]  # type: ignore[misc]

    @property
    def names(self) -> list[str]:
        return [slot.name for slot in self.slots]

    @property
    def labels(self) -> list[str]:
        return [slot.label for slot in self.slots]

    @property
    def submit_times_us(self) -> list[float]:
        return [slot.submit_time_us for slot in self.slots]

    def attach(self, tensors: Sequence[Any]) -> list[Any]:
        """Add the hand-off ops for ``tensors`` to the graph being traced.

        Returns one token tensor per tensor; the step function must return them so
        the ops are not pruned.
        """
        return handoff_ops(self.slots, tensors, stateful=self.channel.ordered, defer=self.defer)

    def start_deferred(self) -> None:
        """Submit the reductions held back by ``defer`` (fixed reverse order)."""
        if self.defer:
            for slot in reversed(self.slots):
                slot.start(None)

    def wait(self, timeout: float | None = None) -> list[np.ndarray]:
        """Block until every reduction of this step is done; return the buffers."""
        self.start_deferred()
        return [slot.wait(timeout) for slot in self.slots]

    def wait_ops(self) -> list[Any]:
        """Add a wait op per tensor to the graph being traced; return their results.

        Each op blocks until its tensor's reduction is done (within ``self.timeout``)
        and returns the reduced value, so whatever reads only that value (one
        variable's update) runs while later reductions are still on the wire. The ops
        are stateful, so ``tf.function`` runs them in creation order: last tensor
        first, the order the reductions were submitted in. A hostreduce error in a wait
        is kept in ``self.failure`` (TensorFlow reports it as its own error type).
        """
        import tensorflow as tf

        results: list[Any] = [None] * len(self.slots)
        for i in range(len(self.slots) - 1, -1, -1):
            slot = self.slots[i]
            out = tf.numpy_function(self._wait_one(slot), [], tf.as_dtype(slot.buffer.dtype), stateful=True,
                                    name=f"hostreduce_wait_{i}")
            out.set_shape(slot.buffer.shape)
            results[i] = out
        return results

    def _wait_one(self, slot: Slot) -> Callable[[], np.ndarray]:
        @plain
        def wait() -> np.ndarray:
            try:
                return slot.wait(self.timeout)
            except BaseException as exc:
                self.failure = self.failure or exc
                raise

        return wait
