"""The engines' serial worker (``hostreduce/reducers/_serial.py``): started transfers
(``Later``) are driven to completion, or to their deadline, with nothing else queued."""
from __future__ import annotations

import time

import pytest

from hostreduce.errors import CollectiveTimeoutError, HostReduceError
from hostreduce.reducers._serial import Later, SerialWorker


class _AfterPolls(Later):
    """Finishes on its ``polls``-th test()."""

    def __init__(self, polls: int) -> None:
        self.left = polls

    def test(self) -> bool:
        self.left -= 1
        return self.left <= 0

    def result(self) -> str:
        return "done"


class _Never(Later):
    def test(self) -> bool:
        return False


def test_later_finishes_with_nothing_queued_behind_it() -> None:
    """What the MPI send/receive checks wait on: each transfer must finish while the
    worker idles between short timed waits for new work (on a queue.SimpleQueue such a
    wait could last until the next submission when its thread was descheduled)."""
    worker = SerialWorker("test", 0, timeout_s=10.0)
    try:
        for i in range(300):
            handle = worker.submit(f"t{i}", lambda _, n=1 + i % 5: _AfterPolls(n))
            assert handle.wait(5.0) == "done"
    finally:
        worker.close(5.0)


def _past_its_deadline() -> float:
    """The test below; returns how long the stuck transfer took to fail."""
    worker = SerialWorker("test", 0, timeout_s=0.2)
    try:
        start = time.monotonic()
        handle = worker.submit("stuck", lambda _: _Never())
        # The worker's own deadline ("timeout_s=0.2"), not the end of this wait, fails it.
        with pytest.raises(CollectiveTimeoutError, match="timeout_s=0.2"):
            handle.wait(30.0)
        took = time.monotonic() - start
        with pytest.raises(HostReduceError, match="unusable"):
            worker.submit("after", lambda _: 1).wait(5.0)
        return took
    finally:
        worker.close(1.0)


def test_later_past_its_deadline_fails_and_breaks_the_worker() -> None:
    _past_its_deadline()


@pytest.mark.perf
def test_later_past_its_deadline_fails_within_seconds() -> None:
    assert _past_its_deadline() < 3.0
