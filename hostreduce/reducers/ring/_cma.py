"""Single-copy reads from a peer process's memory (Linux cross-memory attach).

``process_vm_readv`` copies straight from another process's buffer into ours, which
saves the copy into and out of a shared segment (Open MPI's shared-memory transport
uses the same call). It needs ptrace permission over the peer: same user, and under
Yama's ptrace scope 1 the peer must allow it (``allow_peers``). Container sandboxes may
forbid the call; ``ShmGroup`` probes it once and falls back to shared segments.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

import numpy as np

__all__ = ["available", "allow_peers", "read_into"]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = None
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


def _lib():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = lib.process_vm_readv
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                       ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
        fn.restype = ctypes.c_ssize_t
        _libc = lib
    return _libc


def available() -> bool:
    """Whether this platform has the call at all (the peers' permission is probed later)."""
    if not os.uname().sysname == "Linux":
        return False
    try:
        _lib()
    except (OSError, AttributeError):
        return False
    return True


def allow_peers() -> None:
    """Let processes of this user read this process under Yama ptrace scope 1."""
    try:
        _lib().prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0)
    except (OSError, AttributeError):  # no Yama, or not Linux: nothing to allow
        pass


def read_into(pid: int, remote_addr: int, dst: np.ndarray) -> None:
    """Copy ``dst.nbytes`` bytes at ``remote_addr`` in process ``pid`` into ``dst``
    (C-contiguous). Raises OSError with the errno on failure or a short read."""
    n = dst.nbytes
    if n == 0:
        return
    local = _IoVec(dst.ctypes.data, n)
    remote = _IoVec(remote_addr, n)
    got = _lib().process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if got != n:
        err = ctypes.get_errno() if got < 0 else errno.EIO
        raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)} (read {got} of {n} bytes)")
