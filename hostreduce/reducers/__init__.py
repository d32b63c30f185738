"""Reduction engines behind one interface, created by name."""
from .base import Handle, ReduceOp, Reducer
from .registry import available_reducers, create_reducer, register_reducer

__all__ = ["Handle", "ReduceOp", "Reducer", "available_reducers", "create_reducer", "register_reducer"]
