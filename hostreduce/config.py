"""One frozen, validated configuration object for every hostreduce component.

Precedence for each field: an explicit argument, then the ``HOSTREDUCE_<FIELD>``
environment variable, then the default. Unknown keys and unknown ``HOSTREDUCE_*``
variables are rejected so that a typo never silently falls back to a default.
Importing this module never writes to the environment.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from .errors import ConfigError

__all__ = ["Config", "ENV_PREFIX"]

ENV_PREFIX = "HOSTREDUCE_"

# Variables that share the prefix but are not configuration fields (set by the launcher
# or read by other components).
_RESERVED_ENV = frozenset({"HOSTREDUCE_TIMELINE", "HOSTREDUCE_ELASTIC", "HOSTREDUCE_ELASTIC_WORKER",
                           "HOSTREDUCE_ELASTIC_HOST", "HOSTREDUCE_ELASTIC_TIMEOUT_S"})

_TRANSPORTS = ("auto", "tcp", "grpc", "shm")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _parse_bool(name: str, raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"`{name}` must be a boolean (1/0, true/false). Received: {name}={raw!r}")


_MAX_GRPC_MESSAGE = (1 << 31) - 1  # gRPC takes message sizes as a C int


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of the reduction engine.

    Attributes:
        reducer: engine name: ``ring``, ``mpi``, ``horovod``, ``local`` or one added
            with ``hostreduce.register_reducer`` (checked by ``create_reducer``).
        transport: the ring's data path: ``auto`` (shared memory when every peer is
            on this host, ``tcp`` otherwise), ``tcp`` (a TCP connection per pair of
            ranks for the data, opened and authenticated during the start-up on ports
            the system picks; gRPC carries the control messages), ``grpc`` (the data
            too goes over the gRPC port: where only that port is open between hosts)
            or ``shm`` (one host only).
        timeout_s: longest wait for any peer before raising ``PeerLostError`` or
            ``CollectiveTimeoutError``.
        connect_timeout_s: longest wait for every peer to come up at start.
        fusion_threshold_bytes: small tensors are packed into buckets up to this size.
        chunk_bytes: the ring streams data in chunks of this size so that sending,
            receiving and reducing overlap.
        cycle_time_ms: how long the coordinator waits to gather more ready tensors into
            one fusion bucket once the first is ready (0 = fuse only what is ready).
        secret: shared secret proving job membership (hex or any string); required by
            the ring when world size > 1.
        bind_host: address the ring server listens on; empty means the host part of this
            rank's address in the cluster spec.
        log_level: level of the ``hostreduce`` logger; empty (the default) leaves the
            logging configuration to the application.
        single_copy: on the shared-memory path, let each rank read its peers' buffers
            directly (Linux cross-memory attach; probed at start, with a fallback to
            copying through shared segments when the system forbids it).
        tune_malloc: raise glibc's malloc thresholds so that per-message buffers are
            reused instead of page-faulted in afresh (see ``transport/malloc.py``),
            in the ring's processes and in parameter servers.
        fast_lane: on one host, a blocking ``allreduce`` with nothing else in flight on
            its rank skips the negotiation through rank 0 when every rank submits the
            same collective: the ranks agree through shared memory and the calling
            threads run it (see ``reducers/ring/reducer.py``).
        compression: the default wire compression of all-reduce, reduce-scatter and
            reduce: ``none``, ``fp16`` or ``bf16`` (float arrays travel and are summed in
            16 bits; see ``reducers/compression.py``). A collective's own
            ``compression=`` wins.
        ps_max_message_bytes: the largest message a parameter server receives
            (gRPC refuses a larger one from its length, before buffering it): at least
            the chief's registration of one ps's share of the variables and one
            worker's push to it, with margin.
        ps_tls_cert, ps_tls_key: PEM files of a parameter server's TLS certificate
            (chain) and private key; set both to serve over TLS, neither to serve in
            plain text.
        ps_tls_ca: the PEM file of the certificates a worker trusts for the ps (their
            CA, or the ps's self-signed certificate); set it to connect over TLS.
    """

    reducer: str = "ring"
    transport: str = "auto"
    timeout_s: float = 30.0
    connect_timeout_s: float = 60.0
    fusion_threshold_bytes: int = 64 * 1024 * 1024
    chunk_bytes: int = 1024 * 1024
    cycle_time_ms: float = 0.0
    secret: str | None = dataclasses.field(default=None, repr=False)
    bind_host: str = ""
    log_level: str = ""
    single_copy: bool = True
    tune_malloc: bool = True
    fast_lane: bool = True
    compression: str = "none"
    ps_max_message_bytes: int = 1 << 30
    ps_tls_cert: str = ""
    ps_tls_key: str = ""
    ps_tls_ca: str = ""

    def __post_init__(self) -> None:
        # Which names exist is the registry's to say (an engine added with
        # ``register_reducer`` is chosen like a built-in one): checked at creation.
        if not isinstance(self.reducer, str) or not self.reducer.strip():
            raise ConfigError(f"`reducer` must be the name of a registered engine. Received: reducer={self.reducer!r}")
        if self.transport not in _TRANSPORTS:
            raise ConfigError(
                f"`transport` must be one of {_TRANSPORTS}. Received: transport={self.transport!r}"
            )
        for name in ("timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"`{name}` must be a number > 0. Received: {name}={value!r}")
        if not isinstance(self.cycle_time_ms, (int, float)) or self.cycle_time_ms < 0:
            raise ConfigError(f"`cycle_time_ms` must be a number >= 0. Received: cycle_time_ms={self.cycle_time_ms!r}")
        for name, low in (("fusion_threshold_bytes", 0), ("chunk_bytes", 1024)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"`{name}` must be an integer >= {low}. Received: {name}={value!r}")
        value = self.ps_max_message_bytes
        if not isinstance(value, int) or isinstance(value, bool) or not (1 << 20) <= value <= _MAX_GRPC_MESSAGE:
            raise ConfigError(f"`ps_max_message_bytes` must be an integer in [{1 << 20}, {_MAX_GRPC_MESSAGE}] (1 MiB "
                              f"to gRPC's limit). Received: ps_max_message_bytes={value!r}")
        if bool(self.ps_tls_cert) != bool(self.ps_tls_key):
            raise ConfigError("`ps_tls_cert` and `ps_tls_key` go together: set both to serve over TLS, or neither. "
                              f"Received: ps_tls_cert={self.ps_tls_cert!r}, ps_tls_key={self.ps_tls_key!r}")
        if self.secret is not None and (not isinstance(self.secret, str) or not self.secret):
            raise ConfigError("`secret` must be a non-empty string or None. Received: an empty or non-string value")
        if self.compression not in ("none", "fp16", "bf16"):
            raise ConfigError(f"`compression` must be one of ['none', 'fp16', 'bf16']. "
                              f"Received: compression={self.compression!r}")
        if self.log_level and self.log_level.upper() not in _LOG_LEVELS:
            raise ConfigError(f"`log_level` must be one of {_LOG_LEVELS}. Received: log_level={self.log_level!r}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "Config":
        """Build a config: explicit ``overrides`` > ``HOSTREDUCE_*`` variables > defaults.

        ``None`` values in ``overrides`` mean "not given" and fall through to the
        environment.
        """
        env = os.environ if env is None else env
        names = cls.field_names()
        unknown = [k for k in overrides if k not in names]
        if unknown:
            raise ConfigError(f"Unknown config key(s) {sorted(unknown)}. Valid keys: {list(names)}")
        values: dict[str, Any] = {}
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for key, raw in env.items():
            if not key.startswith(ENV_PREFIX) or key in _RESERVED_ENV:
                continue
            name = key[len(ENV_PREFIX):].lower()
            if name not in names:
                raise ConfigError(
                    f"Unknown environment variable {key}={raw!r}. Valid variables: "
                    f"{[ENV_PREFIX + n.upper() for n in names] + sorted(_RESERVED_ENV)}"
                )
            values[name] = _coerce(key, types[name], raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def replace(self, **changes: Any) -> "Config":
        unknown = [k for k in changes if k not in self.field_names()]
        if unknown:
            raise ConfigError(f"Unknown config key(s) {sorted(unknown)}. Valid keys: {list(self.field_names())}")
        return dataclasses.replace(self, **changes)


def _coerce(key: str, typ: Any, raw: str) -> Any:
    typ = str(typ)
    try:
        if typ.startswith("int"):
            return int(raw)
        if typ.startswith("float"):
            return float(raw)
        if typ.startswith("bool"):
            return _parse_bool(key, raw)
    except ValueError:
        raise ConfigError(f"Environment variable {key} must be a {typ}. Received: {key}={raw!r}") from None
    return raw
