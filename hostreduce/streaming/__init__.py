"""Device-to-host hand-off of tensors while the backward pass runs: one layer for the
Estimator's ``host_call`` and for collectives in ``tf.function`` steps.

* :func:`exchange` hands tensors to the reducer in-graph (or eagerly) and returns the
  results: what a GradientTape wrapper or an optimizer wrapper calls.
* :class:`Channel` says where they go (reducer, ordering, timeline, wait limit);
  :class:`Collective` what happens to each (all-reduce, broadcast, all-gather).
* :class:`HostCallExchange` is the Estimator's face: hand-off ops in the device program,
  waits on the host.
* All-reduces travel in fusion buckets filled in backward order; each :class:`Bucket`
  goes to the reducer through a communication hook, ``hook(reducer, bucket) -> Handle``,
  which :func:`register_bucket_hook` (or ``Channel(bucket_hook=...)``) swaps.
"""
from .buckets import Bucket, default_bucket_hook, plan_buckets, register_bucket_hook
from .handoff import HostCallExchange, exchange, handoff_ops
from .slots import Channel, Collective, Slot

__all__ = ["Bucket", "Channel", "Collective", "HostCallExchange", "Slot", "default_bucket_hook", "exchange",
           "handoff_ops", "plan_buckets", "register_bucket_hook"]
