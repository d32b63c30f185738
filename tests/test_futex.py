"""The shared-memory path's wake-ups (hostreduce.reducers.ring._futex). The waits here
last an hour unless what is tested ends them; each is joined with a hang guard far
shorter than that. How soon they end is checked by the ``perf`` tests."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hostreduce.reducers.ring import _futex

pytestmark = pytest.mark.skipif(not _futex.available(), reason="futex calls are not available on this platform")

HOUR = 3600.0
HANG_GUARD_S = 30.0


def _wait_in_thread(word: np.ndarray, expected: int, timeout_s: float) -> threading.Thread:
    th = threading.Thread(target=_futex.wait, args=(word.ctypes.data, expected, timeout_s), daemon=True)
    th.start()
    return th


def _sleeping_in_futex_wait(thread: threading.Thread, addr: int) -> bool | None:
    """Whether ``thread`` is in the futex call on ``addr`` now (its current system call
    in /proc); None where /proc does not tell."""
    try:
        with open(f"/proc/self/task/{thread.native_id}/syscall") as f:
            fields = f.read().split()
    except OSError:
        return None
    return len(fields) > 1 and fields[0] == str(_futex._SYS_FUTEX) and int(fields[1], 16) == addr


def test_wait_returns_at_once_when_the_word_already_changed():
    word = np.zeros(1, np.int64)
    word[0] = 7
    th = _wait_in_thread(word, 6, HOUR)
    th.join(HANG_GUARD_S)
    assert not th.is_alive(), "the wait for a word that already changed did not return"


@pytest.mark.perf
def test_wait_returns_within_a_second_when_the_word_already_changed():
    word = np.zeros(1, np.int64)
    word[0] = 7
    t = time.monotonic()
    _futex.wait(word.ctypes.data, 6, 5.0)
    assert time.monotonic() - t < 1.0


def test_wait_times_out_when_nobody_wakes_it():
    word = np.zeros(1, np.int64)
    th = _wait_in_thread(word, 0, 0.05)
    th.join(HANG_GUARD_S)
    assert not th.is_alive(), "the wait did not end at its timeout"


@pytest.mark.perf
def test_wait_lasts_its_timeout_when_nobody_wakes_it():
    word = np.zeros(1, np.int64)
    t = time.monotonic()
    _futex.wait(word.ctypes.data, 0, 0.05)
    assert 0.04 <= time.monotonic() - t < 2.0


def _woken(timeout_s: float) -> float:
    """A thread waits (``timeout_s``) until the word changes; once it sleeps in the
    kernel, the word changes and the thread is woken. Returns how long it took to wake."""
    word = np.zeros(1, np.int64)
    woke = threading.Event()

    def sleeper() -> None:
        while word[0] == 0:
            _futex.wait(word.ctypes.data, 0, timeout_s)
        woke.set()

    th = threading.Thread(target=sleeper, daemon=True)
    th.start()
    deadline = time.monotonic() + HANG_GUARD_S
    while not _sleeping_in_futex_wait(th, word.ctypes.data):  # the wake must find it asleep
        if _sleeping_in_futex_wait(th, word.ctypes.data) is None:
            break  # /proc cannot tell: the wake may come before the wait (which then returns at once)
        assert time.monotonic() < deadline, "the thread never went to sleep in the futex call"
        time.sleep(0.001)
    t = time.monotonic()
    word[0] = 1
    _futex.wake(word.ctypes.data)
    assert woke.wait(HANG_GUARD_S), "the wake did not end the wait"
    took = time.monotonic() - t
    th.join(HANG_GUARD_S)
    return took


def test_wake_ends_a_wait_long_before_its_timeout():
    _woken(HOUR)


@pytest.mark.perf
def test_wake_ends_a_wait_within_a_second_or_two():
    assert _woken(10.0) < 2.0
