"""A training task's tie to the parameter servers for the whole job: its client, and on
the chief the heartbeat that tells the ps it is alive and the end of the job.

The chief ends the job when its process exits (the Estimator scripts of TensorFlow's
parameter-server mode never end their ps themselves): before the interpreter joins its
threads, the ps are told to stop, with the error that ended the chief if it failed, so
each ps exits 0 only when the job succeeded. A chief killed outright says nothing; its
ps notice the missing heartbeat (``ParameterServer(chief_timeout_s=...)``).
"""
from __future__ import annotations

import atexit
import logging
import sys
import threading
from typing import Any, Sequence

from ..errors import HostReduceError

__all__ = ["PSJob"]

log = logging.getLogger("hostreduce.ps")


class PSJob:
    """The client of worker ``rank`` (of ``num_workers``) to the ps at ``ps_addresses``."""

    def __init__(self, ps_addresses: Sequence[str], rank: int, num_workers: int, secret: str, *,
                 timeout_s: float, connect_timeout_s: float, heartbeat_s: float | None = None) -> None:
        from .client import PSClient

        self.client = PSClient(ps_addresses, rank, num_workers, secret, timeout_s=timeout_s,
                               connect_timeout_s=connect_timeout_s)
        self.rank = rank
        self.failure: str | None = None
        self._ended = False
        self._stop = threading.Event()
        if rank == 0:
            self._hook_exceptions()
            register = getattr(threading, "_register_atexit", None)  # before the interpreter joins threads
            try:
                register(self.end) if register else atexit.register(self.end)
            except RuntimeError:  # already shutting down
                atexit.register(self.end)
            beat = heartbeat_s or max(0.5, timeout_s / 2)
            threading.Thread(target=self._beat, args=(beat,), daemon=True, name="hostreduce-ps-heartbeat").start()

    def _hook_exceptions(self) -> None:
        previous = sys.excepthook

        def hook(kind: Any, value: Any, tb: Any) -> None:
            self.failure = f"{kind.__name__}: {str(value)[:300]}"
            previous(kind, value, tb)

        sys.excepthook = hook

    def _beat(self, period: float) -> None:
        while not self._stop.wait(period):
            try:
                self.client.heartbeat()
            except HostReduceError:
                pass  # a lost ps is reported by the next step's call

    def end(self, failure: str | None = None) -> None:
        """The chief: tell every ps the job is over (once). Others: close the client."""
        if self._ended:
            return
        self._ended = True
        self._stop.set()
        if self.rank == 0:
            lost = self.client.shutdown(failure or self.failure)
            for why in lost:
                log.warning("could not end the job on a ps: %s", why)
        self.client.close()
