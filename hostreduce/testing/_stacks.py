"""Every thread's stack of a rank that did not finish in time, for the timeout error.

Each rank, as it starts, has SIGUSR1 write every thread's stack (``faulthandler``, which
works even while the rank is blocked in C code) to a file of its own and then end the
rank. On a timeout the harness sends SIGUSR1 to each rank still running and waits for it
to end: its exit tells that the stacks are completely written. Then it reads them.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import time
from typing import Any, Mapping

__all__ = ["install", "collect"]

_SIGNAL = signal.SIGUSR1
_WAIT_S = 10.0  # for the signalled ranks to write their stacks and end


def install(path: str) -> None:
    """In a rank: on SIGUSR1, write every thread's stack to ``path``, then end.

    ``chain=True`` runs the handler that was there before once the stacks are written;
    that is SIGUSR1's default action (set here), which ends the process."""
    out = open(path, "w")  # faulthandler holds it (and so keeps it open) from now on
    signal.signal(_SIGNAL, signal.SIG_DFL)
    faulthandler.register(_SIGNAL, file=out, all_threads=True, chain=True)


def collect(procs: Mapping[int, Any], paths: Mapping[int, str]) -> dict[int, str]:
    """The stacks of the ranks ``procs`` (rank -> running process), each as its
    :func:`install` wrote them to ``paths[rank]``; each process has ended or is left
    for the caller to kill."""
    stopped = {rank for rank, proc in procs.items() if _state(proc.pid) == "T"}
    for rank, proc in procs.items():
        if rank not in stopped:
            try:
                os.kill(proc.pid, _SIGNAL)
            except (ProcessLookupError, TypeError):
                pass
    deadline = time.monotonic() + _WAIT_S
    for rank, proc in procs.items():
        if rank not in stopped:
            proc.join(max(0.0, deadline - time.monotonic()))
    stacks = {}
    for rank in procs:
        try:
            with open(paths[rank]) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        if rank in stopped:
            text = "(none: the rank is stopped, e.g. by SIGSTOP, and cannot write them)"
        stacks[rank] = text or ("(none written: the rank had not started its function yet, "
                                "or did not answer SIGUSR1 in time)")
    return stacks


def _state(pid: int | None) -> str:
    """The process's state letter from /proc (R, S, D, T, Z, ...), or '' if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
