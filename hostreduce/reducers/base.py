"""The one interface every reduction engine implements, and the registry of engines.

A reducer all-reduces, broadcasts and all-gathers named numpy arrays that live in host
memory. Collectives are asynchronous: ``allreduce_async`` returns a :class:`Handle`
whose ``wait()`` gives the result. All ranks must submit the same names with the same
shape, dtype and op; engines that can detect a disagreement raise
``TensorMismatchError`` on every rank.

A job always ends: a reducer the script never closed is closed at interpreter exit,
before the interpreter joins its threads (with an abort that names the error when the
exit is due to an unhandled exception, so that peers fail at once), and a process
whose peer failed exits non-zero even if the script caught the error.
"""
from __future__ import annotations

import abc
import atexit
import enum
import logging
import os
import sys
import threading
import weakref
from typing import Any, Callable, ClassVar, NoReturn, TypeVar

import numpy as np

from ..errors import ConfigError, CollectiveTimeoutError, ReducerClosedError

__all__ = [
    "ReduceOp",
    "Handle",
    "Reducer",
    "register_reducer",
    "create_reducer",
    "available_reducers",
    "SUPPORTED_DTYPES",
    "check_array",
]

_log = logging.getLogger("hostreduce")


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

    Subclasses implement the ``*_async`` methods, ``barrier`` and ``close``. ``rank``
    and ``size`` describe the job; results are identical on every rank.
    """

    name: ClassVar[str] = ""

    def __init__(self) -> None:
        self._closed = False

    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def size(self) -> int: ...

    @abc.abstractmethod
    def allreduce_async(
        self, name: str, array: np.ndarray, op: ReduceOp | str = ReduceOp.SUM, out: np.ndarray | None = None
    ) -> Handle:
        """Start an all-reduce of ``array``; the handle's result has its shape and dtype.

        ``out`` (optional) receives the result and may be ``array`` itself (in place).
        Integer ``mean`` rounds toward negative infinity.
        """

    @abc.abstractmethod
    def broadcast_async(self, name: str, array: np.ndarray, root: int = 0) -> Handle:
        """Start a broadcast of ``root``'s ``array`` (same shape and dtype everywhere)."""

    @abc.abstractmethod
    def allgather_async(self, name: str, array: np.ndarray) -> Handle:
        """Start an all-gather: every rank's array concatenated along axis 0 in rank
        order. Arrays must agree in dtype and in every dimension but the first."""

    @abc.abstractmethod
    def barrier(self, timeout: float | None = None) -> None:
        """Block until every rank has entered the barrier."""

    @abc.abstractmethod
    def _close(self) -> None: ...

    # Blocking conveniences.
    def allreduce(self, name: str, array: np.ndarray, op: ReduceOp | str = ReduceOp.SUM,
                  out: np.ndarray | None = None) -> np.ndarray:
        return self.allreduce_async(name, array, op, out).wait()

    def broadcast(self, name: str, array: np.ndarray, root: int = 0) -> np.ndarray:
        return self.broadcast_async(name, array, root).wait()

    def allgather(self, name: str, array: np.ndarray) -> np.ndarray:
        return self.allgather_async(name, array).wait()

    def close(self) -> None:
        """Release sockets, threads and buffers. Safe to call more than once."""
        if not self._closed:
            self._closed = True
            _LIVE.discard(self)
            self._close()

    def _abort(self, reason: str) -> None:
        """Close after this process failed with ``reason`` (e.g. ``"ValueError: boom"``).

        Engines that can tell their peers override ``_close_failed`` so that every peer
        fails at once with an error naming this rank and ``reason``, instead of
        learning of an orderly goodbye.
        """
        if not self._closed:
            self._closed = True
            _LIVE.discard(self)
            self._close_failed(reason)

    def _close_failed(self, reason: str) -> None:
        self._close()

    def _register_live(self) -> None:
        """Call at the end of a successful ``__init__``: until ``close()``, the reducer is
        closed at interpreter exit (with an abort if the exit is due to an unhandled
        exception), before the interpreter joins any thread that might wait on a peer."""
        _install_exit_hooks()
        _LIVE.add(self)

    @staticmethod
    def _peer_failed(error: BaseException) -> None:
        """Engines call this when a peer failed (not when it left in an orderly way): the
        process then exits non-zero even if the script catches the error."""
        _note_peer_failure(error)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ReducerClosedError(f"The {self.name!r} reducer is closed")

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
            self._abort(describe_exception(exc))


def describe_exception(exc: BaseException) -> str:
    """``"ValueError: boom"``: how peers are told why a rank failed."""
    text = str(exc)
    name = type(exc).__name__
    return f"{name}: {text[:500]}" if text else name


# --------------------------------------------------------------------------- exit
# Every reducer between a successful start and close() is in _LIVE. At interpreter exit
# they are closed by a hook that runs before the interpreter joins its threads: gRPC's
# server threads (a concurrent.futures pool, which the interpreter joins at exit) may be
# waiting on a peer that is itself exiting, so without the hook two workers that never
# call close() would wait for each other forever.
_LIVE: "weakref.WeakSet[Reducer]" = weakref.WeakSet()
_JOB_ABORTS: list[Callable[[str], None]] = []
_hooks_lock = threading.Lock()
_hooks_installed = False
_peer_failure: BaseException | None = None


def _install_exit_hooks() -> None:
    global _hooks_installed
    with _hooks_lock:
        if _hooks_installed:
            return
        _hooks_installed = True
        # concurrent.futures registers the join of its pools when its thread module is
        # imported; threading's exit hooks run in reverse order of registration, so
        # importing it first puts ours ahead of that join.
        import concurrent.futures.thread  # noqa: F401

        register = getattr(threading, "_register_atexit", None)
        try:
            if register is None:
                raise RuntimeError("threading._register_atexit is not available")
            register(_close_live_at_exit)
        except RuntimeError:  # already shutting down, or an interpreter without the hook
            atexit.register(_close_live_at_exit)
        # atexit runs handlers in reverse order of registration: this one, registered
        # when the first reducer starts, runs before those of the libraries loaded
        # earlier and, after a peer failed, ends the process without them (they, and
        # MPI_Finalize, might wait for the failed peer).
        atexit.register(_exit_status_after_peer_failure)


def add_job_abort(fn: Callable[[str], None]) -> None:
    """Run ``fn(reason)`` when the interpreter exits with an unhandled exception, after
    every live reducer was aborted (``mpi`` uses it to call ``MPI_Abort``)."""
    _install_exit_hooks()
    with _hooks_lock:
        if fn not in _JOB_ABORTS:
            _JOB_ABORTS.append(fn)


def _note_peer_failure(error: BaseException) -> None:
    global _peer_failure
    if _peer_failure is None:
        _peer_failure = error


def _close_live_at_exit() -> None:
    # Python sets sys.last_value for an unhandled exception before the exit hooks run.
    error = getattr(sys, "last_value", None)
    reason = None if error is None else describe_exception(error)
    for reducer in list(_LIVE):
        try:
            if reason is None:
                reducer.close()
            else:
                reducer._abort(reason)
        except Exception as exc:  # noqa: BLE001 - best effort at exit; go on with the others
            _log.warning("closing the %r reducer at exit failed: %s: %s", reducer.name, type(exc).__name__, exc)
    if reason is not None:
        for fn in list(_JOB_ABORTS):
            fn(reason)


def _exit_status_after_peer_failure() -> None:
    # A script that caught the PeerLostError of a failed peer would otherwise exit 0,
    # and the job would look successful. An unhandled exception already exits non-zero.
    if _peer_failure is None or getattr(sys, "last_value", None) is not None:
        return
    _log.error("exiting with status 1: a peer failed (%s)", _peer_failure)
    logging.shutdown()
    exit_at_once(1)


def flush_std_streams() -> None:
    """Flush stdout and stderr, so that a traceback or message printed just before a
    hard stop (``os._exit``, ``MPI_Abort``) is not lost. Best effort."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or replaced stream
            pass


def exit_at_once(status: int) -> NoReturn:
    """End the process now with ``status``, skipping the remaining exit handlers and the
    join of threads that may wait on a failed peer; stdout and stderr are flushed first."""
    flush_std_streams()
    os._exit(status)


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
