"""How a job ends: every live reducer is closed at interpreter exit, and a failure
anywhere stops every rank.

A reducer the script never closed is closed at interpreter exit, before the interpreter
joins its threads (with an abort that names the error when the exit is due to an
unhandled exception, so that peers fail at once), and a process whose peer failed exits
non-zero even if the script caught the error. Engines that can stop a whole job at once
(``MPI_Abort``) register that with :func:`add_job_abort`.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from typing import Callable, NoReturn, Protocol

__all__ = ["describe_exception", "track", "untrack", "note_peer_failure", "survive_peer_failures", "add_job_abort", "add_clean_exit_hook",
           "flush_std_streams", "exit_at_once"]

_log = logging.getLogger("hostreduce")


class LiveReducer(Protocol):
    """What the exit hook needs of a reducer (``base.Reducer`` is one)."""

    name: str

    def close(self) -> None: ...

    def _abort(self, reason: str) -> None: ...


def describe_exception(exc: BaseException) -> str:
    """``"ValueError: boom"``: how peers are told why a rank failed."""
    text = str(exc)
    name = type(exc).__name__
    return f"{name}: {text[:500]}" if text else name


# Every reducer between a successful start and close() is in _LIVE. At interpreter exit
# they are closed by a hook that runs before the interpreter joins its threads: gRPC's
# server threads (a concurrent.futures pool, which the interpreter joins at exit) may be
# waiting on a peer that is itself exiting, so without the hook two workers that never
# call close() would wait for each other forever.
_LIVE: "weakref.WeakSet[LiveReducer]" = weakref.WeakSet()
_JOB_ABORTS: list[Callable[[str], None]] = []
_CLEAN_EXIT_HOOKS: list[Callable[[], None]] = []
_hooks_lock = threading.Lock()
_hooks_installed = False
_peer_failure: BaseException | None = None
_survive_peer_failures = False


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


def track(reducer: LiveReducer) -> None:
    """Close ``reducer`` at interpreter exit unless it is closed before (``untrack``)."""
    _install_exit_hooks()
    _LIVE.add(reducer)


def untrack(reducer: LiveReducer) -> None:
    _LIVE.discard(reducer)


def add_job_abort(fn: Callable[[str], None]) -> None:
    """Run ``fn(reason)`` when the interpreter exits with an unhandled exception, after
    every live reducer was aborted (``mpi`` uses it to call ``MPI_Abort``)."""
    _install_exit_hooks()
    with _hooks_lock:
        if fn not in _JOB_ABORTS:
            _JOB_ABORTS.append(fn)


def add_clean_exit_hook(fn: Callable[[], None]) -> None:
    """Run ``fn()`` at interpreter exit before the live reducers are closed, unless the
    exit is due to an unhandled exception (then the reducers abort the job at once).
    The faces close their job's engine this way (``hostreduce.ops.job``)."""
    _install_exit_hooks()
    with _hooks_lock:
        if fn not in _CLEAN_EXIT_HOOKS:
            _CLEAN_EXIT_HOOKS.append(fn)


def note_peer_failure(error: BaseException) -> None:
    """A peer failed: the process exits non-zero even if the script catches the error
    (unless this is an elastic job's worker, which goes on without the peer)."""
    global _peer_failure
    if _peer_failure is None and not _survive_peer_failures:
        _peer_failure = error


def survive_peer_failures() -> None:
    """This process is a worker of an elastic job: a failed peer ends the epoch, not the
    process (``hostreduce.horovod.elastic`` resets to the last commit)."""
    global _survive_peer_failures, _peer_failure
    _survive_peer_failures, _peer_failure = True, None


def _close_live_at_exit() -> None:
    # Python sets sys.last_value for an unhandled exception before the exit hooks run.
    error = getattr(sys, "last_value", None)
    reason = None if error is None else describe_exception(error)
    if reason is None:
        for hook in list(_CLEAN_EXIT_HOOKS):
            try:
                hook()
            except Exception as exc:  # noqa: BLE001 - best effort at exit; the reducers still close
                _log.warning("an exit hook failed: %s: %s", type(exc).__name__, exc)
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


