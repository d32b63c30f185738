"""Device-to-host hand-off of tensors while the backward pass runs: one layer for the
Estimator's ``host_call`` and for collectives in ``tf.function`` steps.

* :func:`exchange` hands tensors to the reducer in-graph (or eagerly) and returns the
  results: what a GradientTape wrapper or an optimizer wrapper calls.
* :class:`Channel` says where they go (reducer, ordering, timeline, wait limit);
  :class:`Collective` what happens to each (all-reduce, broadcast, all-gather).
* :class:`HostCallExchange` is the Estimator's face: hand-off ops in the device program,
  waits on the host.
"""
from .handoff import HostCallExchange, exchange, handoff_ops
from .slots import Channel, Collective, Slot

__all__ = ["Channel", "Collective", "HostCallExchange", "Slot", "exchange", "handoff_ops"]
