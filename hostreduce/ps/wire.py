"""The bytes of every ps request and reply: a small JSON header and raw arrays.

``length of header (4 bytes, little endian) | header JSON | arrays``, each array's
bytes starting at a multiple of 8 so that the receiver reads it in place
(``np.frombuffer``, no copy). The header lists each array as ``[dtype, shape]``; the
receiver checks every size against the message's length before reading, since a
message is only trusted as far as its sender authenticated (``handshake.py``).
"""
from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from ..errors import WireError

__all__ = ["pack", "unpack", "SERVICE", "METHODS", "WireError"]

SERVICE = "hostreduce.ParameterServer"
# Every method after the handshake; each takes and returns one packed message.
METHODS = ("Info", "Register", "Open", "PullDense", "PullRows", "Push", "Save", "Restore", "Done", "Shutdown",
           "Logout", "Pause", "Resume")
_DTYPES = {"float16", "float32", "float64", "int32", "int64"}
_ALIGN = 8
MAX_HEADER_BYTES = 16 << 20


def _pad(n: int) -> int:
    return -n % _ALIGN


def pack(header: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> bytes:
    arrays = [np.ascontiguousarray(a) for a in arrays]
    head = dict(header, arrays=[[a.dtype.name, list(a.shape)] for a in arrays])
    raw = json.dumps(head, separators=(",", ":")).encode()
    parts: list[Any] = [len(raw).to_bytes(4, "little"), raw, b"\0" * _pad(4 + len(raw))]
    for a in arrays:
        parts.append(memoryview(a.reshape(-1).view(np.uint8)))
        parts.append(b"\0" * _pad(a.nbytes))
    return b"".join(parts)


def unpack(data: bytes) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The header and the arrays (read-only views of ``data``)."""
    view = memoryview(data)
    if len(view) < 4:
        raise WireError(f"message of {len(view)} bytes is shorter than its length field")
    n = int.from_bytes(view[:4], "little")
    if n > min(MAX_HEADER_BYTES, len(view) - 4):
        raise WireError(f"header length {n} does not fit a message of {len(view)} bytes")
    try:
        header = json.loads(bytes(view[4:4 + n]))
    except (ValueError, RecursionError) as e:
        raise WireError(f"header is not JSON ({type(e).__name__})") from None
    if not isinstance(header, dict) or not isinstance(header.get("arrays"), list):
        raise WireError("header is not an object with an array list")
    pos = 4 + n + _pad(4 + n)
    arrays = []
    for item in header.pop("arrays"):
        try:
            dtype, shape = item
            if dtype not in _DTYPES or not all(type(d) is int and d >= 0 for d in shape):
                raise ValueError
            dt = np.dtype(dtype)
            size = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        except (ValueError, TypeError):
            raise WireError(f"bad array description {str(item)[:80]}") from None
        if pos + size > len(view):
            raise WireError(f"array of {size} bytes overruns the message ({len(view)} bytes)")
        arrays.append(np.frombuffer(view[pos:pos + size], dtype=dt).reshape(shape))
        pos += size + _pad(size)
    return header, arrays
