"""Authenticated gRPC connections between every pair of ranks.

Each rank serves one gRPC service on the address the cluster spec gives it (and only
there) and opens one long-lived client stream to every peer. Frames on a stream are
``kind (1 byte) | tag (8 bytes) | payload``; data frames are queued per source for the
ring, control frames (and announcements that carry small tensors' data) are handed to
callbacks as they arrive. A stream that ends
without a goodbye frame means the peer died: ``on_peer_lost`` fires at once. A rank
that fails (an unhandled exception, a port it cannot listen on) sends a failure frame
naming its error first, so that its peers can say why.

Peers prove membership of the job with the shared secret (see ``auth``) before any
frame is accepted. A refused connection (a bad proof, a malformed handshake) is logged
with the caller's address and otherwise ignored: a stranger cannot end the job, and
only the connect timeout, whose message lists the refusals, ends a start-up that a
real peer never joined.
"""
from __future__ import annotations

import json
import logging
import queue
import re
import threading
import time
from concurrent import futures
from typing import Any, Callable, Iterator

import numpy as np

from ...errors import AuthenticationError, ClusterError, PeerLostError
from . import auth

__all__ = ["GrpcMesh", "RingLink", "DATA", "CTL", "ABORT", "BYE", "ANNOUNCE", "FAILED", "encode_announcement",
           "decode_announcement"]

log = logging.getLogger("hostreduce.ring")

DATA, CTL, ABORT, BYE, ANNOUNCE, FAILED = 1, 2, 3, 4, 5, 6
_SERVICE = "hostreduce.Peer"
_DEPARTED = b"departed"
_HEADER = 9
# A handshake is a small JSON object; anything larger is refused before it is parsed.
_MAX_HELLO_BYTES = 1024
_NONCE_RE = re.compile(r"[0-9a-f]{32}")
# Say once that a peer is missing after this long (a normal start-up takes < 1 s).
_WAIT_NOTICE_S = 5.0
# How long a rank that cannot listen keeps trying to tell its peers why it stops.
_FAREWELL_S = 5.0
# Refusals logged one by one; after that every _LOG_EVERY-th, with the count.
_LOG_FIRST, _LOG_EVERY = 10, 100


def _short(value: Any, limit: int = 60) -> str:
    try:
        text = repr(value)
    except RecursionError:
        return "<nested too deeply>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


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
        # Peers start at different moments: retry a refused connection every 0.1-1 s, not
        # on gRPC's default backoff (1 s growing to 120 s), so a late peer is seen soon.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
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
        self._refusals = 0
        self._refused: dict[int, tuple[int, str]] = {}  # claimed rank -> (count, last reason)
        self._lost: dict[int, str] = {}                  # peers lost or failed, and why
        self._failed: set[int] = set()                   # ranks known to have failed, also by hearsay
        self._last_frame: dict[int, float] = {}
        self._goodbye: set[int] = set()
        self._cond = threading.Condition()
        self._closing = False
        self._closed = False
        self._server: Any = None
        self._started = time.monotonic()
        self._connect_timeout = 0.0
        self._waited = False  # whether the missing-peer notice was logged

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
            while not self._closing and len(self._incoming) < self.size - 1:
                self._raise_if_lost()
                missing = sorted(set(range(self.size)) - self._incoming - {self.rank})
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
        refused = {p: v for p, v in self._refused.items() if p in missing}
        text = (f"Rank {self.rank}: {where} {what} within connect_timeout_s={self._connect_timeout} "
                "(HOSTREDUCE_CONNECT_TIMEOUT_S)")
        if refused:
            raise AuthenticationError(
                text + "; meanwhile this rank refused "
                + "; ".join(f"{n} connection(s) that claimed to be rank {p} ({why})" for p, (n, why) in refused.items())
                + ". Every worker needs the same HOSTREDUCE_SECRET."
            )
        if self._refusals:
            text += f"; meanwhile this rank refused {self._refusals} connection(s) that failed the handshake"
        raise ClusterError(text)

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
        hello = channel.unary_unary(f"/{_SERVICE}/Hello")
        my_nonce = auth.new_nonce()
        request = json.dumps({"rank": self.rank, "nonce": my_nonce}).encode()
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
        try:
            reply = json.loads(raw)
            server_nonce = reply["nonce"]
            if not (isinstance(server_nonce, str) and _NONCE_RE.fullmatch(server_nonce)):
                raise ValueError("bad nonce")
        except (ValueError, KeyError, TypeError, RecursionError):
            raise AuthenticationError(
                f"Rank {self.rank}: the process at {addr!r} answered the handshake with {_short(raw)}; it is not "
                f"rank {peer} of this job") from None
        server_ok = reply.get("rank") == peer and auth.verify(
            self._secret, "server", my_nonce, peer, self.rank, str(reply.get("proof", "")))
        proof = auth.prove(self._secret, "client", server_nonce, self.rank, peer)
        out: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox[peer] = out
        stream = channel.stream_unary(f"/{_SERVICE}/Stream")
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

    # ------------------------------------------------------------------ server side
    def _hello(self, request: bytes, context: Any) -> bytes:
        try:
            client_rank, client_nonce = self._parse_hello(request)
        except ValueError as e:
            import grpc

            self._refuse(context.peer(), None, f"malformed handshake: {e}")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed handshake")
        proof = auth.prove(self._secret, "server", client_nonce, self.rank, client_rank)
        return json.dumps({"rank": self.rank, "nonce": self._nonces.issue(), "proof": proof}).encode()

    def _parse_hello(self, request: bytes) -> tuple[int, str]:
        """The claimed rank and nonce of a handshake; ValueError for anything else."""
        if len(request) > _MAX_HELLO_BYTES:
            raise ValueError(f"{len(request)} bytes (at most {_MAX_HELLO_BYTES})")
        try:
            req = json.loads(request)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"not JSON ({type(e).__name__})") from None
        if not isinstance(req, dict):
            raise ValueError(f"not a JSON object: {_short(req)}")
        rank, nonce = req.get("rank"), req.get("nonce")
        if type(rank) is not int or not 0 <= rank < self.size or rank == self.rank:
            raise ValueError(f"invalid rank {_short(rank)}")
        if not (isinstance(nonce, str) and _NONCE_RE.fullmatch(nonce)):
            raise ValueError(f"invalid nonce {_short(nonce)}")
        return rank, nonce

    def _refuse(self, peer: str, claimed: int | None, why: str) -> None:
        """Log a refused connection (rate-limited) and remember it for the connect timeout."""
        with self._cond:
            self._refusals += 1
            n = self._refusals
            if claimed is not None and claimed not in self._incoming:
                count = self._refused.get(claimed, (0, ""))[0] + 1
                self._refused[claimed] = (count, f"{why}, last from {peer}")
        if n <= _LOG_FIRST or n % _LOG_EVERY == 0:
            more = f" ({n} refused so far)" if n > _LOG_FIRST else ""
            log.warning("rank %d: refused connection from %s%s: %s%s", self.rank, peer,
                        "" if claimed is None else f" (claimed rank {claimed})", why, more)

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
            why = "wrong or missing shared secret" if valid_rank else f"invalid rank {_short(src)}"
            self._refuse(context.peer(), src if valid_rank else None, why)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"rank {self.rank}: {why}")
        with self._cond:
            self._incoming.add(src)
            self._cond.notify_all()
        inbox = self._inbox[src]
        last = self._last_frame
        last[src] = time.monotonic()
        try:
            for frame in frames:
                last[src] = time.monotonic()
                kind = frame[0]
                if kind == DATA:
                    inbox.put(frame)
                elif kind == CTL:
                    self._on_ctl(src, frame[_HEADER:])
                elif kind == ANNOUNCE and self._on_announce is not None:
                    self._on_announce(src, memoryview(frame)[_HEADER:])
                elif kind == ABORT:
                    self._peer_lost(src, "aborted: " + self._read_failure(frame))
                elif kind == FAILED:
                    self._peer_lost(src, f"rank {src} ({self.addresses[src]}) failed: " + self._read_failure(frame))
                elif kind == BYE:
                    with self._cond:
                        self._goodbye.add(src)
                    inbox.put(_DEPARTED)  # after every data frame it sent
                    if self._on_departed is not None:
                        self._on_departed(src)
            ended = "closed its connection to this rank without saying goodbye"
        except Exception as e:  # the transport raises when the peer's process dies
            detail = e.details() if hasattr(e, "details") else str(e)
            ended = "stopped answering: its connection to this rank dropped" + (f" ({detail})" if detail else "")
        if src not in self._goodbye and not self._closing:
            self._peer_lost(src, f"rank {src} ({self.addresses[src]}) {ended} (its process ended, or the network "
                                 f"failed); last heard from {time.monotonic() - last[src]:.1f} s before")
        return b""

    def _failure_payload(self, reason: str) -> bytes:
        # The ranks known to have failed travel along, so that a rank that stops in turn
        # does not spend its farewell on trying to reach them.
        return json.dumps({"why": reason, "failed": sorted(self._failed | set(self._lost) | {self.rank})}).encode()

    def _read_failure(self, frame: bytes) -> str:
        try:
            msg = json.loads(frame[_HEADER:])
            self._failed.update(r for r in msg["failed"] if type(r) is int)
            return str(msg["why"])
        except (ValueError, KeyError, TypeError, RecursionError):
            return bytes(frame[_HEADER:]).decode(errors="replace")

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
                why = f"became unreachable ({e.code().name}: {e.details() or 'no detail'})"
        except Exception as e:  # pragma: no cover - cancelled futures and the like
            why = f"connection failed ({type(e).__name__})"
        since = self._last_frame.get(peer)
        if since is not None:
            why += f"; last heard from {time.monotonic() - since:.1f} s before"
        self._peer_lost(peer, f"rank {peer} ({self.addresses[peer]}) {why}")

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
        payload = self._failure_payload(reason)
        for peer, out in self._outbox.items():
            out.put(_frame(ABORT, 0, payload))

    def broadcast_failure(self, reason: str) -> None:
        """Tell every peer that this rank failed with ``reason`` (before a non-graceful close)."""
        payload = self._failure_payload(reason)
        for peer, out in self._outbox.items():
            out.put(_frame(FAILED, 0, payload))

    def close(self, graceful: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
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
