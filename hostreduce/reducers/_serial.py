"""One thread that runs an engine's collectives one at a time, in submission order.

MPI (initialized at ``MPI_THREAD_SERIALIZED``) and Horovod's eager ops (which key
concurrent ops by their type, not by the name given) both need their collectives issued
from a single thread, in the order every rank submitted them: the engines match
collectives by position, so a second thread could only reorder them.

Each collective runs under a deadline (``config.timeout_s`` by default). An engine whose
calls can be polled (MPI's ``Test``) checks the deadline itself and raises
``Deadline.error()``; for one whose calls block (Horovod) the worker's watchdog fails
the collective when the deadline passes. Neither library can cancel an operation, so a
timeout, or an error the engine calls fatal, leaves the engine unusable: everything
pending fails at once, and every later collective fails on submission, naming the
first failure.

A point-to-point transfer must not hold up what is queued behind it (two ranks that
each send before they receive would wait on each other): its task starts the transfer
and returns a :class:`Later`, which the worker drives between tasks and while idle, in
the order the transfers were started, under the same deadline. While one is in flight,
the worker waits for new work in timed waits of at most 1 ms on a ``queue.Queue``; not
on a ``queue.SimpleQueue``, whose ``get`` with a timeout of microseconds can wait for
the next ``put`` instead when the thread is descheduled inside it (CPython 3.11): the
transfers then stopped being driven, and every rank waiting for one hung.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

from ..errors import CollectiveTimeoutError, HostReduceError, ReducerClosedError
from .base import Handle

__all__ = ["Deadline", "Later", "SerialWorker"]

_log = logging.getLogger("hostreduce.reducers")

# Turns a task's exception into the error its handle gets, and whether it makes the
# engine unusable.
Translate = Callable[[str, BaseException], "tuple[BaseException, bool]"]


def _as_is(name: str, exc: BaseException) -> tuple[BaseException, bool]:
    return exc, False


class Deadline:
    """When the running collective must have finished."""

    __slots__ = ("name", "at", "timeout_s", "_describe")

    def __init__(self, name: str, timeout_s: float, describe: Callable[[str, float], str]) -> None:
        self.name, self.timeout_s, self._describe = name, timeout_s, describe
        self.at = time.monotonic() + timeout_s

    def passed(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) > self.at

    def error(self) -> CollectiveTimeoutError:
        return CollectiveTimeoutError(self._describe(self.name, self.timeout_s))


class Later:
    """A collective that its task started and that finishes later (returned by the task).

    ``test()`` advances it and says whether it has finished; it raises what the
    collective fails with. ``result()`` is then the handle's result. Both run on the
    worker thread only.
    """

    def test(self) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def result(self) -> Any:
        return None


class SerialWorker:
    """Runs ``task(deadline)`` of each submitted collective on one thread, in order.

    Args:
        engine: the reducer's registry name, for messages.
        rank: this process's rank, for messages.
        timeout_s: the default deadline of a collective.
        translate: maps a task's exception to the handle's error and whether the
            engine is unusable afterwards (a ``CollectiveTimeoutError`` always is).
        watch: fail a collective whose deadline passed from a watchdog thread (for
            engines whose calls cannot be polled).
        on_stop: called on the worker thread when it stops, with whether the engine
            is still usable (to release what only that thread may touch).
    """

    def __init__(self, engine: str, rank: int, timeout_s: float, *, translate: Translate = _as_is,
                 watch: bool = False, on_stop: Callable[[bool], None] | None = None) -> None:
        self._engine, self._rank, self._timeout = engine, rank, float(timeout_s)
        self._translate = translate
        self._on_stop = on_stop
        # Not a SimpleQueue: its get() may overrun a timeout of microseconds indefinitely.
        self._queue: "queue.Queue[tuple[Handle, Callable[[Deadline], Any], float] | None]" = queue.Queue()
        self._lock = threading.Lock()
        self._pending: set[Handle] = set()
        self._running: tuple[Handle, Deadline] | None = None
        # Started collectives still in flight (worker thread only), oldest first.
        self._later: list[tuple[Handle, Later, Deadline]] = []
        self._broken: BaseException | None = None
        self._closing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hostreduce-{engine}-rank{rank}", daemon=True)
        self._thread.start()
        self._watchdog: threading.Thread | None = None
        if watch:
            self._watchdog = threading.Thread(target=self._watch, name=f"hostreduce-{engine}-watchdog", daemon=True)
            self._watchdog.start()

    @property
    def broken(self) -> BaseException | None:
        """The failure that left the engine unusable, if any."""
        return self._broken

    def timeout_text(self, name: str, timeout_s: float) -> str:
        return (f"Collective {name!r} did not complete within timeout_s={timeout_s} s on rank {self._rank}. "
                f"Every rank must submit the same collectives in the same order; the {self._engine!r} reducer "
                "cannot be used after a timeout.")

    def submit(self, name: str, task: Callable[[Deadline], Any], timeout: float | None = None) -> Handle:
        """Queue ``task``; its handle gets what it returns or the error it raises."""
        handle = Handle(name)
        with self._lock:
            if self._closing:
                raise ReducerClosedError(f"The {self._engine!r} reducer is closed")
            if self._broken is not None:
                handle.set_error(self._unusable(name))
                return handle
            self._pending.add(handle)
            self._queue.put((handle, task, float(timeout or self._timeout)))
        handle.add_done_callback(self._forget)
        return handle

    def close(self, wait_s: float) -> None:
        """Stop after the queued collectives (waiting up to ``wait_s`` seconds for the
        thread); whatever is still pending then fails as closed."""
        with self._lock:
            self._closing = True
            self._queue.put(None)
        self._thread.join(wait_s)
        self._stop.set()
        if self._thread.is_alive() and wait_s > 1.0:  # pragma: no cover - stuck past its deadline
            _log.warning("The %r reducer's worker thread did not stop within %.0f s", self._engine, wait_s)
        self._fail_pending(ReducerClosedError(f"The {self._engine!r} reducer is closed"))

    # ------------------------------------------------------------------ machinery
    def _unusable(self, name: str) -> HostReduceError:
        return HostReduceError(
            f"Collective {name!r} not started: the {self._engine!r} reducer is unusable after an earlier failure: "
            f"{self._broken}"
        )

    def _forget(self, handle: Handle) -> None:
        with self._lock:
            self._pending.discard(handle)

    def _fail_pending(self, error: BaseException) -> None:
        with self._lock:
            victims = list(self._pending)
        for handle in victims:
            handle.set_error(error)

    def _break(self, error: BaseException, victim: Handle) -> None:
        """The engine is unusable: ``victim`` fails with ``error``, the rest as unusable."""
        with self._lock:
            if self._broken is None:
                self._broken = error
            victims = list(self._pending)
        victim.set_error(error)
        for handle in victims:
            handle.set_error(self._unusable(handle.name))

    def _next(self) -> "tuple[Handle, Callable[[Deadline], Any], float] | None":
        """The next job, driving the collectives in flight while there is none."""
        sleep = 1e-5
        while True:
            self._progress()
            if not self._later:
                return self._queue.get()
            try:
                return self._queue.get(timeout=sleep)
            except queue.Empty:
                sleep = min(sleep * 2, 1e-3)

    def _progress(self) -> None:
        """Advance every collective in flight; complete those that finished."""
        still = []
        for handle, later, deadline in self._later:
            if handle.done():  # failed meanwhile (the engine broke, or closed)
                continue
            try:
                if later.test():
                    handle.set_result(later.result())
                    continue
                if deadline.passed():
                    raise deadline.error()
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
                self._fail(handle, exc)
                continue
            still.append((handle, later, deadline))
        self._later = still

    def _fail(self, handle: Handle, exc: BaseException) -> None:
        error, fatal = self._translate(handle.name, exc)
        if fatal or isinstance(exc, CollectiveTimeoutError):
            self._break(error, handle)
        else:
            handle.set_error(error)

    def _run(self) -> None:
        while True:
            job = self._next()
            if job is None:
                break
            handle, task, timeout = job
            if handle.done():  # failed meanwhile (the engine broke)
                continue
            deadline = Deadline(handle.name, timeout, self.timeout_text)
            with self._lock:
                unusable = self._broken is not None
                if not unusable:
                    self._running = (handle, deadline)
            if unusable:
                handle.set_error(self._unusable(handle.name))
                continue
            try:
                result = task(deadline)
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
                self._fail(handle, exc)
            else:
                if isinstance(result, Later):
                    self._later.append((handle, result, deadline))
                else:
                    handle.set_result(result)
            finally:
                with self._lock:
                    self._running = None
        while self._later and not self._stop.is_set():  # transfers started before close()
            self._progress()
            time.sleep(1e-4)
        while True:  # anything that raced with close()
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].set_error(ReducerClosedError(f"The {self._engine!r} reducer is closed"))
        if self._on_stop is not None:
            self._on_stop(self._broken is None)

    def _watch(self) -> None:
        interval = min(0.5, self._timeout / 4)
        while not self._stop.wait(interval):
            with self._lock:
                running = self._running
            if running is not None and running[1].passed():
                self._break(running[1].error(), running[0])
