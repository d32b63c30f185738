"""Method routing for classes hostreduce does not own (optimizers of TensorFlow and
Keras), active only inside a ``with`` block on the calling thread.

The class attribute is replaced once while any thread is inside a block for it and
restored when the last one leaves; the replacement sends every call made outside a
block (other threads, user code after training) to the original method unchanged, so
a routed call and a plain call can run side by side.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

__all__ = ["routed_method"]

_lock = threading.Lock()
_local = threading.local()
# (class, method name) -> [original function, whether the class defined it itself, depth]
_installed: dict[tuple[type, str], list[Any]] = {}


def _active() -> dict[tuple[type, str], list[Callable[..., Any]]]:
    routes = getattr(_local, "routes", None)
    if routes is None:
        routes = _local.routes = {}
    return routes


def _dispatcher(key: tuple[type, str]) -> Callable[..., Any]:
    def dispatch(self: Any, *args: Any, **kwargs: Any) -> Any:
        original = _installed[key][0]
        routes = _active().get(key)
        if not routes:
            return original(self, *args, **kwargs)
        return routes[-1](original, self, *args, **kwargs)

    dispatch.__name__ = key[1]
    dispatch.__doc__ = getattr(_installed[key][0], "__doc__", None)
    return dispatch


@contextlib.contextmanager
def routed_method(cls: type, name: str, route: Callable[..., Any]) -> Iterator[None]:
    """Inside this block, on this thread, ``instance.name(*a, **k)`` for instances of
    ``cls`` (and subclasses that do not override ``name``) calls
    ``route(original, instance, *a, **k)``. Blocks nest; the innermost route wins."""
    key = (cls, name)
    with _lock:
        entry = _installed.get(key)
        if entry is None:
            entry = _installed[key] = [getattr(cls, name), name in cls.__dict__, 0]
            setattr(cls, name, _dispatcher(key))
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
                    setattr(cls, name, original)
                else:
                    delattr(cls, name)
