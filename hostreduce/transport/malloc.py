"""Keep glibc's malloc from returning message buffers to the kernel after every use.

gRPC and numpy allocate a fresh buffer per message; by default glibc serves large ones
with mmap and unmaps them on free, so every message pays page faults on fresh memory
(about 0.45 ms per MiB on the reference machine, as much as the copy itself). Raising
the mmap and trim thresholds lets freed buffers be reused. It only changes when memory
goes back to the kernel, not how much a process may use. Disable with
``HOSTREDUCE_TUNE_MALLOC=0``.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["tune_malloc"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20   # glibc's largest allowed value on 64-bit
_TRIM_THRESHOLD = 1 << 30
_done = False


def tune_malloc() -> bool:
    """Apply the thresholds once per process; returns whether glibc accepted them."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    logging.getLogger("hostreduce.ring").debug("malloc thresholds raised: %s", ok)
    _done = ok
    return ok
