"""The gRPC settings of every hostreduce channel and server (the ring's mesh and the
parameter servers), so that both ends of either service agree on them."""
from __future__ import annotations

from typing import Any

__all__ = ["grpc_options", "read_pem", "server_credentials", "channel_credentials"]


def grpc_options(timeout_s: float, max_receive_bytes: int = -1) -> list[tuple[str, Any]]:
    """Options for ``grpc.server`` and ``grpc.insecure_channel`` of a service whose calls
    wait at most ``timeout_s`` for a peer.

    - Messages sent: no size limit from gRPC. Messages received: at most
      ``max_receive_bytes`` (-1: no limit, the service bounds what it accepts itself);
      gRPC refuses a larger message from its length prefix (``RESOURCE_EXHAUSTED``),
      before buffering it.
    - Keepalive pings every ``timeout_s / 2`` (between 1 and 5 s), also on idle
      connections, so a peer that vanished without closing its socket is noticed; a ping
      unanswered for ``timeout_s`` (at least 1 s) closes the connection, no sooner than
      the services' own timeouts would fail a call.
    - Each end accepts the other's pings at that rate on connections that carry no data
      (instead of closing them with "too many pings").
    - A refused connection is retried every 0.1-1 s, not on gRPC's default backoff (1 s
      growing to 120 s), so that a peer that starts late is seen soon.
    """
    return [
        ("grpc.max_send_message_length", -1),
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", int(min(5000, max(1000, timeout_s * 500)))),
        ("grpc.keepalive_timeout_ms", int(max(1.0, timeout_s) * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.enable_retries", 0),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


def read_pem(path: str, what: str) -> bytes:
    """The bytes of the PEM file ``path`` (``what``: the setting that names it, for the error)."""
    from ..errors import ConfigError

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"`{what}` must name a readable PEM file. Received: {what}={path!r} ({e.strerror})") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"`{what}` must name a PEM file (-----BEGIN ...). Received: {what}={path!r}")
    return data


def server_credentials(cert_chain: bytes, private_key: bytes) -> Any:
    """TLS for a server: its certificate chain and private key (PEM)."""
    import grpc

    return grpc.ssl_server_credentials([(private_key, cert_chain)])


def channel_credentials(root_certificates: bytes) -> Any:
    """TLS for a channel that trusts the servers whose certificates ``root_certificates``
    (PEM: a CA, or the servers' self-signed certificates) signed."""
    import grpc

    return grpc.ssl_channel_credentials(root_certificates=root_certificates)
