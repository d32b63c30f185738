"""Who may talk to a parameter server: the ring's mutual HMAC handshake
(``transport/admission.py`` and ``auth.py``), then a session for the connection.

Workers and ps tasks share one id space for the proofs: worker ``r`` is ``r``, ps task
``m`` is ``num_workers + m``, so a proof names both ends and a ps's proof cannot pass
for a worker's. The worker sends ``{"rank", "nonce"}`` (``Hello``, in the call's
metadata); the ps answers with its id, a nonce and its proof; the worker checks that
proof and sends its own (``Login``, in the call's metadata too); the ps then hands it a
random session token that every later call carries. A refused handshake is logged
(by class, rate-limited with counts: ``admission.Refusals``) and changes nothing else.

A session is bound to the connection that logged in (gRPC's ``context.peer()``: the
worker's address and source port): its token, seen on the network, is refused on any
other connection before the call's body is read, and it ends with its connection (the
worker's ``Logout`` when it closes its channel; a connection that closed without one
leaves a token only its own address and port could use). A worker whose channel
reconnects (a new connection) is refused with :data:`REBIND` and logs in again.
Sessions are kept per worker up to :data:`MAX_SESSIONS_PER_WORKER`, the oldest dropped
first, so that logins cannot grow the table without bound.

The ``Hello`` also carries how many workers and ps the worker's cluster lists. The ids
in the proofs depend on them, so tasks whose ``TF_CONFIG`` disagree would fail each
other's proofs as if their secrets differed; the ps compares them first and refuses
the worker naming both clusters' counts instead.
"""
from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from typing import Any

from ..errors import AuthenticationError, ClusterError
from ..transport import admission, auth

__all__ = ["Gate", "login", "SESSION_KEY", "HELLO_KEY", "REBIND", "MAX_SESSIONS_PER_WORKER"]

SESSION_KEY = "hr-session"
HELLO_KEY = "hr-hello"  # the Hello's request, in metadata: no handshake has a body to read
# The refusal of a valid token on a connection other than its own: the worker's client
# logs in again on its (new) connection and repeats the call, which was not read.
REBIND = "session bound to another connection"
MAX_SESSIONS_PER_WORKER = 64


class Gate:
    """The serving side: handshakes, sessions, and the worker behind each call.

    Nothing here reads a request's body: ``Hello`` and ``Login`` carry what they need in
    the call's metadata (bounded by gRPC's metadata limit, 8 KiB), and every other call
    is accepted or refused on its session token (also metadata) before its body is
    read (``server.py``), so a process without the secret can neither make a ps read a
    large message nor hold a call open waiting for one."""

    def __init__(self, ps_index: int, num_workers: int, num_ps: int, secret: str) -> None:
        self.me = num_workers + ps_index
        self.size = num_workers + num_ps
        self.num_workers = num_workers
        self._secret = secret
        self._nonces = auth.NonceBook()
        self.refusals = admission.Refusals(self.me, name=f"ps task {ps_index}",
                                           logger=logging.getLogger("hostreduce.ps"), every_s=10.0)
        self.num_ps = num_ps
        self._sessions: dict[str, tuple[int, str]] = {}  # token -> (worker, the connection's peer)
        self._lock = threading.Lock()
        self.logged_in: dict[int, float] = {}  # worker -> when it first logged in

    def logins(self) -> dict[int, float]:
        with self._lock:
            return dict(self.logged_in)

    def refuse(self, context: Any, claimed: int | None, why: str, code_name: str, kind: str) -> None:
        """Log a refused call (by ``kind``, rate-limited) and abort it with ``why``."""
        import grpc

        with self._lock:
            connected = {rank for rank, _ in self._sessions.values()}
        self.refusals.refuse(context.peer(), claimed, why, connected, kind=kind)
        context.abort(getattr(grpc.StatusCode, code_name), f"ps id {self.me}: {why}")

    def hello(self, request_iterator: Any, context: Any) -> bytes:
        raw = dict(context.invocation_metadata()).get(HELLO_KEY, "")
        request = raw.encode() if isinstance(raw, str) else b""
        try:
            claimed = None
            fields = json.loads(request) if len(request) <= admission.MAX_HELLO_BYTES else {}
            workers, ps = (fields.get("workers"), fields.get("ps")) if isinstance(fields, dict) else (None, None)
            if type(fields.get("rank") if isinstance(fields, dict) else None) is int:
                claimed = fields["rank"]
            if (workers, ps) != (self.num_workers, self.num_ps):
                why = (f"the cluster differs: this ps task's TF_CONFIG lists {self.num_workers} worker(s) and "
                       f"{self.num_ps} ps, worker {admission.short(claimed)}'s lists {admission.short(workers)} "
                       f"worker(s) and {admission.short(ps)} ps; every task needs the same cluster")
                self.refuse(context, claimed, why, "FAILED_PRECONDITION", "cluster differs")
            rank, nonce = admission.parse_hello(request, self.me, self.size)
            if rank >= self.num_workers:
                raise ValueError(f"rank {rank} is not a worker (workers are 0..{self.num_workers - 1})")
        except (ValueError, RecursionError) as e:
            self.refuse(context, None, f"malformed handshake: {e}", "INVALID_ARGUMENT", "malformed handshake")
        return admission.hello_reply(self._secret, self.me, rank, nonce, self._nonces.issue())

    def login(self, request_iterator: Any, context: Any) -> bytes:
        rank, why = admission.check_proof(dict(context.invocation_metadata()), self._secret, self._nonces, self.me,
                                          lambda r: 0 <= r < self.num_workers)
        if why is not None:
            self.refuse(context, rank if rank >= 0 else None, why, "UNAUTHENTICATED", "failed proof")
        token = secrets.token_hex(16)
        with self._lock:
            mine = [t for t, (r, _) in self._sessions.items() if r == rank]
            for old in mine[:max(0, len(mine) - MAX_SESSIONS_PER_WORKER + 1)]:  # oldest first (dict order)
                del self._sessions[old]
            self._sessions[token] = (rank, context.peer())
            self.logged_in.setdefault(rank, time.monotonic())
        return token.encode()

    def session(self, metadata: Any) -> int | None:
        """The worker whose session token ``metadata`` carries, or None (whatever the
        connection: the caller checks that with :meth:`worker`)."""
        token = _token(metadata)
        if token is None:
            return None
        with self._lock:
            found = self._sessions.get(token)
        return None if found is None else found[0]

    def logout(self, context: Any) -> None:
        """End the session of the call's token (its worker closes the channel)."""
        token = _token(context.invocation_metadata())
        with self._lock:
            self._sessions.pop(token, None)  # type: ignore[arg-type]

    def no_session(self, request_iterator: Any, context: Any) -> bytes:
        """A call without a valid session: refused, its body unread."""
        self.refuse(context, None, "call without a valid session (no handshake)", "UNAUTHENTICATED", "no session")
        return b""

    def worker(self, context: Any) -> int:
        """The authenticated worker rank behind a call on the connection that logged in;
        aborts the call otherwise (before its body is read)."""
        token = _token(context.invocation_metadata())
        with self._lock:
            found = self._sessions.get(token) if token is not None else None
        if found is None:
            self.refuse(context, None, "call without a valid session (no handshake)", "UNAUTHENTICATED",
                        "no session")
        rank, peer = found  # type: ignore[misc]
        if peer != context.peer():
            self.refuse(context, rank, f"{REBIND} (worker {rank}'s session, logged in from {peer})",
                        "UNAUTHENTICATED", "session of another connection")
        return rank


def _token(metadata: Any) -> str | None:
    token = next((m[1] for m in metadata or () if m[0] == SESSION_KEY), None)
    return token if isinstance(token, str) else None


def login(channel: Any, service: str, secret: str, rank: int, ps_index: int, num_workers: int,
          addr: str, deadline: float, num_ps: int) -> str:
    """Authenticate worker ``rank`` to ps task ``ps_index`` at ``addr`` (both ways);
    returns the session token. Waits for the ps to come up until ``deadline``."""
    import grpc

    me, ps_id = rank, num_workers + ps_index
    my_nonce = auth.new_nonce()
    hello = channel.unary_unary(f"/{service}/Hello")
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ClusterError(f"Worker {rank}: ps task {ps_index} at {addr!r} did not answer within the "
                               "connect timeout (it has not started, or the address is wrong)")
        try:
            raw = hello(b"", timeout=min(left, 1.0), wait_for_ready=True,
                        metadata=((HELLO_KEY, _hello_request(me, my_nonce, num_workers, num_ps)),))
            break
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise ClusterError(f"Worker {rank}: ps task {ps_index} at {addr!r} refused this worker: "
                                   f"{e.details()}") from None
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise ClusterError(f"Worker {rank}: handshake with ps task {ps_index} at {addr!r} failed: "
                                   f"{e.details()}") from None
            time.sleep(0.05)
    server_nonce, proved = admission.read_reply(raw, secret, me, ps_id, my_nonce, addr)
    # Sent even when the ps failed its proof, so that the ps logs the refusal too (a
    # proof of its single-use nonce is of no use to anyone else).
    proof = auth.prove(secret, "client", server_nonce, me, ps_id)
    try:
        token = channel.unary_unary(f"/{service}/Login")(
            b"", timeout=max(1.0, deadline - time.monotonic()),
            metadata=(("hr-rank", str(me)), ("hr-nonce", server_nonce), ("hr-proof", proof)))
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAUTHENTICATED or not proved:
            raise AuthenticationError(f"Worker {rank}: ps task {ps_index} at {addr!r} refused this worker's "
                                      f"proof ({e.details()}); every task needs the same HOSTREDUCE_SECRET") from None
        raise ClusterError(f"Worker {rank}: login to ps task {ps_index} at {addr!r} failed: {e.details()}") from None
    if not proved:
        raise AuthenticationError(f"Worker {rank}: the process at {addr!r} failed to prove it is ps task "
                                  f"{ps_index} of this job: a different HOSTREDUCE_SECRET, or another job's ps")
    return token.decode()


def _hello_request(rank: int, nonce: str, num_workers: int, num_ps: int | None) -> str:
    """The ring's handshake, plus the counts of this worker's cluster."""
    return json.dumps({"rank": rank, "nonce": nonce, "workers": num_workers, "ps": num_ps})
