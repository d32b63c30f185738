"""Routing of methods and functions hostreduce does not own (optimizers of TensorFlow
and Keras, ``tf.compat.v1.train`` functions), active only inside a ``with`` block on
the calling thread.

The attribute is replaced once while any thread is inside a block for it and
restored when the last one leaves; the replacement sends every call made outside a
block (other threads, user code after training) to the original method unchanged, so
a routed call and a plain call can run side by side.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

__all__ = ["routed"]

_lock = threading.Lock()
_local = threading.local()
# (class or module, name) -> [original, whether the owner defined it itself, depth]
_installed: dict[tuple[Any, str], list[Any]] = {}


def _active() -> dict[tuple[Any, str], list[Callable[..., Any]]]:
    routes = getattr(_local, "routes", None)
    if routes is None:
        routes = _local.routes = {}
    return routes


def _dispatcher(key: tuple[Any, str], original: Any) -> Callable[..., Any]:
    # On a class this is a plain function, so the instance arrives first in ``args``.
    # ``original`` is bound here, not looked up: a caller may still hold this
    # function after the last block has restored the attribute.
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        routes = _active().get(key)
        if not routes:
            return original(*args, **kwargs)
        return routes[-1](original, *args, **kwargs)

    dispatch.__name__ = key[1]
    dispatch.__doc__ = getattr(original, "__doc__", None)
    return dispatch


@contextlib.contextmanager
def routed(owner: Any, name: str, route: Callable[..., Any]) -> Iterator[None]:
    """Inside this block, on this thread, calls of ``owner.name`` go to ``route``:
    for a class, ``instance.name(*a, **k)`` (instances of ``owner`` and of subclasses
    that do not override ``name``) calls ``route(original, instance, *a, **k)``; for a
    module, ``owner.name(*a, **k)`` calls ``route(original, *a, **k)``. Blocks nest;
    the innermost route wins."""
    key = (owner, name)
    with _lock:
        entry = _installed.get(key)
        if entry is None:
            original = getattr(owner, name)
            entry = _installed[key] = [original, name in vars(owner), 0]
            setattr(owner, name, _dispatcher(key, original))
        entry[2] += 1
    routes = _active().setdefault(key, [])
    routes.append(route)
    try:
        yield
    finally:
        routes.pop()
        with _lock:
            entry[2] -= 1
            if entry[2] == 0:
                original, owned, _ = _installed.pop(key)
                if owned:
                    setattr(owner, name, original)
                else:
                    delattr(owner, name)
