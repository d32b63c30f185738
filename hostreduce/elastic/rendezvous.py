"""The launcher's side of an elastic job: which workers form each epoch, and the gRPC
service through which workers ask.

``Membership`` is the state (no I/O): the running workers, the current epoch's members
in rank order, the places asked for the next epoch and an update count. An epoch forms
when every running worker has asked for a place in it (and at least ``min_np`` run):
survivors first, in their old rank order, then joining workers by id. A worker that is
not a member asking for a place while an epoch runs raises the update count, which
members read at their next commit and answer by resetting; each place carries the
count at its epoch's forming, which the workers of that epoch already include.

``RendezvousService`` serves ``Membership`` over one unary gRPC method on the address it
is told. Before a call is authenticated it costs one bounded message and one of a few
threads; a call that fails authentication, is malformed or is a replay of an earlier
request (its nonce seen before) is refused, logged, and changes nothing.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ..cluster.tf_config import check_addresses
from ..errors import ClusterError, WireError
from ..processes import format_address
from ..transport.admission import Refusals, short
from ..transport.grpc_options import grpc_options
from . import wire

__all__ = ["Membership", "Member", "RendezvousService"]

log = logging.getLogger("hostreduce.elastic")


@dataclasses.dataclass(frozen=True)
class Member:
    worker: int
    host: str
    address: str


class Membership:
    """The members of each epoch of one elastic job (thread-safe)."""

    def __init__(self, min_np: int, on_epoch: Callable[[int, list[Member]], None] | None = None,
                 on_ask: Callable[[int], None] | None = None) -> None:
        self.min_np = min_np
        self._on_epoch, self._on_ask = on_epoch, on_ask
        self._lock = threading.Lock()
        self.epoch = 0
        self.members: list[Member] = []
        self._assigned: dict[int, dict[str, Any]] = {}   # worker -> its place in the current epoch
        self._running: dict[int, str] = {}               # worker -> host
        self._asked: dict[int, Member] = {}              # places asked for the next epoch
        self._last_rank: dict[int, int] = {}
        self._announced: set[int] = set()                # non-members already counted in `updates`
        self._retiring: set[int] = set()                 # running, but out of the next epoch
        self.updates = 0
        self.closed = False

    # -- what the launcher tells ------------------------------------------------
    def started(self, worker: int, host: str) -> None:
        with self._lock:
            self._running[worker] = host

    def ended(self, worker: int) -> None:
        with self._lock:
            self._running.pop(worker, None)
            self._retiring.discard(worker)
            self._asked.pop(worker, None)
            self._form()

    def retire(self, worker: int) -> None:
        """Leave ``worker`` out of the next epoch (its slot went away): the members reset
        at their next commit, as for a joiner; when it asks for a place it waits, and the
        launcher stops it once the epoch formed without it."""
        with self._lock:
            if worker in self._running and worker not in self._retiring:
                self._retiring.add(worker)
                self._asked.pop(worker, None)
                self.updates += 1
                self._form()

    def keep(self, worker: int) -> bool:
        """Take back ``worker``'s retirement while it is still a member of the current
        epoch (a slot came free again, e.g. another worker of its host died); return
        whether it stays. Once an epoch formed without it, it is too late: it leaves."""
        with self._lock:
            if worker not in self._retiring or worker not in self._running or worker not in self._assigned:
                return False
            self._retiring.discard(worker)
            return True

    def retired(self, worker: int) -> bool:
        """Whether ``worker`` was retired and is out of the current epoch (it may stop)."""
        with self._lock:
            return worker in self._retiring and worker not in self._assigned

    def close(self) -> None:
        with self._lock:
            self.closed = True

    def running(self) -> dict[int, str]:
        with self._lock:
            return dict(self._running)

    def waiting(self) -> list[int]:
        """Running workers that asked for a place in the next epoch."""
        with self._lock:
            return sorted(self._asked)

    def member_ids(self) -> list[int]:
        with self._lock:
            return [m.worker for m in self.members]

    # -- what workers ask ---------------------------------------------------------
    def join(self, worker: int, after: int, address: str) -> dict[str, Any]:
        """Worker ``worker`` (last in epoch ``after``, 0: none) asks for its place."""
        with self._lock:
            if self.closed:
                return {"state": "leave", "reason": "the job has ended"}
            host = self._running.get(worker)
            if host is None:
                return {"state": "leave", "reason": f"worker {worker} is not one of the job's running workers"}
            if worker in self._retiring:   # the launcher stops it once the next epoch formed without it
                return {"state": "wait", "epoch": self.epoch}
            if self.epoch > after and worker in self._assigned:
                return self._assigned[worker]
            self._asked[worker] = Member(worker, host, address)
            if self.epoch and worker not in self._assigned and worker not in self._announced:
                self._announced.add(worker)
                self.updates += 1
                if self._on_ask is not None:
                    self._on_ask(worker)
            self._form()
            if self.epoch > after and worker in self._assigned:
                return self._assigned[worker]
            return {"state": "wait", "epoch": self.epoch}

    def _form(self) -> None:
        running = set(self._running) - self._retiring
        if self.closed or not running or len(running) < self.min_np or not running <= set(self._asked):
            return
        order = sorted(running, key=lambda w: (0, self._last_rank[w]) if w in self._last_rank else (1, w))
        members = [self._asked[w] for w in order]
        self.epoch += 1
        self.members = members
        addresses = [m.address for m in members]
        hosts = [m.host for m in members]
        self._assigned = {}
        for rank, m in enumerate(members):
            same = [i for i, h in enumerate(hosts) if h == m.host]
            self._assigned[m.worker] = {"state": "ready", "epoch": self.epoch, "rank": rank, "size": len(members),
                                        "addresses": addresses, "local_rank": same.index(rank),
                                        "local_size": len(same), "updates": self.updates}
        self._last_rank = {m.worker: rank for rank, m in enumerate(members)}
        self._asked = {}
        self._announced -= set(self._last_rank)
        log.info("epoch %d: %d worker(s), ids %s", self.epoch, len(members), [m.worker for m in members])
        if self._on_epoch is not None:
            self._on_epoch(self.epoch, members)

    def updates_count(self) -> int:
        with self._lock:
            return self.updates


class _SeenNonces:
    """The nonces of the requests served in the last ``ttl_s`` (at most ``limit``): a
    request whose nonce is among them is a replay. Past the limit the oldest are
    forgotten; a worker polls about 20 times a second, so the limit spans minutes."""

    def __init__(self, ttl_s: float = 600.0, limit: int = 200_000) -> None:
        self._ttl, self._limit = ttl_s, limit
        self._seen: dict[str, float] = {}
        self._order: "collections.deque[tuple[float, str]]" = collections.deque()
        self._lock = threading.Lock()

    def fresh(self, nonce: str) -> bool:
        now = time.monotonic()
        with self._lock:
            while self._order and (now - self._order[0][0] > self._ttl or len(self._order) >= self._limit):
                self._seen.pop(self._order.popleft()[1], None)
            if nonce in self._seen:
                return False
            self._seen[nonce] = now
            self._order.append((now, nonce))
            return True


class RendezvousService:
    """The gRPC face of a ``Membership``, bound to ``host`` (port chosen by the system)."""

    def __init__(self, membership: Membership, secret: str, host: str = "127.0.0.1") -> None:
        import grpc

        self._membership = membership
        self._secret = secret
        self.refusals = Refusals(-1, name="the elastic rendezvous service", logger=log, every_s=10.0)
        self._nonces = _SeenNonces()
        # A request travels in the call's metadata and the handler never reads a body
        # (stream_unary: it runs before one arrives), so every call is answered or refused
        # at once from its headers and none holds a thread while a stranger stalls.
        options = grpc_options(10.0, max_receive_bytes=1024) + [
            ("grpc.max_metadata_size", 2 * wire.MAX_REQUEST_BYTES + 1024)]
        self._server = grpc.server(ThreadPoolExecutor(max_workers=8, thread_name_prefix="hr-elastic"),
                                   options=options, maximum_concurrent_rpcs=256)
        handler = grpc.method_handlers_generic_handler("hostreduce.Elastic", {
            "Call": grpc.stream_unary_rpc_method_handler(self._call)})
        self._server.add_generic_rpc_handlers((handler,))
        bind = format_address(host, 0)
        port = self._server.add_insecure_port(bind)
        if not port:
            raise ClusterError(f"The elastic rendezvous service cannot listen on {bind}: `--host` must be an address "
                               f"of this machine. Received: --host {host}")
        self.address = format_address(host, port)
        self._server.start()

    def _refuse(self, context: Any, why: str) -> bytes:
        import grpc

        self.refusals.refuse(context.peer(), None, why, set(), kind=why.split(" (")[0])
        context.abort(grpc.StatusCode.UNAUTHENTICATED if "secret" in why else grpc.StatusCode.INVALID_ARGUMENT,
                      f"refused: {why}")
        raise AssertionError("unreachable")

    def _call(self, request_iterator: Any, context: Any) -> bytes:
        self.refusals.flush()   # counts of the refusals not logged one by one, every 10 s
        raw = dict(context.invocation_metadata()).get(wire.REQUEST_KEY, "")
        try:
            req = wire.open_request(self._secret, raw if isinstance(raw, str) else "")
        except WireError as e:
            return self._refuse(context, str(e))
        op, worker = req.get("op"), req.get("worker")
        if not isinstance(worker, int) or isinstance(worker, bool) or worker < 0:
            return self._refuse(context, f"invalid worker {short(worker)}")
        if op == "join":
            after, address = req.get("after"), req.get("address")
            if not isinstance(after, int) or isinstance(after, bool) or not 0 <= after <= self._membership.epoch:
                return self._refuse(context, f"invalid epoch {short(after)}")
            try:
                check_addresses([address], "address")
            except ClusterError:
                return self._refuse(context, f"invalid address {short(address)}")
        elif op != "updates":
            return self._refuse(context, f"unknown call {short(op)}")
        if not self._nonces.fresh(req["nonce"]):
            # A recorded request sent again (the channel is plain text) could put a
            # worker's old address into the next epoch: each request counts once.
            return self._refuse(context, "replayed request")
        if op == "join":
            reply = self._membership.join(worker, after, address)
        else:
            reply = {"updates": self._membership.updates_count()}
        return wire.seal_reply(self._secret, req["nonce"], reply)

    def stop(self) -> None:
        self.refusals.flush(force=True)
        self._server.stop(grace=None)
