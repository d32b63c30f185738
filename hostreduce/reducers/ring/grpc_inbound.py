"""The serving side of the gRPC mesh: the handshake a connecting peer must pass, and
each authenticated peer's incoming stream of frames.

A frame is ``kind (1 byte) | tag (8 bytes) | payload``. Data frames (from the stream, or
from a peer's own data connection on the ``tcp`` data path) are queued per source for
the ring, which takes them in order with ``recv_data``; control frames
(``messages.py``) are handed to a callback as they arrive, on the stream's thread. A
goodbye frame is queued after every data frame its sender sent, so a collective that
still needs a departed peer fails with a message saying so rather than a timeout. A
stream that ends without a goodbye means the peer died; a failure frame says why a
peer stops (``PeerFailure``). Either way the mesh learns at once (``on_lost``).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np

from ...errors import PeerLostError
from ...transport import admission, auth
from .messages import PeerFailure, decode

__all__ = ["Inbound", "frame", "DATA", "CTL", "ABORT", "BYE", "FAILED", "SERVICE"]

DATA, CTL, ABORT, BYE, FAILED = 1, 2, 3, 4, 6
SERVICE = "hostreduce.Peer"
_HEADER = 9
_DEPARTED = b"departed"


def frame(kind: int, tag: int, payload: bytes | np.ndarray = b"") -> bytes:
    head = bytes((kind,)) + int(tag).to_bytes(8, "little")
    if isinstance(payload, np.ndarray):
        payload = memoryview(np.ascontiguousarray(payload).reshape(-1).view(np.uint8))
    return b"".join((head, payload))


class Inbound:
    """Handshakes and incoming streams of one rank. ``cond`` is the mesh's condition:
    it guards ``incoming`` and ``goodbye`` and is notified when a peer connects."""

    def __init__(self, rank: int, addresses: tuple[str, ...], secret: str, cond: threading.Condition, *,
                 on_message: Callable[[int, memoryview], None], on_lost: Callable[[int, str], None],
                 on_failed: Callable[[list[int]], None], closing: Callable[[], bool],
                 on_departed: Callable[[int], None] | None = None) -> None:
        self.rank, self.size, self.addresses = rank, len(addresses), addresses
        self._secret = secret
        self._cond = cond
        self._on_message, self._on_lost, self._on_failed = on_message, on_lost, on_failed
        self._on_departed = on_departed
        self._closing = closing
        self._nonces = auth.NonceBook()
        self.refusals = admission.Refusals(rank)
        self.incoming: set[int] = set()      # peers whose stream is open
        self.goodbye: set[int] = set()       # peers that said goodbye
        self.last_frame: dict[int, float] = {}
        self._inbox: dict[int, queue.SimpleQueue] = {p: queue.SimpleQueue() for p in range(self.size)}
        # Peers whose data frames come over a connection of their own (``tcp_links.py``).
        self.data_elsewhere: set[int] = set()

    def handler(self) -> Any:
        import grpc

        return grpc.method_handlers_generic_handler(SERVICE, {
            "Hello": grpc.unary_unary_rpc_method_handler(self._hello),
            "Stream": grpc.stream_unary_rpc_method_handler(self._stream),
        })

    # ------------------------------------------------------------------ handshake
    def _hello(self, request: bytes, context: Any) -> bytes:
        try:
            client_rank, client_nonce = admission.parse_hello(request, self.rank, self.size)
        except ValueError as e:
            import grpc

            self._refuse(context.peer(), None, f"malformed handshake: {e}")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed handshake")
        return admission.hello_reply(self._secret, self.rank, client_rank, client_nonce, self._nonces.issue())

    def _refuse(self, peer: str, claimed: int | None, why: str) -> None:
        with self._cond:
            connected = set(self.incoming)
        self.refusals.refuse(peer, claimed, why, connected)

    # ------------------------------------------------------------------ streams
    def _stream(self, frames: Iterator[bytes], context: Any) -> bytes:
        import grpc

        src, why = admission.check_proof(dict(context.invocation_metadata()), self._secret, self._nonces, self.rank,
                                         lambda r: 0 <= r < self.size and r != self.rank)
        if why is not None:
            self._refuse(context.peer(), src if src >= 0 else None, why)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"rank {self.rank}: {why}")
        with self._cond:
            self.incoming.add(src)
            self._cond.notify_all()
        inbox = self._inbox[src]
        last = self.last_frame
        last[src] = time.monotonic()
        try:
            for data in frames:
                last[src] = time.monotonic()
                kind = data[0]
                if kind == DATA:
                    inbox.put(data)
                elif kind == CTL:
                    self._on_message(src, memoryview(data)[_HEADER:])
                elif kind == ABORT:
                    self._on_lost(src, "aborted: " + self._read_failure(data))
                elif kind == FAILED:
                    self._on_lost(src, f"rank {src} ({self.addresses[src]}) failed: " + self._read_failure(data))
                elif kind == BYE:
                    with self._cond:
                        self.goodbye.add(src)
                    if src not in self.data_elsewhere:   # else its data connection says when
                        inbox.put(_DEPARTED)  # after every data frame it sent
                    if self._on_departed is not None:
                        self._on_departed(src)
            ended = "closed its connection to this rank without saying goodbye"
        except Exception as e:  # the transport raises when the peer's process dies
            detail = e.details() if hasattr(e, "details") else str(e)
            ended = "stopped answering: its connection to this rank dropped" + (f" ({detail})" if detail else "")
        if src not in self.goodbye and not self._closing():
            self._on_lost(src, f"rank {src} ({self.addresses[src]}) {ended} (its process ended, or the network "
                               f"failed); last heard from {time.monotonic() - last[src]:.1f} s before")
        return b""

    def _read_failure(self, data: bytes) -> str:
        try:
            msg = decode(memoryview(data)[_HEADER:])
            if not isinstance(msg, PeerFailure):
                raise ValueError(f"{type(msg).__name__} in a failure frame")
            self._on_failed([r for r in msg.failed if type(r) is int])
            return str(msg.why)
        except (ValueError, TypeError, RecursionError):
            return bytes(data[_HEADER:]).decode(errors="replace")

    # ------------------------------------------------------------------ data
    def deliver_data(self, src: int, data: bytes | bytearray) -> None:
        """A data frame from ``src`` that came over its own connection."""
        self.last_frame[src] = time.monotonic()
        self._inbox[src].put(data)

    def data_departed(self, src: int) -> None:
        """``src`` sent its last data frame over its own connection."""
        self._inbox[src].put(_DEPARTED)

    def recv_data(self, src: int, tag: int, timeout: float) -> memoryview:
        """Next data frame from ``src``; raises PeerLostError on a wake-up sentinel or timeout."""
        try:
            data = self._inbox[src].get(timeout=timeout)
        except queue.Empty:
            raise PeerLostError(
                f"Rank {self.rank}: no data from rank {src} ({self.addresses[src]}) for {timeout} s "
                "(the peer is hung or unreachable)"
            ) from None
        if data is None:
            raise PeerLostError(f"Rank {self.rank}: stopped waiting for rank {src}: the job is aborting")
        if data is _DEPARTED:
            self._inbox[src].put(_DEPARTED)
            raise PeerLostError(f"Rank {self.rank}: rank {src} ({self.addresses[src]}) closed its reducer "
                                "while this collective still needed it")
        got = int.from_bytes(data[1:_HEADER], "little")
        if got != tag:
            raise RuntimeError(f"ring protocol error: rank {self.rank} expected collective #{tag} from rank {src}, got #{got}")
        return memoryview(data)[_HEADER:]

    def wake_all(self) -> None:
        """Unblock every ``recv_data`` (used when the job aborts)."""
        for q in self._inbox.values():
            q.put(None)
