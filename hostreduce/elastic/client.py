"""A worker's side of an elastic job: ask the launcher's rendezvous service for this
worker's place in the next epoch, and read the update count at a commit.

Each place comes with a fresh ring address of this worker's own (a free port on the
host the launcher named), so that an epoch's ring never meets a socket of the one
before it.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Mapping

from ..cluster import ClusterSpec
from ..errors import ClusterError, PeerLostError, WireError
from ..processes import format_address, free_ports
from ..transport.grpc_options import grpc_options
from . import wire
from .wire import SECRET_VAR

__all__ = ["RendezvousClient", "ElasticResolver"]

log = logging.getLogger("hostreduce.elastic")

POLL_S = 0.05
CALL_TIMEOUT_S = 10.0
RETRY_FOR_S = 60.0       # how long a call is retried while the service is busy or unreachable


def _transient() -> frozenset[Any]:
    import grpc

    return frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                      grpc.StatusCode.DEADLINE_EXCEEDED})


class RendezvousClient:
    """Calls to the rendezvous service at ``address`` as worker ``worker``."""

    def __init__(self, address: str, worker: int, host: str, secret: str) -> None:
        import grpc

        if not secret:
            raise ClusterError("An elastic worker needs the job's secret: `hostreduce run --min-np` sets "
                               "HOSTREDUCE_SECRET. Received: no HOSTREDUCE_SECRET")
        self.address, self.worker, self.host = address, worker, host
        self._secret = secret
        self._channel = grpc.insecure_channel(address, options=grpc_options(CALL_TIMEOUT_S, wire.MAX_MESSAGE_BYTES))
        self._call = self._channel.stream_unary(wire.METHOD)
        self.epoch = 0   # the last epoch this worker had a place in
        self.epoch_updates = 0   # the update count when that epoch formed (its joiners are in it)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "RendezvousClient | None":
        found = wire.elastic_from_env(env)
        if found is None:
            return None
        address, worker, host = found
        return cls(address, worker, host, env.get(SECRET_VAR, ""))

    def _ask(self, request: dict[str, Any], patience_s: float = RETRY_FOR_S) -> dict[str, Any]:
        """One call; a busy or briefly unreachable service is asked again for
        ``patience_s`` (a launcher that is gone stays unreachable)."""
        import grpc

        deadline = time.monotonic() + patience_s
        while True:
            data, nonce = wire.seal_request(self._secret, {**request, "worker": self.worker})
            try:
                reply = self._call(iter(()), timeout=CALL_TIMEOUT_S, metadata=((wire.REQUEST_KEY, data),))
            except grpc.RpcError as e:
                if e.code() in _transient() and time.monotonic() < deadline:
                    time.sleep(POLL_S)
                    continue
                raise PeerLostError(f"Elastic worker {self.worker}: the launcher's rendezvous service at "
                                    f"{self.address} did not answer ({e.code().name}: {e.details()})") from None
            try:
                return wire.open_reply(self._secret, nonce, reply)
            except WireError as e:
                raise WireError(f"Elastic worker {self.worker}: {e}") from None

    def join(self, timeout_s: float) -> ClusterSpec:
        """This worker's place in the next epoch, once every running worker asked."""
        port = free_ports(1, self.host)[0]
        address = format_address(self.host, port)
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._ask({"op": "join", "after": self.epoch, "address": address})
            state = reply.get("state")
            if state == "ready":
                return self._spec(reply)
            if state == "leave":
                raise ClusterError(f"Elastic worker {self.worker}: the launcher gave it no place: {reply.get('reason')}")
            if state != "wait":
                raise WireError(f"Elastic worker {self.worker}: unexpected reply {reply!r}")
            if time.monotonic() > deadline:
                raise PeerLostError(
                    f"Elastic worker {self.worker}: no new epoch formed within {timeout_s:g} s (the running workers "
                    "did not all ask for a place: one of them may be stuck in a collective or never commits)")
            time.sleep(POLL_S)

    def _spec(self, reply: dict[str, Any]) -> ClusterSpec:
        try:
            epoch, rank, size = int(reply["epoch"]), int(reply["rank"]), int(reply["size"])
            epoch_updates = int(reply.get("updates", 0))
            addresses = tuple(str(a) for a in reply["addresses"])
            spec = ClusterSpec(rank=rank, size=size, local_rank=int(reply["local_rank"]),
                               local_size=int(reply["local_size"]), addresses=addresses, task_type="worker",
                               task_index=rank, source="elastic", worker_addresses=addresses)
        except (KeyError, TypeError, ValueError, ClusterError) as e:
            raise WireError(f"Elastic worker {self.worker}: malformed place {reply!r} ({e})") from None
        self.epoch, self.epoch_updates = epoch, epoch_updates
        log.info("elastic worker %d: epoch %d, rank %d of %d", self.worker, epoch, rank, size)
        return spec

    def updates(self) -> int:
        """How many times workers asked to join while an epoch ran (rises when one waits)."""
        reply = self._ask({"op": "updates"})
        value = reply.get("updates")
        if not isinstance(value, int):
            raise WireError(f"Elastic worker {self.worker}: unexpected reply {reply!r}")
        return value

    def close(self) -> None:
        self._channel.close()


class ElasticResolver:
    """A cluster resolver (``cluster_spec().as_dict()``, ``task_type``, ``task_id``) for
    one epoch's place, as ``MultiWorkerStrategy(cluster_resolver=...)`` takes it."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.task_type = "worker"
        self.task_id = spec.rank

    def cluster_spec(self) -> "ElasticResolver":
        return self

    def as_dict(self) -> dict[str, list[str]]:
        return {"worker": list(self.spec.addresses)}
