"""Synchronous steps on one ps: the gradients of step S from every worker are held until
all N have arrived, summed in rank order (so the bits do not depend on who came first)
and applied once; every worker's push returns only then, so its next pull sees step S.

A worker that does not push within the wait fails the step for everyone waiting, with
an error naming the missing ranks; nothing of that step is applied. A push the ps
refuses (``refuse``: its content failed the check) fails its step the same way: every
worker of the step, those waiting and those still to come, gets the same error, and
nothing of the step is applied. The apply runs only with every push of the step
checked; should it still fail partway (out of memory), the shard is no longer at any
step, so that step and every later push fail with the error rather than train on it. A ps that stops
serving (the chief ended the job, or was lost) aborts the barrier: the pushes waiting
on it fail at once instead of holding their handler threads, and so the ps process's
exit, until their wait ends.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np

from ..errors import CollectiveTimeoutError, HostReduceError, PeerLostError, TensorMismatchError
from .store import Contribution

__all__ = ["StepBarrier", "Contribution"]


class StepBarrier:
    def __init__(self, ps_index: int, num_workers: int, apply: Callable[[int, Contribution], None],
                 current_step: Callable[[], int], *, reduce: str = "sum") -> None:
        self.index, self.num_workers = ps_index, num_workers
        self._apply, self._current = apply, current_step
        self._scale = 1.0 if reduce == "sum" else 1.0 / num_workers
        self._cond = threading.Condition()
        self._parts: dict[int, Contribution] = {}
        self._step: int | None = None
        self._failed: dict[int, HostReduceError] = {}  # step -> why it failed
        self._aborted: HostReduceError | None = None
        self._done_step = -1
        self.last_seen: dict[int, float] = {}

    def _enter(self, rank: int, step: int) -> None:
        """The checks of every arrival (under the lock): the step is the next one, not
        failed, and ``rank`` has not pushed it yet."""
        self.last_seen[rank] = time.monotonic()
        expected = self._current() + 1
        if step in self._failed or self._aborted is not None:
            raise _copy(self._failed.get(step) or self._aborted)  # type: ignore[arg-type]
        if step != expected:
            raise TensorMismatchError(f"ps task {self.index}: worker {rank} pushed step {step}; the ps is at "
                                      f"step {expected - 1} and expects step {expected}")
        if rank in self._parts:
            raise TensorMismatchError(f"ps task {self.index}: worker {rank} pushed step {step} twice")

    def refuse(self, rank: int, step: int, error: HostReduceError) -> HostReduceError:
        """``rank``'s push of ``step`` failed its check (``error``): fail the step for
        every worker of it, and return the error they all get (of ``error``'s class)."""
        with self._cond:
            self._enter(rank, step)
            failed = type(error)(f"{error}. Step {step} failed on ps task {self.index} for every worker: worker "
                                 f"{rank}'s push was refused, nothing of step {step} was applied")
            self._failed[step] = failed
            self._parts = {}
            self._cond.notify_all()
            return _copy(failed)

    def arrive(self, rank: int, step: int, part: Contribution, wait_s: float) -> None:
        """Add ``rank``'s gradients of ``step`` (checked); return once the step is applied."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            self._enter(rank, step)
            self._parts[rank] = part
            if len(self._parts) == self.num_workers:
                parts, self._parts = self._parts, {}
                try:
                    self._apply(step, self._sum(parts))
                except Exception as e:  # noqa: BLE001 - every worker of the step gets it
                    why = (f"ps task {self.index}: the apply of step {step} failed partway ({type(e).__name__}: "
                           f"{e}); the shard holds part of step {step}, so this ps refuses every later step")
                    self._failed[step] = self._aborted = PeerLostError(why)
                    self._cond.notify_all()
                    raise _copy(self._aborted) from None
                self._done_step = step
                self._cond.notify_all()
                return
            while self._done_step < step and step not in self._failed:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.num_workers)) - set(self._parts))
                    now = time.monotonic()
                    heard = ", ".join(f"worker {r} last heard {now - self.last_seen[r]:.1f} s ago"
                                      if r in self.last_seen else f"worker {r} never pushed" for r in missing)
                    self._failed[step] = CollectiveTimeoutError(
                        f"ps task {self.index}: step {step} timed out after {wait_s:.1f} s waiting for worker "
                        f"rank(s) {missing} ({heard}); a straggler or a lost worker. Nothing of step {step} "
                        "was applied")
                    self._parts = {}
                    self._cond.notify_all()
                    break
                self._cond.wait(left)
            if step in self._failed:
                raise _copy(self._failed[step])

    def abort(self, why: str) -> None:
        """Fail the step in progress and every later push: this ps stops serving
        (``why``). Nothing of the step in progress is applied."""
        with self._cond:
            step = self._current() + 1
            missing = sorted(set(range(self.num_workers)) - set(self._parts))
            self._aborted = PeerLostError(f"ps task {self.index} stopped serving ({why})")
            if self._parts:
                self._failed[step] = PeerLostError(
                    f"ps task {self.index} stopped serving ({why}) while step {step} waited for worker rank(s) "
                    f"{missing}. Nothing of step {step} was applied")
                self._parts = {}
            self._cond.notify_all()

    def _sum(self, parts: dict[int, Contribution]) -> Contribution:
        dense: dict[str, np.ndarray] = {}
        rows: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        for rank in sorted(parts):
            d, r = parts[rank]
            for name, g in d.items():
                dense[name] = g.copy() if name not in dense else dense[name] + g
            for name, pair in r.items():
                rows.setdefault(name, []).append(pair)
        if self._scale != 1.0:
            dense = {n: g * g.dtype.type(self._scale) for n, g in dense.items()}
        out_rows = {}
        for name, pairs in rows.items():
            ids = np.concatenate([p[0] for p in pairs])
            vals = np.concatenate([p[1] for p in pairs])
            out_rows[name] = (ids, vals * vals.dtype.type(self._scale) if self._scale != 1.0 else vals)
        return dense, out_rows


def _copy(error: HostReduceError) -> HostReduceError:
    """A fresh exception of the same class and message: each waiting thread raises its
    own, so their tracebacks do not pile onto one object."""
    return type(error)(str(error))
