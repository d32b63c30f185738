"""Authenticated gRPC connections between every pair of ranks.

Each rank serves one gRPC service on the address the cluster spec gives it (and only
there) and opens one long-lived client stream to every peer. Frames on a stream are
``kind (1 byte) | tag (8 bytes) | payload``; data frames are queued per source for the
ring, control frames (and announcements that carry small tensors' data) are handed to
callbacks as they arrive. A stream that ends
without a goodbye frame means the peer died: ``on_peer_lost`` fires at once.

Peers prove membership of the job with the shared secret (see ``auth``) before any
frame is accepted; a refused connection is logged with the caller's address.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from concurrent import futures
from typing import Any, Callable, Iterator

import numpy as np

from ...errors import AuthenticationError, ClusterError, PeerLostError
from . import auth

__all__ = ["GrpcMesh", "RingLink", "DATA", "CTL", "ABORT", "BYE", "ANNOUNCE", "encode_announcement",
           "decode_announcement"]

log = logging.getLogger("hostreduce.ring")

DATA, CTL, ABORT, BYE, ANNOUNCE = 1, 2, 3, 4, 5
_SERVICE = "hostreduce.Peer"
_DEPARTED = b"departed"
_HEADER = 9


def _frame(kind: int, tag: int, payload: bytes | np.ndarray = b"") -> bytes:
    head = bytes((kind,)) + int(tag).to_bytes(8, "little")
    if isinstance(payload, np.ndarray):
        payload = memoryview(np.ascontiguousarray(payload).reshape(-1).view(np.uint8))
    return b"".join((head, payload))


def encode_announcement(entries: list[dict]) -> bytes:
    """Announced entries as JSON, then the bytes of each entry's ``_data`` array (small
    all-reduces sent along), in order; the JSON marks those entries ``inline``."""
    meta, blobs = [], []
    for e in entries:
        m = {k: v for k, v in e.items() if k != "_data"}
        if "_data" in e:
            m["inline"] = True
            blobs.append(memoryview(np.ascontiguousarray(e["_data"]).reshape(-1).view(np.uint8)))
        meta.append(m)
    head = json.dumps(meta).encode()
    return b"".join([len(head).to_bytes(4, "little"), head, *blobs])


def decode_announcement(payload: memoryview) -> list[dict]:
    """The entries of ``encode_announcement``, each inline one with ``_data`` (a view)."""
    n = int.from_bytes(payload[:4], "little")
    entries = json.loads(bytes(payload[4:4 + n]))
    off = 4 + n
    for e in entries:
        if e.pop("inline", False):
            e["_data"] = payload[off:off + int(e["nbytes"])]
            off += int(e["nbytes"])
    if off != len(payload):
        raise ValueError(f"announcement of {len(payload)} bytes does not match its entries")
    return entries


def _channel_options(timeout_s: float) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", -1),
        ("grpc.max_receive_message_length", -1),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", 5000),
        ("grpc.keepalive_timeout_ms", int(max(1.0, timeout_s) * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Accept the peer's keepalive pings on idle connections instead of closing the
        # connection with "too many pings" (peers may exchange no data for a long time).
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 4000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.enable_retries", 0),
        ("grpc.http2.lookahead_bytes", 16 << 20),
    ]


class GrpcMesh:
    """Full mesh of authenticated streams. Thread-safe ``send``; per-source ``recv``."""

    def __init__(self, rank: int, addresses: tuple[str, ...], secret: str, *, bind_host: str = "",
                 timeout_s: float = 30.0, on_ctl: Callable[[int, bytes], None],
                 on_peer_lost: Callable[[int, str], None],
                 on_departed: Callable[[int], None] | None = None,
                 on_announce: Callable[[int, memoryview], None] | None = None) -> None:
        self.rank = rank
        self.size = len(addresses)
        self.addresses = addresses
        self._secret = secret
        self._bind_host = bind_host
        self._timeout = timeout_s
        self._on_ctl = on_ctl
        self._on_peer_lost = on_peer_lost
        self._on_departed = on_departed
        self._on_announce = on_announce
        self._nonces = auth.NonceBook()
        self._inbox: dict[int, queue.SimpleQueue] = {p: queue.SimpleQueue() for p in range(self.size)}
        self._outbox: dict[int, queue.SimpleQueue] = {}
        self._calls: dict[int, Any] = {}
        self._channels: list[Any] = []
        self._incoming: set[int] = set()
        self._refused: dict[int, str] = {}
        self._goodbye: set[int] = set()
        self._cond = threading.Condition()
        self._closing = False
        self._server: Any = None

    # ------------------------------------------------------------------ start-up
    def start(self, connect_timeout_s: float) -> None:
        import grpc

        host, port = self.addresses[self.rank].rsplit(":", 1)
        bind = f"{self._bind_host or host}:{port}"
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=2 * self.size + 4, thread_name_prefix="hostreduce-rx"),
            options=_channel_options(self._timeout),
        )
        handler = grpc.method_handlers_generic_handler(_SERVICE, {
            "Hello": grpc.unary_unary_rpc_method_handler(self._hello),
            "Stream": grpc.stream_unary_rpc_method_handler(self._stream),
        })
        self._server.add_generic_rpc_handlers((handler,))
        try:
            bound = self._server.add_insecure_port(bind)
        except RuntimeError as e:
            raise ClusterError(f"Rank {self.rank} cannot listen on {bind!r}: {e}") from None
        if not bound:
            raise ClusterError(f"Rank {self.rank} cannot listen on {bind!r} (address in use or not local)")
        self._server.start()
        deadline = time.monotonic() + connect_timeout_s
        for peer in range(self.size):
            if peer != self.rank:
                self._connect(peer, deadline)
        with self._cond:
            while not self._closing and len(self._incoming) < self.size - 1:
                self._raise_if_refused()
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.size)) - self._incoming - {self.rank})
                    raise ClusterError(
                        f"Rank {self.rank}: ranks {missing} ({[self.addresses[m] for m in missing]}) did not "
                        f"connect within connect_timeout_s={connect_timeout_s}"
                    )
                self._cond.wait(min(left, 0.1))

    def _raise_if_refused(self) -> None:
        refused = {p: why for p, why in self._refused.items() if p not in self._incoming}
        if refused:
            raise AuthenticationError(
                f"Rank {self.rank} refused connections that failed the shared-secret check: "
                + "; ".join(f"claimed rank {p}: {why}" for p, why in refused.items())
                + ". Every worker needs the same HOSTREDUCE_SECRET."
            )

    def _connect(self, peer: int, deadline: float) -> None:
        import grpc

        addr = self.addresses[peer]
        channel = grpc.insecure_channel(addr, options=_channel_options(self._timeout))
        self._channels.append(channel)
        hello = channel.unary_unary(f"/{_SERVICE}/Hello")
        my_nonce = auth.new_nonce()
        request = json.dumps({"rank": self.rank, "nonce": my_nonce}).encode()
        while True:
            self._raise_if_refused()
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClusterError(f"Rank {self.rank} could not reach rank {peer} at {addr!r} within the connect timeout")
            try:
                reply = json.loads(hello(request, timeout=min(left, 1.0), wait_for_ready=True))
                break
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise ClusterError(f"Rank {self.rank}: handshake with rank {peer} at {addr!r} failed: {e.details()}") from None
                time.sleep(0.05)
                continue
        server_ok = reply.get("rank") == peer and auth.verify(
            self._secret, "server", my_nonce, peer, self.rank, reply.get("proof", ""))
        proof = auth.prove(self._secret, "client", reply["nonce"], self.rank, peer)
        out: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox[peer] = out
        stream = channel.stream_unary(f"/{_SERVICE}/Stream")
        call = stream.future(self._frames(out), metadata=(
            ("hr-rank", str(self.rank)), ("hr-nonce", reply["nonce"]), ("hr-proof", proof)))
        call.add_done_callback(lambda f, p=peer: self._outgoing_done(p, f))
        self._calls[peer] = call
        if not server_ok:
            raise AuthenticationError(
                f"Rank {self.rank}: the process at {addr!r} failed to prove it is rank {peer} of this job "
                "(its HOSTREDUCE_SECRET differs from ours, or it belongs to another job)"
            )

    @staticmethod
    def _frames(out: queue.SimpleQueue) -> Iterator[bytes]:
        while True:
            item = out.get()
            if item is None:
                return
            yield item

    # ------------------------------------------------------------------ server side
    def _hello(self, request: bytes, context: Any) -> bytes:
        try:
            req = json.loads(request)
            client_rank, client_nonce = int(req["rank"]), str(req["nonce"])
        except (ValueError, KeyError, TypeError):
            log.warning("rank %d: refused a malformed handshake from %s", self.rank, context.peer())
            import grpc
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed handshake")
        proof = auth.prove(self._secret, "server", client_nonce, self.rank, client_rank)
        return json.dumps({"rank": self.rank, "nonce": self._nonces.issue(), "proof": proof}).encode()

    def _stream(self, frames: Iterator[bytes], context: Any) -> bytes:
        import grpc

        meta = dict(context.invocation_metadata())
        try:
            src = int(meta.get("hr-rank", "-1"))
        except ValueError:
            src = -1
        nonce, proof = meta.get("hr-nonce", ""), meta.get("hr-proof", "")
        valid_rank = 0 <= src < self.size and src != self.rank
        if not (valid_rank and self._nonces.redeem(nonce)
                and auth.verify(self._secret, "client", nonce, src, self.rank, proof)):
            why = "wrong or missing shared secret" if valid_rank else f"invalid rank {src}"
            log.warning("rank %d: refused connection from %s (claimed rank %s): %s",
                        self.rank, context.peer(), src, why)
            with self._cond:
                if valid_rank and src not in self._incoming:
                    self._refused[src] = f"{why} (from {context.peer()})"
                self._cond.notify_all()
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"rank {self.rank}: {why}")
        with self._cond:
            self._incoming.add(src)
            self._cond.notify_all()
        inbox = self._inbox[src]
        try:
            for frame in frames:
                kind = frame[0]
                if kind == DATA:
                    inbox.put(frame)
                elif kind == CTL:
                    self._on_ctl(src, frame[_HEADER:])
                elif kind == ANNOUNCE and self._on_announce is not None:
                    self._on_announce(src, memoryview(frame)[_HEADER:])
                elif kind == ABORT:
                    self._on_peer_lost(src, "aborted: " + frame[_HEADER:].decode(errors="replace"))
                elif kind == BYE:
                    with self._cond:
                        self._goodbye.add(src)
                    inbox.put(_DEPARTED)  # after every data frame it sent
                    if self._on_departed is not None:
                        self._on_departed(src)
            ended = "closed its connection without saying goodbye"
        except Exception as e:  # the transport raises when the peer's process dies
            detail = e.details() if hasattr(e, "details") else str(e)
            ended = f"connection broke ({type(e).__name__}: {detail})"
        if src not in self._goodbye and not self._closing:
            self._on_peer_lost(src, f"rank {src} ({self.addresses[src]}) {ended}")
        return b""

    def _outgoing_done(self, peer: int, call: Any) -> None:
        # Give the peer's goodbye (or the report from our incoming stream, which says
        # more) a moment to arrive before declaring the peer lost from this side.
        timer = threading.Timer(0.5, self._outgoing_lost, args=(peer, call))
        timer.daemon = True
        timer.start()

    def _outgoing_lost(self, peer: int, call: Any) -> None:
        if self._closing or peer in self._goodbye:
            return
        import grpc

        try:
            call.result()
            why = "ended the connection"
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                why = f"refused our connection: {e.details()} (HOSTREDUCE_SECRET differs between ranks)"
            else:
                why = f"became unreachable ({e.code().name}: {e.details()})"
        except Exception as e:  # pragma: no cover - cancelled futures and the like
            why = f"connection failed ({type(e).__name__})"
        self._on_peer_lost(peer, f"rank {peer} ({self.addresses[peer]}) {why}")

    # ------------------------------------------------------------------ traffic
    def send(self, dst: int, kind: int, tag: int, payload: bytes | np.ndarray = b"") -> None:
        self._outbox[dst].put(_frame(kind, tag, payload))

    def recv_data(self, src: int, tag: int, timeout: float) -> memoryview:
        """Next data frame from ``src``; raises PeerLostError on a wake-up sentinel or timeout."""
        try:
            frame = self._inbox[src].get(timeout=timeout)
        except queue.Empty:
            raise PeerLostError(
                f"Rank {self.rank}: no data from rank {src} ({self.addresses[src]}) for {timeout} s "
                "(the peer is hung or unreachable)"
            ) from None
        if frame is None:
            raise PeerLostError(f"Rank {self.rank}: stopped waiting for rank {src}: the job is aborting")
        if frame is _DEPARTED:
            self._inbox[src].put(_DEPARTED)
            raise PeerLostError(f"Rank {self.rank}: rank {src} ({self.addresses[src]}) closed its reducer "
                                "while this collective still needed it")
        got = int.from_bytes(frame[1:_HEADER], "little")
        if got != tag:
            raise RuntimeError(f"ring protocol error: rank {self.rank} expected collective #{tag} from rank {src}, got #{got}")
        return memoryview(frame)[_HEADER:]

    def wake_all(self) -> None:
        """Unblock every ``recv_data`` (used when the job aborts)."""
        for q in self._inbox.values():
            q.put(None)

    def broadcast_abort(self, reason: str) -> None:
        for peer, out in self._outbox.items():
            out.put(_frame(ABORT, 0, reason.encode()))

    def close(self, graceful: bool = True) -> None:
        self._closing = True
        for out in self._outbox.values():
            if graceful:
                out.put(_frame(BYE, 0))
            out.put(None)
        for call in self._calls.values():
            try:
                call.result(timeout=2.0)
            except Exception:
                pass
        for channel in self._channels:
            channel.close()
        if self._server is not None:
            self._server.stop(grace=0.5).wait(2.0)
        self.wake_all()


class RingLink:
    """The algorithms' view of the mesh: send to the next rank and receive from the
    previous one (the ring), or to and from any rank (rank 0's small all-reduces)."""

    def __init__(self, mesh: GrpcMesh, nxt: int, prev: int, timeout: float) -> None:
        self._mesh, self._next, self._prev, self._timeout = mesh, nxt, prev, timeout

    def send(self, tag: int, data: np.ndarray) -> None:
        self._mesh.send(self._next, DATA, tag, data)

    def recv(self, tag: int) -> memoryview:
        return self._mesh.recv_data(self._prev, tag, self._timeout)

    def send_to(self, dst: int, tag: int, data: np.ndarray) -> None:
        self._mesh.send(dst, DATA, tag, data)

    def recv_from(self, src: int, tag: int) -> memoryview:
        return self._mesh.recv_data(src, tag, self._timeout)
