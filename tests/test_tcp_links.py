"""The ring's TCP data connections (``tcp_links.py``) in one process: frames arrive
whole and in order; goodbyes and broken connections are told apart; strangers (garbage,
silence, a wrong secret, a false rank, a flood) are refused, logged and cost the job
nothing; a rank with another secret is named."""
from __future__ import annotations

import logging
import socket
import threading
import time

import numpy as np
import pytest

from hostreduce.errors import AuthenticationError, PeerLostError
from hostreduce.reducers.ring import tcp_links
from hostreduce.reducers.ring.tcp_links import TcpLinks

SECRET = "s" * 32


class Peer:
    """One rank's links and what they delivered."""

    def __init__(self, rank: int, size: int, secret: str = SECRET) -> None:
        self.frames: dict[int, list[bytes]] = {p: [] for p in range(size)}
        self.departed: list[int] = []
        self.lost: list[tuple[int, str]] = []
        self.goodbye: set[int] = set()
        self.event = threading.Event()
        self.links = TcpLinks(rank, tuple(f"127.0.0.1:{9000 + r}" for r in range(size)), secret, timeout_s=10.0,
                              deliver=self._deliver, departed=self._departed, on_lost=self._lost,
                              said_goodbye=lambda src: src in self.goodbye)

    def _deliver(self, src: int, frame: bytearray) -> None:
        self.frames[src].append(bytes(frame))
        self.event.set()

    def _departed(self, src: int) -> None:
        self.departed.append(src)
        self.event.set()

    def _lost(self, src: int, why: str) -> None:
        self.lost.append((src, why))
        self.event.set()

    def wait_for(self, check, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, "timed out"
            self.event.wait(0.05)
            self.event.clear()


def _connect_all(peers: list[Peer]) -> None:
    ports = [p.links.listen() for p in peers]
    errors: list[BaseException] = []

    def run(peer: Peer) -> None:
        try:
            peer.links.connect(ports, time.monotonic() + 10.0)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(p,)) for p in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20.0)
    if errors:
        raise errors[0]


def _payload(frame: bytes) -> tuple[int, int, bytes]:
    return frame[0], int.from_bytes(frame[1:9], "little"), frame[9:]


def test_frames_arrive_whole_in_order_and_goodbyes_follow_them() -> None:
    peers = [Peer(r, 3) for r in range(3)]
    _connect_all(peers)
    big = np.arange(300_000, dtype=np.float32)      # above the one-send limit
    for tag in range(5):
        peers[0].links.send(1, tag, big + tag)
        peers[0].links.send(1, 100 + tag, b"x" * tag)
    peers[2].links.send(1, 7, np.array([1.5, 2.5]))
    peers[1].wait_for(lambda: len(peers[1].frames[0]) == 10 and len(peers[1].frames[2]) == 1)
    got = [_payload(f) for f in peers[1].frames[0]]
    assert [t for _, t, _ in got] == [0, 100, 1, 101, 2, 102, 3, 103, 4, 104]
    for tag in range(5):
        assert got[2 * tag][2] == (big + tag).tobytes()
        assert got[2 * tag + 1][2] == b"x" * tag
    assert _payload(peers[1].frames[2][0]) == (1, 7, np.array([1.5, 2.5]).tobytes())
    # A goodbye comes after every frame sent before it; a broken connection is a loss.
    peers[0].links.send(1, 9, b"last")
    peers[0].links.close()
    peers[1].wait_for(lambda: peers[1].departed == [0])
    assert _payload(peers[1].frames[0][-1]) == (1, 9, b"last")
    peers[2].links.close(graceful=False)
    peers[1].wait_for(lambda: peers[1].lost)
    assert peers[1].lost[0][0] == 2 and "dropped its data connection" in peers[1].lost[0][1]
    # A peer that said goodbye over gRPC and then dropped the connection departed.
    assert peers[1].departed == [0]
    peers[1].links.close()


def test_strangers_are_refused_logged_and_cost_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "hostreduce.ring")
    peers = [Peer(r, 2) for r in range(2)]
    ports = [p.links.listen() for p in peers]
    target = ("127.0.0.1", ports[1])

    def stranger(send: bytes, read_nonce: bool = True) -> socket.socket:
        sock = socket.create_connection(target, timeout=5.0)
        if read_nonce:
            sock.recv(64)
        if send:
            sock.sendall(send)
        return sock

    silent = [socket.create_connection(target, timeout=5.0) for _ in range(3)]   # hold a handshake each
    garbage = stranger(b"\xff" * 100)
    wrong = stranger((0).to_bytes(4, "little") + b"a" * 32 + b"b" * 64)          # rank 0, bad proof
    false_rank = stranger((7).to_bytes(4, "little") + b"a" * 32 + b"b" * 64)
    for sock in (garbage, wrong, false_rank):
        sock.settimeout(5.0)
        assert sock.recv(64) == b"", "a refused stranger's connection is closed"
    _connect_all(peers)    # the real peers connect while strangers still hold connections
    text = caplog.text
    assert "bad proof of membership" in text and "is not a peer of this job" in text
    assert peers[1].links.refusals.count >= 3
    # After the start-up the listener is gone: nobody else can connect.
    with pytest.raises(OSError):
        socket.create_connection(target, timeout=2.0).recv(1)
    peers[0].links.send(1, 1, b"fine")
    peers[1].wait_for(lambda: peers[1].frames[0])
    assert _payload(peers[1].frames[0][0]) == (1, 1, b"fine") and not peers[1].lost
    for sock in silent + [garbage, wrong, false_rank]:
        sock.close()
    for p in peers:
        p.links.close()


def test_a_peer_meeting_a_flood_of_handshakes_connects_once_they_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every handshake slot held by a stranger that sends nothing (or a byte now and
    then): each is dropped at its deadline, and the real peer, turned away meanwhile,
    connects then."""
    monkeypatch.setattr(tcp_links, "HANDSHAKE_S", 1.0)
    peers = [Peer(r, 2) for r in range(2)]
    ports = [p.links.listen() for p in peers]
    held = [socket.create_connection(("127.0.0.1", ports[1]), timeout=5.0) for _ in range(tcp_links._MAX_HANDSHAKES)]
    drip = held[0]
    stop = threading.Event()

    def trickle() -> None:   # one byte now and then: the deadline is for the whole handshake
        while not stop.wait(0.3):
            try:
                drip.sendall(b"0")
            except OSError:
                return

    threading.Thread(target=trickle, daemon=True).start()
    _connect_all(peers)
    stop.set()
    peers[0].links.send(1, 3, b"through")
    peers[1].wait_for(lambda: peers[1].frames[0])
    assert peers[1].links.refusals.count >= 1
    drip.settimeout(5.0)   # the trickling stranger was dropped at its deadline, too
    while drip.recv(64):
        pass
    for sock in held:
        sock.close()
    for p in peers:
        p.links.close()


def test_a_malformed_frame_from_a_member_is_reported_not_taken() -> None:
    peers = [Peer(r, 2) for r in range(2)]
    _connect_all(peers)
    peers[0].links._outgoing[1].sendall(tcp_links._FRAME.pack(9, 0, 4) + b"abcd")
    peers[1].wait_for(lambda: peers[1].lost)
    assert "malformed data frame (kind 9" in peers[1].lost[0][1] and not peers[1].frames[0]
    for p in peers:
        p.links.close()


def test_sends_after_close_or_a_failed_send_say_so() -> None:
    peers = [Peer(r, 2) for r in range(2)]
    _connect_all(peers)
    peers[0].links.close()
    with pytest.raises(PeerLostError, match="closing"):
        peers[0].links.send(1, 1, b"late")
    peers[1].links.close()


def test_a_flood_of_handshakes_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "hostreduce.ring")
    before = threading.active_count()
    peer = Peer(1, 2)
    port = peer.links.listen()
    held = [socket.create_connection(("127.0.0.1", port), timeout=5.0) for _ in range(tcp_links._MAX_HANDSHAKES + 8)]
    peer.wait_for(lambda: peer.links.refusals.count >= 8)
    assert "handshakes at once" in caplog.text
    # A thread per handshake in progress (at most the limit) and the accepting one.
    assert threading.active_count() - before <= tcp_links._MAX_HANDSHAKES + 1
    for sock in held:
        sock.close()
    peer.links.close()


def test_a_rank_with_another_secret_is_named() -> None:
    peers = [Peer(0, 2), Peer(1, 2, secret="t" * 32)]
    ports = [p.links.listen() for p in peers]
    with pytest.raises(AuthenticationError, match="HOSTREDUCE_SECRET"):
        peers[0].links.connect(ports, time.monotonic() + 5.0)
    for p in peers:
        p.links.close()
