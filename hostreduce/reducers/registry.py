"""The registry of reduction engines: ``create_reducer`` by name, the built-in engines
imported on first use so that a job pays only for the engine it runs."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ..errors import ConfigError

if TYPE_CHECKING:
    from .base import Reducer

__all__ = ["register_reducer", "create_reducer", "available_reducers"]

_R = TypeVar("_R", bound=type)
_REGISTRY: dict[str, Callable[..., "Reducer"]] = {}


def register_reducer(name: str) -> Callable[[_R], _R]:
    """Class decorator: make a reducer available to :func:`create_reducer` by ``name``."""

    def deco(cls: _R) -> _R:
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return deco


# Built-in engines, imported on first use so that a job pays only for the engine it runs.
_BUILTIN = {"local": ".local", "ring": ".ring.reducer", "mpi": ".mpi", "horovod": ".horovod"}


def available_reducers() -> tuple[str, ...]:
    return tuple(sorted(set(_REGISTRY) | set(_BUILTIN)))


def create_reducer(name: str | None = None, cluster: Any = None, config: Any = None, **kwargs: Any) -> "Reducer":
    """Create a reducer by registry name (default: ``config.reducer``).

    ``cluster`` is a ``ClusterSpec`` (resolved from the environment when None) and
    ``config`` a ``Config`` (from ``HOSTREDUCE_*`` variables when None).
    """
    from ..config import Config

    config = Config.from_env() if config is None else config
    name = config.reducer if name is None else name
    if name not in _REGISTRY and name in _BUILTIN:
        import importlib

        importlib.import_module(_BUILTIN[name], __package__)  # registers the class
    if name not in _REGISTRY:
        raise ConfigError(f"`reducer` must be one of {list(available_reducers())}. Received: reducer={name!r}")
    return _REGISTRY[name](cluster=cluster, config=config, **kwargs)
