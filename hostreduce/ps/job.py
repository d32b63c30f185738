"""A training task's tie to the parameter servers for the whole job: its client, a
heartbeat that tells the ps it is alive, and what its process's end means to the job.

The chief ends the job when its process exits (the Estimator scripts of TensorFlow's
parameter-server mode never end their ps themselves): before the interpreter joins its
threads, the ps are told to stop, with the error that ended the chief if it failed, so
each ps exits 0 only when the job succeeded. A chief that succeeded first waits until
every other worker's process has ended (each says ``Done`` as it exits, with its error
if it failed) or is lost (silent for ``timeout_s``): a worker may still train
(asynchronous mode) or read the ps after its ``train()``. The workers that failed or
were lost are logged; the job goes on without them. A chief killed outright says
nothing; its ps notice the missing heartbeat (``ParameterServer(chief_timeout_s=...)``).
"""
from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
from typing import Any, Sequence

from ..errors import HostReduceError

__all__ = ["PSJob"]

log = logging.getLogger("hostreduce.ps")


class PSJob:
    """The client of worker ``rank`` (of ``num_workers``) to the ps at ``ps_addresses``."""

    def __init__(self, ps_addresses: Sequence[str], rank: int, num_workers: int, secret: str, *,
                 timeout_s: float, connect_timeout_s: float, heartbeat_s: float | None = None,
                 tls_ca: bytes | None = None) -> None:
        from .client import PSClient

        self.client = PSClient(ps_addresses, rank, num_workers, secret, timeout_s=timeout_s,
                               connect_timeout_s=connect_timeout_s, tls_ca=tls_ca)
        self.rank, self.num_workers = rank, num_workers
        self.failure: str | None = None
        self._ended = False
        self._stop = threading.Event()
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
        """This process leaves the job (once): the chief ends it (after the other workers
        when it succeeded), any other worker tells the ps it is done."""
        if self._ended:
            return
        self._ended = True
        failure = failure or self.failure
        try:
            if self.rank == 0:
                if failure is None:
                    try:
                        self._wait_for_workers()
                    except HostReduceError as e:  # ps 0 is lost: end the job on the others
                        log.warning("the chief could not learn whether the other workers ended: %s", e)
                for why in self.client.shutdown(failure):
                    log.warning("could not end the job on a ps: %s", why)
            else:
                self.client.done(failure)
        except HostReduceError as e:
            log.warning("worker %d could not tell the ps that it ends: %s", self.rank, e)
        finally:
            self._stop.set()
            self.client.close()

    def _wait_for_workers(self, poll_s: float = 0.1, note_s: float = 30.0) -> None:
        """Until every other worker is done, failed or lost (a live worker is waited for:
        the ps must serve it); the failed and lost ones are logged."""
        others, reported = set(range(1, self.num_workers)), set()
        note = time.monotonic() + note_s
        while others:
            state = self.client.workers()
            failed = {int(r): e for r, e in state["failed"].items()}
            for rank in sorted((set(failed) | set(state["lost"])) - reported):
                reported.add(rank)
                log.warning("worker %d %s; the job goes on without it", rank,
                            f"failed: {failed[rank]}" if rank in failed else
                            f"was lost: it did not call the ps for timeout_s={self.client.timeout_s:g} s")
            left = others - set(state["done"]) - set(failed) - set(state["lost"])
            if not left:
                return
            if time.monotonic() > note:
                note += note_s
                log.warning("the chief waits for worker(s) %s to end before it ends the job", sorted(left))
            time.sleep(poll_s)
