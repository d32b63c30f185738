"""Authenticated gRPC connections between every pair of ranks.

Each rank serves one gRPC service on the address the cluster spec gives it (and only
there; ``grpc_inbound.py`` serves it) and opens one long-lived client stream to every
peer, on which it sends frames from any thread. The mesh is up when this rank has
connected to every peer and every peer has connected to it. A rank that fails (an
unhandled exception, a port it cannot listen on) sends a failure frame naming its error
first, so that its peers can say why; a peer lost either way, or an outgoing stream
that breaks, is reported at once (``on_peer_lost``).

Peers prove membership of the job with the shared secret (``admission.py``) before any
frame is accepted. A refused connection (a bad proof, a malformed handshake) is logged
with the caller's address and otherwise ignored: a stranger cannot end the job, and
only the connect timeout, whose message lists the refusals, ends a start-up that a
real peer never joined.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent import futures
from typing import Any, Callable, Iterator

import numpy as np

from ...errors import AuthenticationError, ClusterError, PeerLostError
from ...transport import admission, auth
from ...transport.grpc_options import grpc_options
from .grpc_inbound import ABORT, BYE, CTL, DATA, FAILED, SERVICE, Inbound, frame
from .messages import PeerFailure, encode

__all__ = ["GrpcMesh", "RingLink", "DATA", "CTL", "ABORT", "BYE", "FAILED"]

log = logging.getLogger("hostreduce.ring")

# Say once that a peer is missing after this long (a normal start-up takes < 1 s).
_WAIT_NOTICE_S = 5.0
# How long a rank that cannot listen keeps trying to tell its peers why it stops.
_FAREWELL_S = 5.0


def _channel_options(timeout_s: float) -> list[tuple[str, Any]]:
    # A 16 MiB flow-control window: the ring streams large chunks to each peer.
    return grpc_options(timeout_s) + [("grpc.http2.lookahead_bytes", 16 << 20)]


class GrpcMesh:
    """Full mesh of authenticated streams. Thread-safe ``send``; per-source ``recv``."""

    def __init__(self, rank: int, addresses: tuple[str, ...], secret: str, *, bind_host: str = "",
                 timeout_s: float = 30.0, on_message: Callable[[int, memoryview], None],
                 on_peer_lost: Callable[[int, str], None],
                 on_departed: Callable[[int], None] | None = None) -> None:
        self.rank = rank
        self.size = len(addresses)
        self.addresses = addresses
        self._secret = secret
        self._bind_host = bind_host
        self._timeout = timeout_s
        self._on_peer_lost = on_peer_lost
        self._cond = threading.Condition()
        self._outbox: dict[int, queue.SimpleQueue] = {}
        self._calls: dict[int, Any] = {}
        self._channels: list[Any] = []
        self._lost: dict[int, str] = {}                  # peers lost or failed, and why
        self._failed: set[int] = set()                   # ranks known to have failed, also by hearsay
        self._closing = False
        self._in = Inbound(rank, addresses, secret, self._cond, on_message=on_message, on_lost=self._peer_lost,
                           on_failed=self._failed.update, closing=lambda: self._closing, on_departed=on_departed)
        self._closed = False
        self._server: Any = None
        self._started = time.monotonic()
        self._connect_timeout = 0.0
        self._waited = False  # whether the missing-peer notice was logged
        self._data: Any = None  # the data connections on the ``tcp`` data path

    # ------------------------------------------------------------------ start-up
    def start(self, connect_timeout_s: float) -> None:
        import grpc

        host, port = self.addresses[self.rank].rsplit(":", 1)
        bind = f"{self._bind_host or host}:{port}"
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=2 * self.size + 4, thread_name_prefix="hostreduce-rx"),
            options=_channel_options(self._timeout),
        )
        self._server.add_generic_rpc_handlers((self._in.handler(),))
        try:
            bound = self._server.add_insecure_port(bind)
        except RuntimeError as e:
            bound, why = 0, str(e)
        else:
            why = "address in use or not local"
        self._connect_timeout = connect_timeout_s
        if not bound:
            error = ClusterError(f"Rank {self.rank} cannot listen on {bind!r}: the port is taken or the address is "
                                 f"not local ({why}); every worker needs a free port of its own at its address in "
                                 "the cluster spec")
            self._farewell(str(error), min(connect_timeout_s, _FAREWELL_S))
            raise error
        self._server.start()
        self._started = time.monotonic()
        try:
            self._join(self._started + connect_timeout_s)
        except PeerLostError as e:
            # Peers that are not connected yet would otherwise wait for this rank until
            # their connect timeout: tell them why the job stops.
            self._farewell(str(e), min(connect_timeout_s, _FAREWELL_S))
            raise

    def _join(self, deadline: float) -> None:
        for peer in range(self.size):
            if peer != self.rank:
                self._connect(peer, deadline)
        with self._cond:
            while not self._closing and len(self._in.incoming) < self.size - 1:
                self._raise_if_lost()
                missing = sorted(set(range(self.size)) - self._in.incoming - {self.rank})
                left = deadline - time.monotonic()
                if left <= 0:
                    self._raise_connect_timeout(missing, "did not connect to it")
                self._notice_wait(missing)
                self._cond.wait(min(left, 0.1))

    def _raise_if_lost(self) -> None:
        """During start-up: a peer that failed (it said why, or its connection broke)
        ends the start-up at once on this rank too."""
        if self._lost:
            raise PeerLostError(f"Rank {self.rank}: " + "; ".join(self._lost.values()))

    def _raise_connect_timeout(self, missing: list[int], what: str) -> None:
        where = ", ".join(f"rank {m} at {self.addresses[m]!r}" for m in missing)
        raise self._in.refusals.timeout_error(
            f"Rank {self.rank}: {where} {what} within connect_timeout_s={self._connect_timeout} "
            "(HOSTREDUCE_CONNECT_TIMEOUT_S)", missing)

    def _notice_wait(self, missing: list[int]) -> None:
        """Say once, a few seconds into the start-up, which peers this rank waits for."""
        if self._waited or not missing or time.monotonic() - self._started < _WAIT_NOTICE_S:
            return
        self._waited = True
        log.warning("rank %d: waiting for %s; the job fails if %s not joined within connect_timeout_s=%g s "
                    "(HOSTREDUCE_CONNECT_TIMEOUT_S)", self.rank,
                    ", ".join(f"rank {m} at {self.addresses[m]}" for m in missing),
                    "it has" if len(missing) == 1 else "they have", self._connect_timeout)

    def _connect(self, peer: int, deadline: float, *, farewell: bool = False) -> None:
        import grpc

        addr = self.addresses[peer]
        channel = grpc.insecure_channel(addr, options=_channel_options(self._timeout))
        self._channels.append(channel)
        hello = channel.unary_unary(f"/{SERVICE}/Hello")
        my_nonce = auth.new_nonce()
        request = admission.hello_request(self.rank, my_nonce)
        while True:
            if not farewell:
                self._raise_if_lost()
            left = deadline - time.monotonic()
            if left <= 0:
                self._raise_connect_timeout([peer], "did not answer")
            self._notice_wait([peer])
            try:
                raw = hello(request, timeout=min(left, 1.0), wait_for_ready=True)
                break
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise ClusterError(f"Rank {self.rank}: handshake with rank {peer} at {addr!r} failed: {e.details()}") from None
                time.sleep(0.05)
                continue
        server_nonce, server_ok = admission.read_reply(raw, self._secret, self.rank, peer, my_nonce, addr)
        proof = auth.prove(self._secret, "client", server_nonce, self.rank, peer)
        out: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox[peer] = out
        stream = channel.stream_unary(f"/{SERVICE}/Stream")
        call = stream.future(self._frames(out), metadata=(
            ("hr-rank", str(self.rank)), ("hr-nonce", server_nonce), ("hr-proof", proof)))
        call.add_done_callback(lambda f, p=peer: self._outgoing_done(p, f))
        self._calls[peer] = call
        if not server_ok:
            raise AuthenticationError(
                f"Rank {self.rank}: the process at {addr!r} failed to prove it is rank {peer} of this job "
                "(its HOSTREDUCE_SECRET differs from ours, or it belongs to another job)"
            )

    def _farewell(self, reason: str, seconds: float) -> None:
        """This rank cannot take part: connect to every peer that answers within
        ``seconds`` and tell it why, so that peers fail now instead of at their connect
        timeout (they cannot reach this rank at its address)."""
        deadline = time.monotonic() + seconds
        self._waited = True  # no notice about peers this rank no longer waits for

        def tell(peer: int) -> None:
            try:
                if peer not in self._outbox:
                    self._connect(peer, deadline, farewell=True)
                self.send(peer, FAILED, 0, self._failure_payload(reason))
            except Exception as e:  # noqa: BLE001 - best effort; the peer times out instead
                log.debug("rank %d: could not tell rank %d why it stops: %s", self.rank, peer, e)

        threads = [threading.Thread(target=tell, args=(p,), name=f"hostreduce-farewell-{p}", daemon=True)
                   for p in range(self.size) if p != self.rank and p not in set(self._lost) | self._failed]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()) + 1.0)
        self.close(graceful=False)

    @staticmethod
    def _frames(out: queue.SimpleQueue) -> Iterator[bytes]:
        while True:
            item = out.get()
            if item is None:
                return
            yield item

    # ------------------------------------------------------------------ failures
    def _failure_payload(self, reason: str) -> bytes:
        return encode(PeerFailure(self.rank, reason, sorted(self._failed | set(self._lost) | {self.rank})))

    def last_frames(self) -> dict[int, float]:
        """When a frame last came from each peer (``time.monotonic()``)."""
        return self._in.last_frame

    def _peer_lost(self, src: int, why: str) -> None:
        # The owner first (it tells the peers it can reach), then a start-up in progress.
        self._on_peer_lost(src, why)
        with self._cond:
            self._lost.setdefault(src, why)
            self._cond.notify_all()

    def _outgoing_done(self, peer: int, call: Any) -> None:
        # Give the peer's goodbye (or the report from our incoming stream, which says
        # more) a moment to arrive before declaring the peer lost from this side.
        timer = threading.Timer(0.5, self._outgoing_lost, args=(peer, call))
        timer.daemon = True
        timer.start()

    def _outgoing_lost(self, peer: int, call: Any) -> None:
        if self._closing or peer in self._in.goodbye:
            return
        import grpc

        try:
            call.result()
            why = "ended the connection"
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                why = f"refused our connection: {e.details()} (HOSTREDUCE_SECRET differs between ranks)"
            else:
                why = f"became unreachable ({e.code().name}: {e.details() or 'no detail'})"
        except Exception as e:  # pragma: no cover - cancelled futures and the like
            why = f"connection failed ({type(e).__name__})"
        since = self._in.last_frame.get(peer)
        if since is not None:
            why += f"; last heard from {time.monotonic() - since:.1f} s before"
        self._peer_lost(peer, f"rank {peer} ({self.addresses[peer]}) {why}")

    # ------------------------------------------------------------------ traffic
    def data_links(self, links_of: Callable[..., Any]) -> Any:
        """Data frames over connections of their own (``tcp_links.TcpLinks``), made by
        ``links_of(deliver=..., departed=..., on_lost=..., said_goodbye=...)``;
        returned, not in use until :meth:`use_data_links`."""
        return links_of(deliver=self._in.deliver_data, departed=self._in.data_departed, on_lost=self._peer_lost,
                        said_goodbye=lambda src: src in self._in.goodbye or src in self._failed)

    def use_data_links(self, links: Any) -> None:
        """From now on, data frames go over ``links`` (connected to every peer)."""
        self._in.data_elsewhere.update(p for p in range(self.size) if p != self.rank)
        self._data = links

    def send(self, dst: int, kind: int, tag: int, payload: bytes | np.ndarray = b"") -> None:
        if kind == DATA and self._data is not None:
            self._data.send(dst, tag, payload)
            return
        self._outbox[dst].put(frame(kind, tag, payload))

    def recv_data(self, src: int, tag: int, timeout: float) -> memoryview:
        """Next data frame from ``src``; raises PeerLostError on a wake-up sentinel or timeout."""
        return self._in.recv_data(src, tag, timeout)

    def wake_all(self) -> None:
        """Unblock every ``recv_data`` (used when the job aborts)."""
        self._in.wake_all()

    def broadcast_abort(self, reason: str) -> None:
        payload = self._failure_payload(reason)
        for peer, out in self._outbox.items():
            out.put(frame(ABORT, 0, payload))

    def broadcast_failure(self, reason: str) -> None:
        """Tell every peer that this rank failed with ``reason`` (before a non-graceful close)."""
        payload = self._failure_payload(reason)
        for peer, out in self._outbox.items():
            out.put(frame(FAILED, 0, payload))

    def close(self, graceful: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        self._closing = True
        for out in self._outbox.values():
            if graceful:
                out.put(frame(BYE, 0))
            out.put(None)
        for call in self._calls.values():
            try:
                call.result(timeout=2.0)
            except Exception:
                pass
        if self._data is not None:   # after gRPC's goodbyes and failure reports went out
            self._data.close(graceful=graceful)
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
