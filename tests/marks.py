"""Events between the processes of a test on one host, as files in a directory they
share: :func:`mark` records that something happened, :func:`wait_for_marks` waits until
given things have happened, and gives up with ``TimeoutError`` rather than hang."""
from __future__ import annotations

import os
import time
from typing import Iterable


def mark(directory: str, name: str) -> None:
    """Record the event ``name`` (a file that exists from now on)."""
    open(os.path.join(directory, name), "a").close()


def wait_for_marks(directory: str, names: Iterable[str], timeout: float = 60.0) -> None:
    """Wait until every event of ``names`` is recorded; ``TimeoutError`` after ``timeout``
    seconds (a hang guard: the events are expected long before)."""
    missing = list(names)
    deadline = time.monotonic() + timeout
    while True:
        missing = [n for n in missing if not os.path.exists(os.path.join(directory, n))]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"events {missing} did not happen within {timeout:g} s (no such files in {directory})")
        time.sleep(0.005)


def wait_for_absence(directory: str, name: str, timeout: float = 60.0) -> None:
    """Wait while the event ``name`` is recorded (a test holds the process there);
    ``TimeoutError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while os.path.exists(os.path.join(directory, name)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} in {directory} was not removed within {timeout:g} s")
        time.sleep(0.005)
