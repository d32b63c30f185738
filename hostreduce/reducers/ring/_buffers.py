"""Large result arrays, recycled once nothing refers to them any more.

glibc serves allocations over 32 MiB (its largest mmap threshold, see ``_malloc.py``)
with fresh mappings, so a collective that returns a new array of that size pays a page
fault per 4 KiB on every call (about 0.45 ms per MiB, as much as the reduction). The
pool keeps a few such blocks: a block is handed out again once every array viewing it
is gone, which CPython's reference count says exactly (an array keeps its base alive).
Smaller results come from malloc, which already reuses them.
"""
from __future__ import annotations

import sys
import threading

import numpy as np

__all__ = ["ResultPool"]

_MIN_BYTES = 32 << 20


class ResultPool:
    def __init__(self, keep: int = 4, min_bytes: int = _MIN_BYTES) -> None:
        self._keep, self._min = keep, min_bytes
        self._blocks: list[np.ndarray] = []
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A C-contiguous array of ``shape`` and ``dtype`` (contents undefined)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < self._min:
            return np.empty(shape, dtype)
        with self._lock:
            block = self._free(nbytes)
            if block is None:
                block = np.empty(nbytes, np.uint8)
                if len(self._blocks) >= self._keep:
                    self._blocks.pop(0)  # the oldest: it stays alive while its arrays are
                self._blocks.append(block)
        return block[:nbytes].view(dtype).reshape(shape)

    def _free(self, nbytes: int) -> np.ndarray | None:
        best = None
        for i in range(len(self._blocks)):
            # References: the list, and getrefcount's argument; any more is an array.
            if self._blocks[i].nbytes >= nbytes and sys.getrefcount(self._blocks[i]) == 2:
                if best is None or self._blocks[i].nbytes < self._blocks[best].nbytes:
                    best = i
        return None if best is None else self._blocks[best]
