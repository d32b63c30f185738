"""The threads that carry a worker's calls to the ps: each runs blocking gRPC calls, one
at a time, so that the calls of one fan-out (one per ps) are in flight at once.

Why not gRPC's futures: a ``future()`` call is handled by a channel thread that gRPC
starts whenever the channel has no call in flight, which is every call of a training
step, and each call then contends with that thread for the channel's lock. Measured
on the benchmark's workers: 1-2 ms of the caller's time per call, several calls per
step; a blocking call on a thread that is already running costs a fraction of that.

A call that is abandoned (the caller gave up on its fan-out because another ps failed)
keeps its thread until gRPC ends it at its deadline; a later call then starts another
thread rather than waiting, so one hung ps never delays the calls to the others. The
threads are daemons: a call still blocked at the process's exit does not hold it.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable

__all__ = ["CallThreads"]

Done = Callable[[Any, BaseException | None], None]


class CallThreads:
    """Runs ``fn(*args)`` on a free thread, then ``done(result, error)`` there."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._free = 0       # threads waiting for a task
        self._pending = 0    # tasks not yet taken by a thread
        self._count = 0

    def submit(self, fn: Callable[..., Any], args: tuple, done: Done) -> None:
        with self._lock:
            self._pending += 1
            if self._pending > self._free:  # every thread is busy: one more
                self._count += 1
                threading.Thread(target=self._loop, daemon=True, name=f"{self._name}-{self._count}").start()
        self._tasks.put((fn, args, done))

    def close(self) -> None:
        """End the idle threads (a busy one ends after its call)."""
        with self._lock:
            count, self._count = self._count, 0
        for _ in range(count):
            self._tasks.put(None)

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._free += 1
            task = self._tasks.get()
            with self._lock:
                self._free -= 1
                if task is not None:
                    self._pending -= 1
            if task is None:
                return
            fn, args, done = task
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                done(None, e)
            else:
                done(result, None)
