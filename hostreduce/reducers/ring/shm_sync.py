"""One host: named shared-memory segments, and the control segment's per-rank counters
that ranks post and wait for.

The control segment holds one 64-byte line per rank for each counter (barrier, the data
path's progress, the fast lane's words), so ranks never write to the same cache line.
A rank posts a counter with a plain store and then rings its "bell" word; a rank waiting
for peers yields the CPU a few times, then for up to 1 ms more when the host has a core
to spare beyond one per rank or when such polling has paid in this job's recent waits
(waking a sleeping process costs more than that wait, in a virtual machine above all;
see :class:`SpinPolicy`), then sleeps in the kernel on the bell of the first late rank (``_futex.py``), or, without futexes, in
sleeps that double up to 1 ms. A wait gives up on the job's failure or after the
timeout, naming the late ranks, or the peer that stopped answering if one has (the
likely cause, whatever the wait was for).

Segment names are derived from a per-job random token; files are created with mode
0600 and unlinked as soon as every rank has mapped them (``_stale.py`` removes what a
killed rank leaves behind).
"""
from __future__ import annotations

import mmap
import os
import sys
import time
from typing import Callable

import numpy as np

from ...errors import PeerLostError
from . import _futex

__all__ = ["Segment", "ControlBlock", "Waiter", "SpinPolicy", "spin_window_s"]

_DIR = "/dev/shm"
_ALIGN = 64
_SPIN_S = 1e-3     # yield the CPU this long before sleeping, when a core is spare
_FUTEX_SLICE_S = 0.05   # longest single sleep: failures and the timeout are checked between


def spin_window_s(ranks: int) -> float:
    """How long a waiting thread of a job with ``ranks`` ranks on this host polls before
    it sleeps, whatever the job: ``_SPIN_S`` when the host has more cores than ranks,
    else 0 (the local control reader; the shared-memory waits then ask
    :class:`SpinPolicy`).

    Polling surely pays only on a core nobody else needs. With one rank per core, the
    rank's own compute (TensorFlow's threads running the backward pass that the
    reduction overlaps) or a peer may need every core: measured with Keras ``fit`` of a
    small model at 2 ranks on 2 cores, polling took about 5 ms of CPU per step from the
    backward pass and made steps 1.4-2x longer on a busy machine, for about 7 % shorter
    steps on an idle one."""
    return _SPIN_S if ranks < len(os.sched_getaffinity(0)) else 0.0


class SpinPolicy:
    """Whether this rank's shared-memory waits poll (yield the CPU, up to ``_SPIN_S``)
    before they sleep in the kernel.

    With a core to spare beyond one per rank they always do (:func:`spin_window_s`).
    Without one it depends on the job, so the waits measure it: polling pays where the
    awaited peer usually arrives within the window (a step that is mostly host work, as
    the Estimator's with the optimizer on the host: about 1.25x the steps of the MNIST
    example on 2 cores), and it costs where the wait outlasts the window anyway, since
    the poll takes CPU from the rank's own compute (Keras ``fit`` of a small model:
    steps 1.4-2x longer on a busy machine). Waits poll in rounds of ``_ROUND`` waits that
    got past their first yields; a round in which most of them still had to sleep turns
    polling off for ``_ROUND`` waits, doubling up to ``_OFF_MAX`` while rounds keep
    failing, then polls one round again to see if the job changed. Counts are per rank
    and approximate under concurrent waits, which is all a heuristic needs."""

    __slots__ = ("adaptive", "window_s", "_waits", "_slept", "_off", "_off_next")

    _ROUND = 32
    _OFF_MAX = 4096

    def __init__(self, ranks: int) -> None:
        always = spin_window_s(ranks) > 0
        self.adaptive = not always
        self.window_s = _SPIN_S     # polling now (0: off)
        self._waits = self._slept = 0
        self._off = 0               # waits left before polling is tried again
        self._off_next = self._ROUND

    def started(self) -> float:
        """A wait got past its first yields; returns how long it may poll."""
        if not self.adaptive:
            return self.window_s
        if self.window_s and self._waits >= self._ROUND:
            self._judge()
        if not self.window_s:
            if self._off > 0:
                self._off -= 1
                return 0.0
            self.window_s, self._waits, self._slept = _SPIN_S, 0, 0
        self._waits += 1
        return self.window_s

    def slept(self) -> None:
        """A wait that polled had to sleep all the same."""
        if self.adaptive and self.window_s:
            self._slept += 1

    def _judge(self) -> None:
        if 2 * self._slept > self._waits:    # polling mostly wasted: off for a while
            self.window_s, self._off = 0.0, self._off_next
            self._off_next = min(2 * self._off_next, self._OFF_MAX)
        else:
            self._off_next = self._ROUND
        self._waits = self._slept = 0


class Segment:
    """A named POSIX shared-memory segment, mapped; the creator owns (unlinks) the name."""

    def __init__(self, name: str, nbytes: int, create: bool) -> None:
        self.path = os.path.join(_DIR, name)
        self.nbytes = nbytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            self.map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.owner = create

    def view(self, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
        return np.frombuffer(self.map, dtype=dtype, count=count, offset=offset)

    def unlink(self) -> None:
        if self.owner:
            self.owner = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a numpy view is still alive; the mapping goes with the process
            pass
        self.unlink()


class ControlBlock:
    """The job's control segment: one int64 word per rank for each of ``FIELDS``."""

    FIELDS = ("barrier", "copied", "reduced", "pid", "addr", "cma_ok", "done", "bell",
              "lane", "lane_k0", "lane_k1")

    def __init__(self, rank: int, size: int, token: str, timeout_s: float,
                 failed: Callable[[], BaseException | None],
                 not_answering: Callable[[], BaseException | None] | None = None) -> None:
        """``failed()`` is the job's error, if any (waits give up on it); after a wait
        times out, ``not_answering()`` is the error naming a peer that stopped answering,
        if one has, raised in place of the timeout."""
        self.rank, self.size = rank, size
        self.timeout = timeout_s
        self.failed = failed
        self.not_answering = not_answering
        self._name = f"hostreduce-{token}-ctl"
        # Rank 0 creates the control segment before announcing the token to peers.
        self._seg = Segment(self._name, self._bytes(), create=True) if rank == 0 else None
        self.words: dict[str, np.ndarray] = {}
        self.mapped = False
        self.spin = SpinPolicy(size)
        self._use_futex = _futex.available()
        self.bells: np.ndarray | None = None
        self.bell_addr: list[int] = []
        self._barriers = 0

    def _bytes(self) -> int:
        return _ALIGN * self.size * len(self.FIELDS)

    def ensure(self) -> dict[str, np.ndarray]:
        """Map the segment (by name, on first use) and return its words by field."""
        if not self.mapped:
            if self._seg is None:
                self._seg = Segment(self._name, self._bytes(), create=False)
            words = self._seg.view(np.dtype(np.int64), 0, self._bytes() // 8)[:: _ALIGN // 8]
            for i, field in enumerate(self.FIELDS):
                self.words[field] = words[i * self.size: (i + 1) * self.size]
            bells = self.words["bell"]
            if self._use_futex:
                self.bells = bells
                low = 4 if sys.byteorder == "big" else 0   # the futex word is the counter's low half
                self.bell_addr = [bells.ctypes.data + j * bells.strides[0] + low for j in range(self.size)]
            self.mapped = True
        return self.words

    def release_name(self) -> None:
        """Remove the segment's name once every rank has mapped it."""
        self.ensure()
        if self._seg is not None:
            self._seg.unlink()

    def post(self, field: str, value: int) -> None:
        """Set this rank's ``field`` counter and ring its bell for peers waiting on it."""
        self.words[field][self.rank] = value
        self.words["bell"][self.rank] += 1
        if self.bells is not None:
            _futex.wake(self.bell_addr[self.rank])

    def barrier(self) -> None:
        counters = self.ensure()["barrier"]
        self._barriers += 1
        target = self._barriers
        self.post("barrier", target)
        waiter = Waiter(self, f"shared-memory barrier #{target}")
        while int(counters.min()) < target:
            waiter.idle(lambda: [r for r in range(self.size) if int(counters[r]) < target])

    def close(self) -> None:
        self.mapped = False
        if self._seg is not None:
            self._seg.close()
            self._seg = None


class Waiter:
    """One wait for peers' counters (see the module docstring). ``on_timeout(late)``
    makes the error raised after the timeout, from the late ranks."""

    __slots__ = ("block", "what", "start", "spins", "nap", "on_timeout", "window", "slept")

    def __init__(self, block: ControlBlock, what: str,
                 on_timeout: Callable[[list[int]], BaseException] | None = None) -> None:
        self.block, self.what, self.start, self.spins, self.nap = block, what, 0.0, 0, 10e-6
        self.on_timeout = on_timeout
        self.window, self.slept = 0.0, False

    def idle(self, late: Callable[[], list[int]]) -> None:
        """Called while the condition waited for is false; ``late()`` lists the ranks
        this rank waits for right now, first the one it needs next."""
        b = self.block
        self.spins += 1
        if self.spins < 64:
            os.sched_yield()
            return
        if self.start == 0.0:
            self.start = time.monotonic()
            self.window = b.spin.started()
        err = b.failed()
        if err is not None:
            raise err
        waited = time.monotonic() - self.start
        if waited > b.timeout:
            silent = b.not_answering() if b.not_answering is not None else None
            if silent is not None:  # the likely cause, whatever this wait was for
                raise silent
            if self.on_timeout is not None:
                raise self.on_timeout(late())
            raise PeerLostError(
                f"Rank {b.rank}: ranks {late()} did not reach {self.what} within "
                f"{b.timeout} s (hung or dead)"
            )
        if waited < self.window:
            os.sched_yield()
            return
        if self.window and not self.slept:
            self.slept = True
            b.spin.slept()
        if b.bells is not None:
            rung = [int(v) for v in b.bells]   # read before the check: no lost wake-up
            lag = [j for j in late() if j != b.rank]  # nobody else rings this rank's bell
            if lag:
                _futex.wait(b.bell_addr[lag[0]], rung[lag[0]], min(_FUTEX_SLICE_S, b.timeout - waited + 1e-3))
            return
        time.sleep(self.nap)
        self.nap = min(self.nap * 2, 1e-3)
