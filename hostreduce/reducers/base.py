"""The one interface every reduction engine implements, and the registry of engines.

A reducer all-reduces, broadcasts and all-gathers named numpy arrays that live in host
memory. Collectives are asynchronous: ``allreduce_async`` returns a :class:`Handle`
whose ``wait()`` gives the result. All ranks must submit the same names with the same
shape, dtype and op; engines that can detect a disagreement raise
``TensorMismatchError`` on every rank.

The base class owns the contract every engine shares, so that each engine is written
against checked arguments only: the checks of ``name``, dtype, ``op``, ``out=``,
``root`` and ``timeout``, refusing work once closed, a 0-d all-gather input taken as
one row, and the meaning of ``mean`` (integers: floor division) and of float16 and
bfloat16 in engines that reduce them in float32 (rounded back once). A job always ends:
see ``_job_end.py`` for how live reducers are closed at exit.
"""
from __future__ import annotations

import abc
import enum
import threading
from typing import Any, Callable, ClassVar, TypeVar

import numpy as np

from ..errors import ConfigError, CollectiveTimeoutError, ReducerClosedError
from . import _job_end
from ._job_end import _close_live_at_exit  # noqa: F401 - the exit hook, reached through this module

__all__ = [
    "ReduceOp",
    "Handle",
    "Reducer",
    "register_reducer",
    "create_reducer",
    "available_reducers",
    "SUPPORTED_DTYPES",
    "check_array",
    "check_out",
    "is_low_precision",
    "apply_mean",
]


class ReduceOp(str, enum.Enum):
    SUM = "sum"
    MEAN = "mean"
    MIN = "min"
    MAX = "max"

    @classmethod
    def parse(cls, op: "ReduceOp | str") -> "ReduceOp":
        if isinstance(op, ReduceOp):
            return op
        try:
            return cls(str(op).lower())
        except ValueError:
            raise ConfigError(
                f"`op` must be one of {[o.value for o in cls]}. Received: op={op!r}"
            ) from None


def _supported_dtypes() -> tuple[np.dtype, ...]:
    dtypes = [np.dtype(t) for t in ("float16", "float32", "float64", "int32", "int64")]
    try:  # bfloat16 comes from ml_dtypes (a TensorFlow dependency), when present.
        import ml_dtypes

        dtypes.append(np.dtype(ml_dtypes.bfloat16))
    except ImportError:  # pragma: no cover - ml_dtypes ships with TensorFlow
        pass
    return tuple(dtypes)


SUPPORTED_DTYPES: tuple[np.dtype, ...] = _supported_dtypes()


def check_array(name: Any, array: Any) -> np.ndarray:
    """Validate a collective's arguments; return the array as a numpy array."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"`name` must be a non-empty string. Received: name={name!r}")
    arr = np.asarray(array)
    if arr.dtype not in SUPPORTED_DTYPES:
        raise ConfigError(
            f"Tensor {name!r}: dtype must be one of {[str(d) for d in SUPPORTED_DTYPES]}. "
            f"Received: dtype={arr.dtype}"
        )
    return arr


def check_out(name: str, arr: np.ndarray, out: Any, contiguous: bool = False) -> None:
    """Validate an all-reduce's ``out=``: a writeable array of ``arr``'s shape and dtype
    (and C-contiguous, for engines that write the result through a flat view)."""
    if out is None:
        return
    layout = ", C-contiguous" if contiguous else ""
    if (not isinstance(out, np.ndarray) or out.shape != arr.shape or out.dtype != arr.dtype
            or not out.flags.writeable or (contiguous and not out.flags.c_contiguous)):
        flags = ""
        if isinstance(out, np.ndarray):
            flags = "".join([", read-only" if not out.flags.writeable else "",
                             ", not C-contiguous" if contiguous and not out.flags.c_contiguous else ""])
        raise ConfigError(
            f"Tensor {name!r}: `out` must be a writeable numpy array of shape {arr.shape} and dtype "
            f"{arr.dtype}{layout}. Received: {type(out).__name__} with shape={getattr(out, 'shape', None)}, "
            f"dtype={getattr(out, 'dtype', None)}{flags}"
        )


def is_low_precision(dtype: np.dtype) -> bool:
    """float16 and bfloat16: engines without a reduction for them reduce in float32 and
    round back once, so every rank gets the same, once-rounded result."""
    return (dtype.kind == "f" and dtype.itemsize == 2) or dtype.name == "bfloat16"


def apply_mean(buf: np.ndarray, op: "ReduceOp", size: int) -> None:
    """Turn a sum into a mean in place (floor division for integers)."""
    if op is ReduceOp.MEAN and size > 1 and buf.size:
        if buf.dtype.kind in "iu":
            np.floor_divide(buf, size, out=buf)
        else:
            np.divide(buf, buf.dtype.type(size), out=buf)


class Handle:
    """A collective in flight. ``wait()`` returns its result or raises its error."""

    __slots__ = ("name", "_event", "_result", "_error", "_callbacks", "_lock")

    def __init__(self, name: str) -> None:
        self.name = name
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[["Handle"], None]] = []
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        if not self._event.wait(timeout):
            raise CollectiveTimeoutError(
                f"Collective {self.name!r} did not complete within timeout={timeout} s"
            )
        if self._error is not None:
            raise self._error
        return self._result

    def wait_done(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; whether the collective has finished (no raise)."""
        return self._event.wait(timeout)

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    # Engines complete handles through these two methods.
    def set_result(self, result: Any) -> None:
        self._finish(result, None)

    def set_error(self, error: BaseException) -> None:
        self._finish(None, error)

    def _finish(self, result: Any, error: BaseException | None) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._result, self._error = result, error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)


class Reducer(abc.ABC):
    """Collectives over host-resident numpy arrays.

    ``rank`` and ``size`` describe the job; results are identical on every rank. The
    public methods check their arguments and then call what a subclass implements, with
    a numpy array of a supported dtype, a parsed ``ReduceOp``, a valid ``out`` and
    ``root``: ``_allreduce_async``, ``_broadcast_async``, ``_allgather_async`` (the
    array has at least one dimension), ``_barrier`` and ``_close``. An engine with a
    faster path for a blocking all-reduce overrides ``_allreduce``; one that can tell
    its peers why it stops overrides ``_close_failed``.
    """

    name: ClassVar[str] = ""
    # Whether ``out=`` must be C-contiguous (engines that write through a flat view).
    out_contiguous: ClassVar[bool] = False

    def __init__(self) -> None:
        self._closed = False

    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def size(self) -> int: ...

    def allreduce_async(self, name: str, array: np.ndarray, op: ReduceOp | str = ReduceOp.SUM,
                        out: np.ndarray | None = None) -> Handle:
        """Start an all-reduce of ``array``; the handle's result has its shape and dtype.

        ``out`` (optional) receives the result and may be ``array`` itself (in place).
        Integer ``mean`` rounds toward negative infinity.
        """
        return self._allreduce_async(name, *self._check_allreduce(name, array, op, out))

    def broadcast_async(self, name: str, array: np.ndarray, root: int = 0) -> Handle:
        """Start a broadcast of ``root``'s ``array`` (same shape and dtype everywhere)."""
        self._check_open()
        arr = check_array(name, array)
        return self._broadcast_async(name, arr, self._check_root(root))

    def allgather_async(self, name: str, array: np.ndarray) -> Handle:
        """Start an all-gather: every rank's array concatenated along axis 0 in rank
        order. Arrays must agree in dtype and in every dimension but the first."""
        self._check_open()
        arr = check_array(name, array)
        return self._allgather_async(name, arr.reshape(1) if arr.ndim == 0 else arr)

    def barrier(self, timeout: float | None = None) -> None:
        """Block until every rank has entered the barrier (at most ``timeout`` seconds,
        where the engine bounds it)."""
        self._check_open()
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or timeout <= 0):
            raise ConfigError(f"`timeout` must be a number > 0 or None. Received: timeout={timeout!r}")
        self._barrier(timeout)

    # Blocking conveniences.
    def allreduce(self, name: str, array: np.ndarray, op: ReduceOp | str = ReduceOp.SUM,
                  out: np.ndarray | None = None) -> np.ndarray:
        return self._allreduce(name, *self._check_allreduce(name, array, op, out))

    def broadcast(self, name: str, array: np.ndarray, root: int = 0) -> np.ndarray:
        return self.broadcast_async(name, array, root).wait()

    def allgather(self, name: str, array: np.ndarray) -> np.ndarray:
        return self.allgather_async(name, array).wait()

    # What engines implement, with checked arguments.
    @abc.abstractmethod
    def _allreduce_async(self, name: str, arr: np.ndarray, op: ReduceOp, out: np.ndarray | None) -> Handle: ...

    @abc.abstractmethod
    def _broadcast_async(self, name: str, arr: np.ndarray, root: int) -> Handle: ...

    @abc.abstractmethod
    def _allgather_async(self, name: str, arr: np.ndarray) -> Handle: ...

    @abc.abstractmethod
    def _barrier(self, timeout: float | None) -> None: ...

    @abc.abstractmethod
    def _close(self) -> None: ...

    def _allreduce(self, name: str, arr: np.ndarray, op: ReduceOp, out: np.ndarray | None) -> np.ndarray:
        return self._allreduce_async(name, arr, op, out).wait()

    def close(self) -> None:
        """Release sockets, threads and buffers. Safe to call more than once."""
        if not self._closed:
            self._closed = True
            _job_end.untrack(self)
            self._close()

    def _abort(self, reason: str) -> None:
        """Close after this process failed with ``reason`` (e.g. ``"ValueError: boom"``).

        Engines that can tell their peers override ``_close_failed`` so that every peer
        fails at once with an error naming this rank and ``reason``, instead of
        learning of an orderly goodbye.
        """
        if not self._closed:
            self._closed = True
            _job_end.untrack(self)
            self._close_failed(reason)

    def _close_failed(self, reason: str) -> None:
        self._close()

    def _register_live(self) -> None:
        """Call at the end of a successful ``__init__``: until ``close()``, the reducer is
        closed at interpreter exit (with an abort if the exit is due to an unhandled
        exception), before the interpreter joins any thread that might wait on a peer."""
        _job_end.track(self)

    @staticmethod
    def _peer_failed(error: BaseException) -> None:
        """Engines call this when a peer failed (not when it left in an orderly way): the
        process then exits non-zero even if the script catches the error."""
        _job_end.note_peer_failure(error)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ReducerClosedError(f"The {self.name!r} reducer is closed")

    def _check_allreduce(self, name: str, array: Any, op: ReduceOp | str,
                         out: Any) -> tuple[np.ndarray, ReduceOp, np.ndarray | None]:
        self._check_open()
        arr = check_array(name, array)
        rop = ReduceOp.parse(op)
        check_out(name, arr, out, self.out_contiguous)
        return arr, rop, out

    def _check_root(self, root: Any) -> int:
        if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < self.size:
            raise ConfigError(f"`root` must be an integer in [0, {self.size}). Received: root={root!r}")
        return root

    def __enter__(self) -> "Reducer":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
            self.close()
        else:  # the block failed: peers learn why at once
            self._abort(_job_end.describe_exception(exc))


_R = TypeVar("_R", bound=type)
_REGISTRY: dict[str, Callable[..., Reducer]] = {}


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


def create_reducer(name: str | None = None, cluster: Any = None, config: Any = None, **kwargs: Any) -> Reducer:
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
