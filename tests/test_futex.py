"""The shared-memory path's wake-ups (hostreduce.reducers.ring._futex)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hostreduce.reducers.ring import _futex

pytestmark = pytest.mark.skipif(not _futex.available(), reason="futex calls are not available on this platform")


def test_wait_returns_at_once_when_the_word_already_changed():
    word = np.zeros(1, np.int64)
    word[0] = 7
    t = time.monotonic()
    _futex.wait(word.ctypes.data, 6, 5.0)
    assert time.monotonic() - t < 1.0


def test_wait_times_out_when_nobody_wakes_it():
    word = np.zeros(1, np.int64)
    t = time.monotonic()
    _futex.wait(word.ctypes.data, 0, 0.05)
    assert 0.04 <= time.monotonic() - t < 2.0


def test_wake_ends_a_wait_long_before_its_timeout():
    word = np.zeros(1, np.int64)
    woke = threading.Event()

    def sleeper() -> None:
        while word[0] == 0:
            _futex.wait(word.ctypes.data, 0, 10.0)
        woke.set()

    th = threading.Thread(target=sleeper, daemon=True)
    th.start()
    time.sleep(0.1)
    t = time.monotonic()
    word[0] = 1
    _futex.wake(word.ctypes.data)
    assert woke.wait(5.0)
    assert time.monotonic() - t < 2.0
    th.join(1.0)
