"""Device-to-host hand-off of ``host_call`` tensors while the backward pass runs."""
from .handoff import HostCallExchange

__all__ = ["HostCallExchange"]
