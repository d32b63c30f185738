"""The ring's data frames over plain TCP connections, one per ordered pair of ranks.

gRPC carries the ring's control messages and, on the ``grpc`` data path, its data too;
grpcio's cost per byte is about three times a plain socket's (``docs/performance.md``).
On the ``tcp`` data path (the default between hosts) each rank opens a listening socket
during the start-up, before it joins, at the address it is told to bind (as its gRPC
server does) on a port the system picks, and says which in its ``Join``; rank 0's
``Welcome`` lists every rank's port. Each rank then connects to every peer once, for
the frames it sends that peer, and accepts one connection from every peer, for the
frames it receives. The listener closes as soon as every peer has connected: no
stranger can reach it after the start-up.

A connection proves job membership before any frame is read, both ways, with the
secret (``transport/auth.py``): the listener sends a fresh nonce; the connecting rank
answers with its rank, a nonce of its own and its proof of the listener's; the listener
checks the proof and answers with its proof of the connecting rank's nonce. Everything
a connection sends before that is fixed-size and bounded; a handshake that does not
finish within :data:`HANDSHAKE_S` of its start is dropped; at most
:data:`_MAX_HANDSHAKES` handshakes run at once (a connection beyond them is closed at
once, and a real peer that meets one tries again until its connect timeout); every
refusal is logged. A connection that proves a rank already connected is refused.

A frame is ``kind (1 byte) | tag (8 bytes) | length (8 bytes) | payload``. The reader
of each incoming connection hands data frames to the mesh's per-source queue exactly as
gRPC's stream does (``grpc_inbound.Inbound``), in order. A goodbye frame follows every
data frame a closing rank sent; a connection that ends without one means the peer died,
which is reported after a moment in which a failure report (or goodbye) over gRPC can
arrive first and say why. A send makes progress or fails within ``timeout_s``; after a
failed send the connection is broken for good (a frame may be cut).
"""
from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from typing import Any, Callable

import numpy as np

from ...errors import AuthenticationError, ClusterError, PeerLostError
from ...transport import admission, auth

__all__ = ["TcpLinks", "HANDSHAKE_S"]

log = logging.getLogger("hostreduce.ring")

DATA, BYE = 1, 4            # the frame kinds gRPC's stream uses for the same frames
_FRAME = struct.Struct("<BQQ")
_RANK = struct.Struct("<I")
_NONCE = 32                 # auth.new_nonce(): 32 hex digits
_PROOF = 64                 # auth.prove(): 64 hex digits
_ROLE_CLIENT, _ROLE_SERVER = "data-client", "data-server"
# How long a connection may take to prove itself (a real peer answers at once).
HANDSHAKE_S = 5.0
# Handshakes in progress at once; a connection beyond them is closed without one.
_MAX_HANDSHAKES = 16
# The largest data frame a member may send (the ring's chunks are ``chunk_bytes``; an
# all-gather's or all-to-all's parts go whole).
_MAX_FRAME = 1 << 34
# How long a connection that ended without a goodbye waits for gRPC to say why.
_REPORT_AFTER_S = 0.5


def _split(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


def _fill(sock: socket.socket, view: memoryview, deadline: float | None = None, cut: str = "connection closed") -> None:
    """Fill ``view`` from ``sock``, all by ``deadline`` (``time.monotonic()``; None: as the
    socket's timeout allows), or raise an OSError (``cut``: what a close in between says)."""
    got, n = 0, len(view)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError(cut)
        got += k


def _read_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes, all by ``deadline`` (``time.monotonic()``), or an OSError."""
    buf = bytearray(n)
    _fill(sock, memoryview(buf), deadline)
    return bytes(buf)


def _send_all(sock: socket.socket, parts: list[Any]) -> None:
    """Every byte of ``parts`` in one ``sendmsg`` where the kernel takes them, with no
    copy; the socket's timeout bounds each wait for room, not the whole send."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while sent:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


class TcpLinks:
    """One rank's TCP data connections. ``deliver(src, frame)`` takes a data frame
    (``kind | tag | payload``, as gRPC's stream gives it); ``departed(src)`` says a peer
    sent its last frame; ``on_lost(src, why)`` reports a peer whose connection broke."""

    def __init__(self, rank: int, addresses: tuple[str, ...], secret: str, *, bind_host: str = "",
                 timeout_s: float, deliver: Callable[[int, bytearray], None], departed: Callable[[int], None],
                 on_lost: Callable[[int, str], None], said_goodbye: Callable[[int], bool],
                 failed: Callable[[], BaseException | None] = lambda: None) -> None:
        self.rank, self.size, self.addresses = rank, len(addresses), addresses
        self._secret = secret
        self._bind_host = bind_host
        self._timeout = timeout_s
        self._deliver, self._departed, self._on_lost, self._said_goodbye = deliver, departed, on_lost, said_goodbye
        self._failed = failed    # the job's error, once it has failed (start-up waits stop on it)
        self._broken: dict[int, BaseException] = {}   # peers whose outgoing connection failed
        self._cond = threading.Condition()
        self._listener: socket.socket | None = None
        self._incoming: dict[int, socket.socket] = {}
        self._outgoing: dict[int, socket.socket] = {}
        self._send_locks = {p: threading.Lock() for p in range(self.size)}
        self._handshakes = 0
        self._closing = False
        self.refusals = admission.Refusals(rank, name=f"rank {rank} (data links)")
        self.port = 0

    # ------------------------------------------------------------------ start-up
    def listen(self) -> int:
        """Open the listening socket (once); return its port."""
        if self.port:
            return self.port
        host = (self._bind_host or _split(self.addresses[self.rank])[0]).strip("[]")
        try:
            family, kind, proto, _, where = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM,
                                                               flags=socket.AI_PASSIVE)[0]
            listener = socket.socket(family, kind, proto)
            listener.bind(where)
            listener.listen(2 * self.size + 8)
        except OSError as e:
            raise ClusterError(f"Rank {self.rank} cannot listen for data connections on {host!r}: {e}. The `tcp` "
                               "data path needs a port of the system's choosing at that address; "
                               "HOSTREDUCE_TRANSPORT=grpc sends the data over the gRPC port instead") from None
        self._listener = listener
        self.port = listener.getsockname()[1]
        threading.Thread(target=self._accept, name=f"hostreduce-data-accept-{self.rank}", daemon=True).start()
        return self.port

    def connect(self, ports: list[int], deadline: float) -> None:
        """Connect to every peer's listener and wait until every peer has connected to
        this rank's; then close the listener. Raises at ``deadline``."""
        if len(ports) != self.size:
            raise ClusterError(f"Rank {self.rank}: the start-up listed {len(ports)} data ports for {self.size} ranks")
        for peer in range(self.size):
            if peer != self.rank:
                self._connect(peer, int(ports[peer]), deadline)
        with self._cond:
            while len(self._incoming) < self.size - 1:
                self._raise_if_failed()
                left = deadline - time.monotonic()
                missing = sorted(set(range(self.size)) - set(self._incoming) - {self.rank})
                if left <= 0:
                    raise self.refusals.timeout_error(
                        "Rank {}: the data connections of {} did not arrive in time (connect_timeout_s, "
                        "HOSTREDUCE_CONNECT_TIMEOUT_S)".format(
                            self.rank, ", ".join(f"rank {m} ({self.addresses[m]})" for m in missing)), missing)
                self._cond.wait(min(left, 0.1))
        self._stop_listening()

    def _raise_if_failed(self) -> None:
        error = self._failed()
        if error is not None:
            raise error

    def _connect(self, peer: int, port: int, deadline: float) -> None:
        host = _split(self.addresses[peer])[0]
        where = f"{host}:{port}"
        why = "no answer"
        while True:
            self._raise_if_failed()
            if time.monotonic() >= deadline:
                raise ClusterError(f"Rank {self.rank}: could not open the data connection to rank {peer} at "
                                   f"{where!r} in time (connect_timeout_s, HOSTREDUCE_CONNECT_TIMEOUT_S; last: {why}). "
                                   "A firewall between the hosts may allow only the workers' own ports: "
                                   "HOSTREDUCE_TRANSPORT=grpc sends the data there")
            try:
                sock = socket.create_connection((host, port), timeout=max(0.1, min(deadline - time.monotonic(),
                                                                                   HANDSHAKE_S)))
            except OSError as e:
                why = str(e)
                time.sleep(0.05)
                continue
            shake = min(deadline, time.monotonic() + HANDSHAKE_S)
            try:
                server_nonce = _read_exact(sock, _NONCE, shake).decode("ascii", "replace")
            except (OSError, ConnectionError) as e:
                # Closed before its nonce: its handshakes are all taken (strangers); again.
                sock.close()
                why = f"closed before the handshake ({e})"
                time.sleep(0.05)
                continue
            mine = auth.new_nonce()
            try:
                sock.sendall(_RANK.pack(self.rank) + mine.encode()
                             + auth.prove(self._secret, _ROLE_CLIENT, server_nonce, self.rank, peer).encode())
                answer = _read_exact(sock, _PROOF, shake).decode("ascii", "replace")
            except ConnectionError:
                sock.close()
                raise AuthenticationError(
                    f"Rank {self.rank}: rank {peer} at {where!r} refused this rank's proof of membership: its "
                    "HOSTREDUCE_SECRET differs from ours, or it belongs to another job") from None
            except OSError as e:
                sock.close()
                raise ClusterError(f"Rank {self.rank}: rank {peer} at {where!r} did not finish the data "
                                   f"connection's handshake ({e})") from None
            break
        if not auth.verify(self._secret, _ROLE_SERVER, mine, peer, self.rank, answer):
            sock.close()
            raise AuthenticationError(f"Rank {self.rank}: the process at {where!r} failed to prove it is rank {peer} "
                                      "of this job (its HOSTREDUCE_SECRET differs from ours)")
        sock.settimeout(self._timeout)   # a send that a hung peer does not take fails in time
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._outgoing[peer] = sock

    def _accept(self) -> None:
        listener = self._listener
        while listener is not None:
            try:
                sock, addr = listener.accept()
            except OSError:
                return  # closed
            who = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            with self._cond:
                busy = self._handshakes >= _MAX_HANDSHAKES
                if not busy:
                    self._handshakes += 1
            if busy:
                sock.close()
                self._refuse(who, None, f"more than {_MAX_HANDSHAKES} handshakes at once")
                continue
            threading.Thread(target=self._handshake, args=(sock, who), name=f"hostreduce-data-hello-{self.rank}",
                             daemon=True).start()

    def _handshake(self, sock: socket.socket, who: str) -> None:
        claimed: int | None = None
        deadline = time.monotonic() + HANDSHAKE_S
        try:
            nonce = auth.new_nonce()
            sock.settimeout(HANDSHAKE_S)
            sock.sendall(nonce.encode())
            hello = _read_exact(sock, _RANK.size + _NONCE + _PROOF, deadline)
            claimed = _RANK.unpack_from(hello)[0]
            theirs = hello[_RANK.size:_RANK.size + _NONCE].decode("ascii", "replace")
            proof = hello[_RANK.size + _NONCE:].decode("ascii", "replace")
            if not 0 <= claimed < self.size or claimed == self.rank:
                why, claimed = f"claimed rank {admission.short(claimed)} is not a peer of this job", None
            elif not auth.verify(self._secret, _ROLE_CLIENT, nonce, claimed, self.rank, proof):
                why = "bad proof of membership (HOSTREDUCE_SECRET differs, or another job)"
            else:
                with self._cond:
                    why = ("this rank is closing" if self._closing
                           else f"rank {claimed} is already connected" if claimed in self._incoming else "")
                    if not why:
                        self._incoming[claimed] = sock
                if not why:
                    sock.sendall(auth.prove(self._secret, _ROLE_SERVER, theirs, self.rank, claimed).encode())
                    sock.settimeout(None)   # the peer's liveness is watched over gRPC
                    with self._cond:
                        self._cond.notify_all()
            if why:
                sock.close()
                self._refuse(who, claimed, why)
                return
        except (OSError, ConnectionError, UnicodeError) as e:
            sock.close()
            with self._cond:
                if claimed is not None and self._incoming.get(claimed) is sock:
                    del self._incoming[claimed]
            self._refuse(who, claimed, f"handshake failed ({type(e).__name__}: {e})")
            return
        finally:
            with self._cond:
                self._handshakes -= 1
        assert claimed is not None
        self._read(claimed, sock)

    def _refuse(self, who: str, claimed: int | None, why: str) -> None:
        with self._cond:
            connected = set(self._incoming)
        self.refusals.refuse(who, claimed, why, connected)

    def _stop_listening(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()

    # ------------------------------------------------------------------ traffic
    def _read(self, src: int, sock: socket.socket) -> None:
        """The reader of ``src``'s connection: frames into the mesh's queue, in order."""
        head = bytearray(_FRAME.size)
        ended = ""
        try:
            while True:
                _fill(sock, memoryview(head), cut="closed without saying goodbye")
                kind, tag, length = _FRAME.unpack(head)
                if kind == BYE:
                    self._departed(src)
                    return
                if kind != DATA or length > _MAX_FRAME:
                    ended = f"sent a malformed data frame (kind {kind}, {length} bytes)"
                    break
                frame = np.empty(9 + length, np.uint8)   # not zero-filled: every byte is written
                frame[0] = DATA
                frame[1:9] = np.frombuffer(int(tag).to_bytes(8, "little"), np.uint8)
                _fill(sock, memoryview(frame)[9:], cut="closed in the middle of a frame")
                self._deliver(src, frame)
        except (OSError, ConnectionError) as e:
            ended = f"dropped its data connection to this rank ({e})"
        except Exception as e:  # noqa: BLE001 - no frame is lost silently: the peer is reported
            ended = f"sent a data frame this rank could not take ({type(e).__name__}: {e})"
        finally:
            sock.close()
        if self._closing:
            return
        # A failure report (or goodbye) over gRPC says more: give it a moment to arrive.
        timer = threading.Timer(_REPORT_AFTER_S, self._report_end, args=(src, ended))
        timer.daemon = True
        timer.start()

    def _report_end(self, src: int, ended: str) -> None:
        if self._closing:
            return
        if self._said_goodbye(src):
            self._departed(src)
            return
        self._on_lost(src, f"rank {src} ({self.addresses[src]}) {ended} (its process ended, or the network failed)")

    def send(self, dst: int, tag: int, payload: bytes | np.ndarray = b"") -> None:
        """A data frame to ``dst`` (thread-safe; frames to one peer keep their order)."""
        if isinstance(payload, np.ndarray):
            body: Any = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
        else:
            body = payload
        head = _FRAME.pack(DATA, tag, memoryview(body).nbytes)
        with self._send_locks[dst]:
            sock = self._outgoing.get(dst)
            if sock is None or dst in self._broken:
                raise self._broken.get(dst) or PeerLostError(
                    f"Rank {self.rank}: no data connection to rank {dst}: this rank's reducer is closing")
            try:
                _send_all(sock, [head, body])
            except OSError as e:
                error = PeerLostError(
                    f"Rank {self.rank}: sending to rank {dst} ({self.addresses[dst]}) made no progress for "
                    f"timeout_s={self._timeout} s or failed: {e} (the peer is hung, gone or unreachable)")
                self._broken[dst] = error   # the frame may be cut: nothing more goes on this connection
                raise error from None

    def close(self, graceful: bool = True) -> None:
        """Say goodbye on every outgoing connection (after every frame sent) and close."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
        self._stop_listening()
        for peer, sock in list(self._outgoing.items()):
            with self._send_locks[peer]:
                try:
                    if graceful and peer not in self._broken:
                        sock.settimeout(1.0)
                        sock.sendall(_FRAME.pack(BYE, 0, 0))
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
                del self._outgoing[peer]
        with self._cond:
            incoming = list(self._incoming.values())
        for sock in incoming:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
