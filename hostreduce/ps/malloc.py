"""glibc's malloc settings for a ps process, whose memory churns through buffers of a
megabyte or two every step (each request and reply, the kernels' temporaries).

By default glibc serves an allocation above its mmap threshold (128 KiB at first,
raised as such blocks are freed) with a fresh ``mmap`` and gives it back with
``munmap``, and returns the top of a heap to the system once more than the trim
threshold is free there. Either way, the next step's buffers are new pages: a page
fault per 4 KiB, paid again every step. Measured on the parameter-server benchmark:
a quarter to a third of a ps's CPU time per step. Fixed thresholds (the mmap threshold no longer
moves once set) keep those buffers in the heap: blocks below ``MMAP_THRESHOLD``
come from it, and up to ``TRIM_THRESHOLD`` of free memory stays mapped for reuse.
Larger blocks (a shard's registration, a checkpoint's snapshot) are still mapped
and unmapped as before.

``HOSTREDUCE_PS_MALLOC=0`` leaves glibc's defaults. Elsewhere than on glibc (musl,
macOS) nothing is changed.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

__all__ = ["tune_for_ps", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

log = logging.getLogger("hostreduce.ps")

MMAP_THRESHOLD = 16 << 20
TRIM_THRESHOLD = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_done: list[bool] = []


def tune_for_ps() -> bool:
    """Set the thresholds once per process; whether they are set."""
    if _done:
        return _done[0]
    ok = False
    if os.environ.get("HOSTREDUCE_PS_MALLOC", "1") != "0":
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):  # not glibc
            mallopt = None
        if mallopt is not None:
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
            if not ok:
                log.debug("mallopt refused the ps's malloc thresholds")
    _done.append(ok)
    return ok
