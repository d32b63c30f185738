"""Who may join the mesh: the handshake a connection must pass before any frame of it
is accepted, and the record of the connections that were refused.

A client sends ``{"rank", "nonce"}``; the server answers with its rank, a nonce of its
own and its proof (``auth.py``); the client's stream then carries its proof of the
server's nonce. Everything in a handshake comes from an unknown process, so it is
checked for size, type and range before use, and shown shortened in messages. A refused
connection is logged (the first ones, then every hundredth) and remembered by the rank
it claimed: when the start-up times out, the error says what was refused meanwhile
(a secret that differs between ranks reads differently from a peer that never came).
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from typing import Any, Callable

from ..errors import AuthenticationError, ClusterError
from . import auth

__all__ = ["short", "hello_request", "parse_hello", "hello_reply", "read_reply", "check_proof", "Refusals"]

log = logging.getLogger("hostreduce.ring")

# A handshake is a small JSON object; anything larger is refused before it is parsed.
MAX_HELLO_BYTES = 1024
_NONCE_RE = re.compile(r"[0-9a-f]{32}")
# Refusals logged one by one; after that every _LOG_EVERY-th, with the count.
_LOG_FIRST, _LOG_EVERY = 10, 100


def short(value: Any, limit: int = 60) -> str:
    """``repr`` of a received value, shortened for a message."""
    try:
        text = repr(value)
    except RecursionError:
        return "<nested too deeply>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _valid_nonce(nonce: Any) -> bool:
    return isinstance(nonce, str) and _NONCE_RE.fullmatch(nonce) is not None


def hello_request(rank: int, nonce: str) -> bytes:
    return json.dumps({"rank": rank, "nonce": nonce}).encode()


def parse_hello(request: bytes, rank: int, size: int) -> tuple[int, str]:
    """The claimed rank and nonce of a handshake sent to ``rank``; ValueError for
    anything else."""
    if len(request) > MAX_HELLO_BYTES:
        raise ValueError(f"{len(request)} bytes (at most {MAX_HELLO_BYTES})")
    try:
        req = json.loads(request)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not JSON ({type(e).__name__})") from None
    if not isinstance(req, dict):
        raise ValueError(f"not a JSON object: {short(req)}")
    claimed, nonce = req.get("rank"), req.get("nonce")
    if type(claimed) is not int or not 0 <= claimed < size or claimed == rank:
        raise ValueError(f"invalid rank {short(claimed)}")
    if not _valid_nonce(nonce):
        raise ValueError(f"invalid nonce {short(nonce)}")
    return claimed, nonce


def hello_reply(secret: str, rank: int, client: int, client_nonce: str, nonce: str) -> bytes:
    """The server's answer: its rank, a fresh ``nonce``, and its proof of ``client_nonce``."""
    proof = auth.prove(secret, "server", client_nonce, rank, client)
    return json.dumps({"rank": rank, "nonce": nonce, "proof": proof}).encode()


def read_reply(raw: bytes, secret: str, rank: int, peer: int, my_nonce: str, addr: str) -> tuple[str, bool]:
    """The server's nonce in ``raw``, and whether the server proved it is ``peer``.
    Raises AuthenticationError for an answer that is not a handshake at all."""
    try:
        reply = json.loads(raw)
        server_nonce = reply["nonce"]
        if not _valid_nonce(server_nonce):
            raise ValueError("bad nonce")
    except (ValueError, KeyError, TypeError, RecursionError):
        raise AuthenticationError(
            f"Rank {rank}: the process at {addr!r} answered the handshake with {short(raw)}; it is not "
            f"rank {peer} of this job") from None
    proved = reply.get("rank") == peer and auth.verify(
        secret, "server", my_nonce, peer, rank, str(reply.get("proof", "")))
    return server_nonce, proved


def check_proof(meta: dict[str, str], secret: str, nonces: auth.NonceBook, rank: int,
                valid: Callable[[int], bool]) -> tuple[int, str | None]:
    """The client rank claimed in a call's metadata (``hr-rank``, ``hr-nonce``,
    ``hr-proof``) and why it is refused (None: it proved it is that rank of this job).
    ``valid(claimed)`` says whether the claimed rank may connect to ``rank`` at all; a
    claim that fails it is returned as -1."""
    try:
        claimed = int(meta.get("hr-rank", "-1"))
    except ValueError:
        claimed = -1
    if not valid(claimed):
        return -1, f"invalid rank {short(meta.get('hr-rank'))}"
    nonce, proof = meta.get("hr-nonce", ""), meta.get("hr-proof", "")
    if not (nonces.redeem(nonce) and auth.verify(secret, "client", nonce, claimed, rank, proof)):
        return claimed, "wrong or missing shared secret"
    return claimed, None


class Refusals:
    """The connections this rank refused, by the rank they claimed to be. ``name``: how
    the log names this end (default ``rank <rank>``); ``logger``: where it logs.

    By default the first refusals are logged one by one, then every hundredth with the
    count. ``every_s``: each class of refusal (``refuse(kind=...)``) is logged one by one
    for its first ones; later ones are counted and :meth:`flush` logs the counts of each
    class at most every ``every_s`` seconds, so that no refusal goes unreported and no
    flood fills the log."""

    def __init__(self, rank: int, *, name: str | None = None, logger: logging.Logger | None = None,
                 every_s: float | None = None, max_claims: int = 1024) -> None:
        self._rank = rank
        self._name = name or f"rank {rank}"
        self._log = logger or log
        self._every_s = every_s
        self._max_claims = max_claims
        self._lock = threading.Lock()
        self.count = 0
        self.kinds: dict[str, int] = {}      # class of refusal -> how many (every_s mode)
        self._unlogged: dict[str, int] = {}  # class -> refusals counted since the last flush
        self._flushed = time.monotonic()
        self._claimed: dict[int, tuple[int, str]] = {}  # claimed rank -> (count, last reason)

    def refuse(self, peer: str, claimed: int | None, why: str, connected: set[int], *, kind: str | None = None
               ) -> None:
        """Log a refused connection from ``peer`` (rate-limited) and remember it, unless
        the rank it claimed is already ``connected``."""
        with self._lock:
            self.count += 1
            n = self.count
            if claimed is not None and claimed not in connected and (
                    claimed in self._claimed or len(self._claimed) < self._max_claims):
                times = self._claimed.get(claimed, (0, ""))[0] + 1
                self._claimed[claimed] = (times, f"{why}, last from {peer}")
            if self._every_s is not None:
                kind = kind or why
                seen = self.kinds[kind] = self.kinds.get(kind, 0) + 1
                if seen > _LOG_FIRST:
                    self._unlogged[kind] = self._unlogged.get(kind, 0) + 1
                    return
        if self._every_s is not None:
            more = (f" (the {_LOG_FIRST}th refusal of this kind: later ones are counted and logged every "
                    f"{self._every_s:g} s)" if seen == _LOG_FIRST else "")
            self._log.warning("%s: refused a call from %s%s: %s%s", self._name, peer,
                              "" if claimed is None else f" (claimed rank {claimed})", why, more)
            return
        if n <= _LOG_FIRST or n % _LOG_EVERY == 0:
            more = f" ({n} refused so far)" if n > _LOG_FIRST else ""
            self._log.warning("%s: refused connection from %s%s: %s%s", self._name, peer,
                              "" if claimed is None else f" (claimed rank {claimed})", why, more)

    def flush(self, force: bool = False) -> None:
        """Log the refusals counted but not logged yet, by class (``every_s`` mode), if
        ``every_s`` has passed since the last time (or ``force``)."""
        with self._lock:
            now = time.monotonic()
            if not self._unlogged or (not force and now - self._flushed < (self._every_s or 0.0)):
                return
            counts, self._unlogged, since, self._flushed = self._unlogged, {}, self._flushed, now
            totals = dict(self.kinds)
        self._log.warning("%s: refused in the last %.0f s: %s", self._name, now - since,
                          "; ".join(f"{n} more of {kind!r} ({totals[kind]} in all)" for kind, n in counts.items()))

    def by_claim(self) -> dict[int, tuple[int, str]]:
        """Claimed rank -> (how many refusals, the last one's reason and peer), for the
        ranks that were not connected when refused."""
        with self._lock:
            return dict(self._claimed)

    def timeout_error(self, text: str, missing: list[int]) -> ClusterError | AuthenticationError:
        """The error for a start-up that timed out waiting for ``missing`` (``text``
        says so), with what was refused meanwhile."""
        with self._lock:
            refused = {p: v for p, v in self._claimed.items() if p in missing}
            count = self.count
        if refused:
            return AuthenticationError(
                text + "; meanwhile this rank refused "
                + "; ".join(f"{n} connection(s) that claimed to be rank {p} ({why})" for p, (n, why) in refused.items())
                + ". Every worker needs the same HOSTREDUCE_SECRET."
            )
        if count:
            text += f"; meanwhile this rank refused {count} connection(s) that failed the handshake"
        return ClusterError(text)
