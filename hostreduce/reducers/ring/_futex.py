"""Cross-process wake-ups on a word of shared memory (Linux futex).

A rank that waits for a peer's counter sleeps in the kernel on that peer's "bell" word
and the peer wakes it right after bumping the counter: no polling, no oversleeping, and
no CPU taken from the peer being waited for. Where the call is missing (another OS, an
unknown architecture, a sandbox that forbids it) ``available()`` is False and callers
fall back to short sleeps.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform
import time

__all__ = ["available", "wait", "wake"]

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1   # shared (not _PRIVATE): the word is in a shared mapping
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


_syscall = None
_ok: bool | None = None


def _lib():
    global _syscall
    if _syscall is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = lib.syscall
        fn.restype = ctypes.c_long
        _syscall = fn
    return _syscall


def available() -> bool:
    """Whether futex calls work here (checked once with a wake on a private word)."""
    global _ok
    if _ok is None:
        _ok = False
        if os.uname().sysname == "Linux" and _SYS_FUTEX is not None:
            try:
                word = ctypes.c_int32(0)
                _ok = _lib()(_SYS_FUTEX, ctypes.byref(word), _FUTEX_WAKE, 1, None, None, 0) >= 0
            except (OSError, AttributeError):
                _ok = False
    return _ok


def wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at ``addr`` equals ``expected`` (low 32 bits), at most
    ``timeout_s``. Returns on a wake-up, a changed word, a signal or the timeout; callers
    re-check their condition."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    r = _lib()(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT,
               ctypes.c_int32(expected & 0xFFFFFFFF).value, ctypes.byref(ts), None, 0)
    if r < 0 and ctypes.get_errno() not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
        time.sleep(min(timeout_s, 1e-3))  # refused here: callers re-check after a short nap


def wake(addr: int) -> None:
    """Wake every process sleeping on the word at ``addr``."""
    _lib()(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, _WAKE_ALL, None, None, 0)
