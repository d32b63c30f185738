"""The rendezvous calls on the wire: one gRPC method whose request and reply are JSON
objects, each sealed with an HMAC-SHA256 of the job's secret.

A request carries a fresh nonce; the reply's MAC covers that nonce, so a worker accepts
only a reply made for its own request by a holder of the secret, and a recorded reply
cannot be replayed to it. A request's MAC proves its sender holds the secret; what a
replayed request can ask (a place in the next epoch for a worker the launcher runs, the
update count) is harmless, as the service answers it for a running worker only.
Everything is size-checked before it is parsed.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from typing import Any, Mapping

from ..errors import ConfigError, WireError

__all__ = ["METHOD", "MAX_MESSAGE_BYTES", "ELASTIC_ADDRESS_VAR", "ELASTIC_WORKER_VAR", "ELASTIC_HOST_VAR",
           "ELASTIC_TIMEOUT_VAR", "seal_request", "open_request", "seal_reply", "open_reply", "elastic_from_env",
           "elastic_timeout_from_env"]

METHOD = "/hostreduce.Elastic/Call"
# A request or reply: a few hundred bytes, a reply listing every member's address a few KiB.
MAX_MESSAGE_BYTES = 64 * 1024
ELASTIC_ADDRESS_VAR = "HOSTREDUCE_ELASTIC"          # host:port of the launcher's rendezvous service
ELASTIC_WORKER_VAR = "HOSTREDUCE_ELASTIC_WORKER"    # this worker's id in the job (never reused)
ELASTIC_HOST_VAR = "HOSTREDUCE_ELASTIC_HOST"        # the address this worker's ring binds
ELASTIC_TIMEOUT_VAR = "HOSTREDUCE_ELASTIC_TIMEOUT_S"  # how long a worker waits for an epoch to form
DEFAULT_ELASTIC_TIMEOUT_S = 600.0


def _mac(secret: str, label: str, *parts: bytes) -> str:
    mac = hmac.new(secret.encode(), f"hostreduce/elastic/{label}".encode(), hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return mac.hexdigest()


def _split(data: bytes) -> tuple[str, bytes]:
    if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"a message of at most {MAX_MESSAGE_BYTES} bytes was expected")
    mac, sep, body = bytes(data).partition(b".")
    if not sep or len(mac) != 64:
        raise WireError("not a sealed message")
    return mac.decode("ascii", "replace"), body


def _parse(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise WireError(f"not JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise WireError("not a JSON object")
    return obj


def seal_request(secret: str, request: Mapping[str, Any]) -> tuple[bytes, str]:
    """The request's bytes and its nonce (which the reply must cover)."""
    nonce = secrets.token_hex(16)
    body = json.dumps({**request, "nonce": nonce}).encode()
    return _mac(secret, "request", body).encode() + b"." + body, nonce


def open_request(secret: str, data: bytes) -> dict[str, Any]:
    """The request in ``data``; WireError if it is malformed or not sealed with ``secret``."""
    mac, body = _split(data)
    if not hmac.compare_digest(mac, _mac(secret, "request", body)):
        raise WireError("wrong or missing shared secret")
    request = _parse(body)
    nonce = request.get("nonce")
    if not isinstance(nonce, str) or len(nonce) != 32:
        raise WireError("no nonce")
    return request


def seal_reply(secret: str, nonce: str, reply: Mapping[str, Any]) -> bytes:
    body = json.dumps(dict(reply)).encode()
    return _mac(secret, "reply", nonce.encode(), body).encode() + b"." + body


def open_reply(secret: str, nonce: str, data: bytes) -> dict[str, Any]:
    mac, body = _split(data)
    if not hmac.compare_digest(mac, _mac(secret, "reply", nonce.encode(), body)):
        raise WireError("the rendezvous service's reply is not sealed with this job's secret")
    return _parse(body)


def elastic_from_env(env: Mapping[str, str]) -> tuple[str, int, str] | None:
    """``(service address, worker id, ring host)`` when this process is a worker of an
    elastic job (``hostreduce run --min-np``), else None."""
    address = env.get(ELASTIC_ADDRESS_VAR)
    if not address:
        return None
    raw = env.get(ELASTIC_WORKER_VAR, "")
    try:
        worker = int(raw)
    except ValueError:
        worker = -1
    if worker < 0:
        raise ConfigError(f"{ELASTIC_WORKER_VAR} must be a worker id >= 0 (`hostreduce run --min-np` sets it). "
                          f"Received: {ELASTIC_WORKER_VAR}={raw!r}")
    return address, worker, env.get(ELASTIC_HOST_VAR) or "127.0.0.1"


def elastic_timeout_from_env(env: Mapping[str, str]) -> float:
    """How long a worker waits for its next epoch (``--elastic-timeout``)."""
    raw = env.get(ELASTIC_TIMEOUT_VAR)
    if raw is None:
        return DEFAULT_ELASTIC_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{ELASTIC_TIMEOUT_VAR} must be a number of seconds > 0. Received: {raw!r}")
    return value
