"""Point-to-point send and receive over an MPI communicator that detect a name, shape
or dtype disagreement on both ends instead of truncating data or hanging.

A transfer is three messages: the sender's header (name, dtype, shape), the receiver's
answer (its own header), and, only when the two are equal, the payload. Both ends thus
know whether the payload follows, and on a disagreement both raise
``TensorMismatchError`` describing both sides; the engine stays usable.

Every message of the k-th transfer from rank s to rank d carries a tag derived from k
(counted on both ends in submission order), so transfers in flight at once, to one peer
or several, never take each other's answers; MPI's non-overtaking order keeps the
transfers whose tags wrap around apart.

Transfers are started on the engine's serial thread and finished there later
(``_serial.Later``): a send must not hold up the work queued behind it, or two ranks
that each send before they receive would wait on each other.
"""
from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from ...errors import TensorMismatchError
from .._serial import Later

__all__ = ["PointToPoint"]

_HEADER_BYTES = 512
_SEQUENCES = 8000  # 3 tags each: below 32767, the smallest tag bound MPI allows


def _header(name: str, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[np.ndarray, str]:
    text = f"{name!r} {dtype.name} {tuple(shape)}"
    raw = f"{zlib.crc32(text.encode())}|{text}".encode()[:_HEADER_BYTES]
    buf = np.zeros(_HEADER_BYTES, np.uint8)
    buf[:len(raw)] = np.frombuffer(raw, np.uint8)
    return buf, text


def _text(buf: np.ndarray) -> str:
    raw = buf.tobytes().rstrip(b"\0").decode(errors="replace")
    return raw.split("|", 1)[-1]


class PointToPoint:
    """Sends and receives between world ranks of ``comm`` (a communicator of its own)."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}

    def _tags(self, counter: dict[int, int], peer: int) -> int:
        k = counter.get(peer, 0)
        counter[peer] = k + 1
        return (k % _SEQUENCES) * 3

    def send(self, name: str, arr: np.ndarray, dst: int) -> Later:
        """Start sending ``arr`` to world rank ``dst`` (on the serial thread)."""
        return _Send(self, name, np.ascontiguousarray(arr), dst, self._tags(self._sent, dst))

    def recv(self, name: str, shape: tuple[int, ...], dtype: np.dtype, src: int) -> Later:
        """Start receiving from world rank ``src`` (on the serial thread)."""
        return _Recv(self, name, np.empty(shape, dtype), src, self._tags(self._received, src))


def _mismatch(name: str, sender: int, sent: str, receiver: int, expected: str) -> TensorMismatchError:
    return TensorMismatchError(
        f"Tensor {name!r}: rank {sender} sends {sent} but rank {receiver} expects {expected}: a send and its "
        "receive must agree in name, dtype and shape (and be submitted in the same order)")


class _Send(Later):
    def __init__(self, p2p: PointToPoint, name: str, arr: np.ndarray, dst: int, tag: int) -> None:
        self._p2p, self._name, self._arr, self._dst, self._tag = p2p, name, arr, dst, tag
        self._header, self._mine = _header(name, arr.dtype, arr.shape)
        self._answer = np.zeros(_HEADER_BYTES, np.uint8)
        comm = p2p.comm
        self._requests = [comm.Isend(self._header, dst, tag), comm.Irecv(self._answer, dst, tag + 1)]
        self._payload: Any = None

    def test(self) -> bool:
        if self._payload is None:
            if not all(r.Test() for r in self._requests):
                return False
            if not np.array_equal(self._answer, self._header):
                raise _mismatch(self._name, self._p2p.rank, self._mine, self._dst, _text(self._answer))
            if self._arr.nbytes == 0:
                return True
            self._payload = self._p2p.comm.Isend(self._arr.reshape(-1).view(np.uint8), self._dst, self._tag + 2)
        return bool(self._payload.Test())


class _Recv(Later):
    def __init__(self, p2p: PointToPoint, name: str, out: np.ndarray, src: int, tag: int) -> None:
        self._p2p, self._name, self._out, self._src, self._tag = p2p, name, out, src, tag
        self._header, self._mine = _header(name, out.dtype, out.shape)
        self._theirs = np.zeros(_HEADER_BYTES, np.uint8)
        self._request = p2p.comm.Irecv(self._theirs, src, tag)
        self._answered: list[Any] | None = None
        self._agree = True

    def test(self) -> bool:
        comm = self._p2p.comm
        if self._answered is None:
            if not self._request.Test():
                return False
            self._agree = bool(np.array_equal(self._theirs, self._header))
            self._answered = [comm.Isend(self._header, self._src, self._tag + 1)]
            if self._agree and self._out.nbytes:
                self._answered.append(comm.Irecv(self._out.reshape(-1).view(np.uint8), self._src, self._tag + 2))
        if not all(r.Test() for r in self._answered):
            return False
        if not self._agree:
            raise _mismatch(self._name, self._src, _text(self._theirs), self._p2p.rank, self._mine)
        return True

    def result(self) -> np.ndarray:
        return self._out
