"""The rendezvous calls on the wire: one gRPC method; the request is a JSON object sealed
with an HMAC-SHA256 of the job's secret and carried in the call's metadata (``hr-elastic``),
the reply a JSON object sealed likewise as the response.

The service's handler answers from the metadata and never reads a request body, so a
caller that sends headers and then nothing holds no thread. A request carries a fresh
nonce; the reply's MAC covers that nonce, so a worker accepts only a reply made for its
own request by a holder of the secret, and a recorded reply cannot be replayed to it.
The service counts each request's nonce once, so a recorded request cannot be replayed
to it either. Everything is size-checked before it is parsed.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from typing import Any, Mapping

from ..errors import ConfigError, WireError

__all__ = ["SECRET_VAR", "METHOD", "REQUEST_KEY", "MAX_REQUEST_BYTES", "MAX_MESSAGE_BYTES", "ELASTIC_ADDRESS_VAR", "ELASTIC_WORKER_VAR", "ELASTIC_HOST_VAR",
           "ELASTIC_TIMEOUT_VAR", "seal_request", "open_request", "seal_reply", "open_reply", "elastic_from_env",
           "elastic_timeout_from_env"]

METHOD = "/hostreduce.Elastic/Call"
REQUEST_KEY = "hr-elastic"        # the metadata key of a sealed request
MAX_REQUEST_BYTES = 2048          # a request: a few hundred bytes
# A reply listing every member's address: a few KiB.
MAX_MESSAGE_BYTES = 64 * 1024
SECRET_VAR = "HOSTREDUCE_SECRET"                    # the job's secret, as every task reads it
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


_HEX = re.compile(rb"[0-9a-f]{64}")


def _split(data: bytes, limit: int) -> tuple[bytes, bytes]:
    if not isinstance(data, (bytes, bytearray)) or len(data) > limit:
        raise WireError(f"a message of at most {limit} bytes was expected")
    mac, sep, body = bytes(data).partition(b".")
    if not sep or _HEX.fullmatch(mac) is None:
        raise WireError("not a sealed message")
    return mac, body


def _parse(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise WireError(f"not JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise WireError("not a JSON object")
    return obj


def seal_request(secret: str, request: Mapping[str, Any]) -> tuple[str, str]:
    """The request as the ASCII text of its metadata value, and its nonce (which the
    reply must cover)."""
    nonce = secrets.token_hex(16)
    body = json.dumps({**request, "nonce": nonce})   # ASCII: json escapes the rest
    return _mac(secret, "request", body.encode()) + "." + body, nonce


def open_request(secret: str, data: str | bytes) -> dict[str, Any]:
    """The request in ``data`` (a metadata value); WireError if it is malformed or not
    sealed with ``secret``."""
    if isinstance(data, str):
        try:
            data = data.encode("ascii")
        except UnicodeEncodeError:
            raise WireError("not a sealed message") from None
    mac, body = _split(data, MAX_REQUEST_BYTES)
    if not hmac.compare_digest(mac, _mac(secret, "request", body).encode()):
        raise WireError("wrong or missing shared secret")
    request = _parse(body)
    nonce = request.get("nonce")
    if not isinstance(nonce, str) or re.fullmatch(r"[0-9a-f]{32}", nonce) is None:
        raise WireError("no nonce")
    return request


def seal_reply(secret: str, nonce: str, reply: Mapping[str, Any]) -> bytes:
    body = json.dumps(dict(reply)).encode()
    return _mac(secret, "reply", nonce.encode(), body).encode() + b"." + body


def open_reply(secret: str, nonce: str, data: bytes) -> dict[str, Any]:
    mac, body = _split(data, MAX_MESSAGE_BYTES)
    if not hmac.compare_digest(mac, _mac(secret, "reply", nonce.encode(), body).encode()):
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
