"""Mutual challenge-response proof of job membership with a shared secret (HMAC-SHA256).

A client asks the server for a fresh nonce and sends one of its own; the server proves
itself by MAC-ing the client's nonce, the client by MAC-ing the server's. Domain
labels keep a server's proof from ever being usable as a client's. Nonces are single
use, so a recorded handshake cannot be replayed.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time

__all__ = ["new_nonce", "prove", "verify", "NonceBook"]


def new_nonce() -> str:
    return secrets.token_hex(16)


def prove(secret: str, role: str, nonce: str, sender: int, receiver: int) -> str:
    msg = f"hostreduce/{role}/{nonce}/{sender}/{receiver}".encode()
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def verify(secret: str, role: str, nonce: str, sender: int, receiver: int, proof: str) -> bool:
    return hmac.compare_digest(prove(secret, role, nonce, sender, receiver), str(proof))


class NonceBook:
    """Nonces a server handed out and not yet redeemed (each valid once, for a while)."""

    def __init__(self, ttl_s: float = 300.0, max_outstanding: int = 4096) -> None:
        self._ttl = ttl_s
        self._max = max_outstanding
        self._issued: dict[str, float] = {}
        self._lock = threading.Lock()

    def issue(self) -> str:
        nonce = new_nonce()
        now = time.monotonic()
        with self._lock:
            self._issued = {n: t for n, t in self._issued.items() if now - t < self._ttl}
            # A flood of handshakes that never finish must not grow the book without
            # bound: the oldest nonces go first (a real peer redeems its nonce at once).
            for stale in list(self._issued)[:max(0, len(self._issued) - self._max + 1)]:
                del self._issued[stale]
            self._issued[nonce] = now
        return nonce

    def redeem(self, nonce: str) -> bool:
        with self._lock:
            issued = self._issued.pop(nonce, None)
        return issued is not None and time.monotonic() - issued < self._ttl
