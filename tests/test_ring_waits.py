"""How a rank's shared-memory waits choose to poll before they sleep (``SpinPolicy``)."""
from __future__ import annotations

import os

import pytest

from hostreduce.reducers.ring import shm_sync
from hostreduce.reducers.ring.shm_sync import SpinPolicy

CORES = len(os.sched_getaffinity(0))
WINDOW = shm_sync._SPIN_S
ROUND = SpinPolicy._ROUND


def _waits(policy: SpinPolicy, count: int, sleeping: int) -> list[float]:
    """``count`` waits that got past their first yields, the first ``sleeping`` of them
    outlasting the window (they sleep if they polled); each wait's polling window."""
    windows = []
    for i in range(count):
        window = policy.started()
        if window and i < sleeping:
            policy.slept()
        windows.append(window)
    return windows


@pytest.mark.skipif(CORES < 2, reason="one core: no job has a core to spare")
def test_with_a_core_to_spare_waits_always_poll():
    policy = SpinPolicy(CORES - 1)
    assert not policy.adaptive
    assert _waits(policy, 4 * ROUND, sleeping=4 * ROUND) == [WINDOW] * 4 * ROUND


def test_without_a_spare_core_polling_follows_what_it_gains():
    policy = SpinPolicy(CORES)
    assert policy.adaptive
    # Waits that mostly end while polling keep it on.
    assert _waits(policy, 3 * ROUND, sleeping=ROUND // 4) == [WINDOW] * 3 * ROUND
    # A round in which most waits slept all the same turns it off for a round's worth of waits...
    assert _waits(policy, ROUND, sleeping=ROUND // 2 + 1) == [WINDOW] * ROUND
    assert _waits(policy, ROUND, sleeping=ROUND) == [0.0] * ROUND
    # ... then it is tried for a round again; each failed try doubles the pause.
    assert _waits(policy, ROUND, sleeping=ROUND) == [WINDOW] * ROUND
    assert _waits(policy, 2 * ROUND, sleeping=2 * ROUND) == [0.0] * 2 * ROUND
    # A try that pays keeps it on, and the next pause is short again.
    assert _waits(policy, 3 * ROUND, sleeping=0) == [WINDOW] * 3 * ROUND
    assert _waits(policy, ROUND, sleeping=ROUND) == [WINDOW] * ROUND
    assert _waits(policy, ROUND + 1, sleeping=ROUND + 1) == [0.0] * ROUND + [WINDOW]


def test_the_pause_stops_doubling_at_its_limit():
    policy = SpinPolicy(CORES)
    assert _waits(policy, ROUND, sleeping=ROUND) == [WINDOW] * ROUND
    pauses = []
    for _ in range(10):
        pause = 0
        while policy.started() == 0.0:   # the pause; the wait after it polls, and sleeps
            pause += 1
        policy.slept()
        pauses.append(pause)
        assert _waits(policy, ROUND - 1, sleeping=ROUND) == [WINDOW] * (ROUND - 1)   # the rest of the try
    assert pauses[:3] == [ROUND, 2 * ROUND, 4 * ROUND]
    assert max(pauses) == pauses[-1] == SpinPolicy._OFF_MAX
