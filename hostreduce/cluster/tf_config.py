"""Turn a TensorFlow cluster description (``TF_CONFIG`` or a cluster resolver) into a
:class:`ClusterSpec`, write the ``TF_CONFIG`` of a worker, and check ``host:port``
addresses. This is the one place that knows the ``TF_CONFIG`` format.

The all-reduce ring is the ``chief`` (if any) followed by the ``worker`` tasks, so a
chief is rank 0 and worker ``i`` is rank ``i + 1`` when a chief is present, ``i``
otherwise, exactly as TensorFlow's multi-worker strategies number them. ``ps`` and
``evaluator`` tasks may appear in the cluster but never join the ring: building a ring
on one is an error, while ``roles=True`` (parameter-server mode) describes them too, each
alone in its group, with the ps and training tasks' addresses beside.
"""
from __future__ import annotations

import difflib
import ipaddress
import json
import operator
import re
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from ..errors import ClusterError
from .spec import ClusterSpec

__all__ = [
    "TF_CONFIG",
    "RING_TASK_TYPES",
    "TASK_TYPES",
    "split_address",
    "check_addresses",
    "local_placement",
    "parse_tf_config",
    "format_tf_config",
    "spec_from_cluster",
    "cluster_from_resolver",
]

TF_CONFIG = "TF_CONFIG"
RING_TASK_TYPES = ("chief", "worker")
TASK_TYPES = ("chief", "worker", "ps", "evaluator")

_MAX_PORT = 65535
_HOST_RE = re.compile(r"[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:.]+(%[A-Za-z0-9_.\-]+)?\]")
_LOOPBACK_RE = re.compile(r"127(\.\d{1,3}){3}")
_TASK_TYPE_HINTS = {
    "master": "'master' is the TensorFlow 1 name of the chief; use 'chief'.",
    "workers": "Did you mean 'worker'?",
    "chiefs": "Did you mean 'chief'?",
    "eval": "Did you mean 'evaluator'?",
}


def _show(value: Any, limit: int = 200) -> str:
    """``repr`` of a received value, shortened so that error messages stay readable."""
    try:
        text = repr(value)
    except RecursionError:
        return f"<{_type_name(value)[2:].lstrip()} nested too deeply to show>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _type_name(value: Any) -> str:
    """The JSON-flavoured type of ``value`` with its article: ``a list``, ``an integer``."""
    names = {dict: "object", list: "list", str: "string", int: "integer", bool: "boolean", type(None): "null"}
    name = names.get(type(value), type(value).__name__)
    return ("an " if name[0] in "aeiou" else "a ") + name


# --------------------------------------------------------------------------- addresses


def split_address(address: Any, field: str) -> tuple[str, int]:
    """Split ``host:port`` into its parts, raising a ``ClusterError`` naming ``field``.

    The host is a DNS name, an IPv4 address or a bracketed IPv6 address (``[::1]:80``);
    the port is an integer in [1, 65535].
    """
    if not isinstance(address, str):
        raise ClusterError(
            f"`{field}` must be a 'host:port' string. Received: {field}={_show(address)} "
            f"({_type_name(address)})"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ClusterError(f"`{field}` must be a 'host:port' string. Received: {field}={address!r}")
    if not _HOST_RE.fullmatch(host):
        hint = " Write IPv6 hosts in brackets, e.g. '[::1]:2222'." if ":" in host else ""
        raise ClusterError(
            f"`{field}` must be a 'host:port' string with a valid host name.{hint} "
            f"Received: {field}={address!r}"
        )
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= _MAX_PORT:
        raise ClusterError(
            f"`{field}` must have an integer port in [1, {_MAX_PORT}]. Received: {field}={address!r}"
        )
    return host, int(port)


def _host_key(host: str) -> str:
    """The name under which two hosts count as the same machine (loopback names merge)."""
    low = host.lower()
    if low in ("localhost", "[::1]", "ip6-localhost") or _LOOPBACK_RE.fullmatch(low):
        return "localhost"
    return low


def _endpoints(host: str, port: int) -> list[tuple[str, int]]:
    """The endpoints a ``host:port`` may stand for, spelled one way: IP literals in
    their canonical form (``[0:0:0:0:0:0:0:1]`` is ``::1``, ``[::ffff:127.0.0.1]`` is
    ``127.0.0.1``), ``localhost`` as both loopback addresses, other names lower-case."""
    name = host.lower().rstrip(".")
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        ip = None
    if ip is not None:
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return [(str(ip), port)]
    if name == "localhost":
        return [("127.0.0.1", port), ("::1", port)]
    if name == "ip6-localhost":
        return [("::1", port)]
    return [(name, port)]


def _check_unique(entries: Iterable[tuple[str, str]]) -> None:
    """Raise if two ``(field, address)`` entries name the same endpoint, however spelled."""
    seen: dict[tuple[str, int], tuple[str, str]] = {}
    for field, address in entries:
        host, port = split_address(address, field)
        keys = _endpoints(host, port)
        for key in keys:
            if key in seen:
                first, spelled = seen[key]
                same = "" if spelled == address else f" ({spelled!r} and {address!r} are the same endpoint)"
                raise ClusterError(
                    f"`{field}` repeats the address of `{first}`{same}; every task needs its own "
                    f"address. Received: {field}={address!r}"
                )
        for key in keys:
            seen[key] = (field, address)


def check_addresses(addresses: Any, field: str = "addresses") -> tuple[str, ...]:
    """Validate a sequence of distinct ``host:port`` strings and return it as a tuple."""
    if isinstance(addresses, (str, bytes)) or not isinstance(addresses, Sequence):
        hint = " Pass a list, e.g. ['host1:2222', 'host2:2222']." if isinstance(addresses, str) else ""
        raise ClusterError(
            f"`{field}` must be a list of 'host:port' strings.{hint} "
            f"Received: {field}={_show(addresses)} ({_type_name(addresses)})"
        )
    entries = [(f"{field}[{i}]", address) for i, address in enumerate(addresses)]
    _check_unique(entries)
    return tuple(addresses)


def local_placement(addresses: Sequence[str], rank: int) -> tuple[int, int]:
    """``(local_rank, local_size)`` of ``rank``: its position among the ranks that share
    its host, in rank order, and how many ranks that host holds."""
    keys = [_host_key(a.rpartition(":")[0]) for a in addresses]
    mine = keys[rank]
    return keys[:rank].count(mine), keys.count(mine)


# --------------------------------------------------------------------------- cluster


class _Fields(NamedTuple):
    """How the fields of one cluster description are named in error messages."""

    cluster: str
    task_type: str
    task_index: str


_TF_CONFIG_FIELDS = _Fields("cluster", "task.type", "task.index")
_RESOLVER_FIELDS = _Fields("resolver.cluster_spec()", "resolver.task_type", "resolver.task_id")


def _unknown_task_type(subject: str, received: str, value: Any) -> ClusterError:
    """The error for a task type outside ``TASK_TYPES``, with a hint for likely typos."""
    hint = _TASK_TYPE_HINTS.get(str(value).lower()) if isinstance(value, str) else None
    if hint is None and isinstance(value, str):
        close = difflib.get_close_matches(value.lower(), TASK_TYPES, n=1)
        hint = f"Did you mean {close[0]!r}?" if close else None
    return ClusterError(
        f"{subject} must be one of {TASK_TYPES}.{' ' + hint if hint else ''} Received: {received}"
    )


def _job_addresses(job: Any, field: str) -> list[str]:
    """The address list of one job, accepting ``{index: address}`` only when dense."""
    if isinstance(job, Mapping):
        try:
            indices = sorted(operator.index(k) if not isinstance(k, str) else int(k) for k in job)
        except (TypeError, ValueError):
            indices = None
        if indices is None or indices != list(range(len(job))):
            raise ClusterError(
                f"`{field}` must be a list of 'host:port' strings (or a mapping with task "
                f"indices 0..n-1). Received: {field}={_show(job)}"
            )
        job = [job[k] if k in job else job[str(k)] for k in range(len(job))]
    if isinstance(job, (str, bytes)) or not isinstance(job, (list, tuple)):
        raise ClusterError(
            f"`{field}` must be a list of 'host:port' strings. "
            f"Received: {field}={_show(job)} ({_type_name(job)})"
        )
    for i, address in enumerate(job):
        if not isinstance(address, str):
            raise ClusterError(
                f"`{field}` must be a list of 'host:port' strings. "
                f"Received: {field}[{i}]={_show(address)} ({_type_name(address)})"
            )
    return list(job)


def spec_from_cluster(
    cluster: Any, task_type: Any, task_index: Any, *, fields: _Fields = _TF_CONFIG_FIELDS, roles: bool = False
) -> ClusterSpec:
    """Build the spec of task ``(task_type, task_index)`` in a ``{job: [host:port]}``
    cluster; ``roles``: a ``ps`` or ``evaluator`` task is allowed (parameter-server mode)."""
    c = fields.cluster
    if not isinstance(cluster, Mapping):
        raise ClusterError(
            f"`{c}` must be an object mapping task types to address lists. "
            f"Received: {c}={_show(cluster)} ({_type_name(cluster)})"
        )
    jobs: dict[str, list[str]] = {}
    for name, job in cluster.items():
        if name not in TASK_TYPES:
            raise _unknown_task_type(f"Keys of `{c}`", f"key {_show(name)} in {c}", name)
        jobs[name] = _job_addresses(job, f"{c}.{name}")
    chief, workers = jobs.get("chief", []), jobs.get("worker", [])
    if len(chief) > 1:
        raise ClusterError(
            f"`{c}.chief` must list at most one address. Received: {c}.chief={_show(chief)}"
        )
    _check_unique((f"{c}.{name}[{i}]", a) for name, job in jobs.items() for i, a in enumerate(job))
    if not chief and not workers:
        raise ClusterError(
            f"`{c}` must list at least one 'chief' or 'worker' address to form the "
            f"all-reduce ring. Received: {c}={_show(dict(cluster))}"
        )

    tt, ti = fields.task_type, fields.task_index
    if not isinstance(task_type, str):
        raise ClusterError(
            f"`{tt}` must be a string. Received: {tt}={_show(task_type)} ({_type_name(task_type)})"
        )
    if task_type not in TASK_TYPES:
        raise _unknown_task_type(f"`{tt}`", f"{tt}={task_type!r}", task_type)
    if task_type not in RING_TASK_TYPES and not roles:
        raise ClusterError(
            f"`{tt}` must be 'chief' or 'worker' to join the all-reduce ring; 'ps' and "
            f"'evaluator' tasks do not take part in all-reduce, so do not build a reducer "
            f"on them. Received: {tt}={task_type!r}"
        )
    if task_type not in jobs:
        raise ClusterError(
            f"`{tt}` must name a task type listed in `{c}` ({sorted(jobs)}). Received: {tt}={task_type!r}"
        )
    if isinstance(task_index, bool) or not isinstance(task_index, int):
        hint = " Write it as a JSON number." if isinstance(task_index, str) else ""
        raise ClusterError(
            f"`{ti}` must be an integer.{hint} Received: {ti}={_show(task_index)} "
            f"({_type_name(task_index)})"
        )
    count = len(jobs[task_type])
    if not 0 <= task_index < count:
        raise ClusterError(
            f"`{ti}` must be in [0, {count}) for task type {task_type!r}. Received: {ti}={task_index}"
        )

    ring = tuple(chief + workers)
    extra = {"ps_addresses": tuple(jobs.get("ps", ())), "worker_addresses": ring,
             "has_evaluator": bool(jobs.get("evaluator"))}
    if task_type not in RING_TASK_TYPES:  # a ps or the evaluator: alone in its group
        return ClusterSpec(task_type=task_type, task_index=task_index, source=TF_CONFIG, **extra)
    rank = 0 if task_type == "chief" else task_index + len(chief)
    local_rank, local_size = local_placement(ring, rank)
    return ClusterSpec(
        rank=rank,
        size=len(ring),
        local_rank=local_rank,
        local_size=local_size,
        addresses=ring,
        task_type=task_type,
        task_index=task_index,
        source=TF_CONFIG,
        **extra,
    )


def parse_tf_config(raw: str, *, roles: bool = False) -> ClusterSpec:
    """Parse the JSON text of ``TF_CONFIG`` into a spec (``roles``: as for
    :func:`spec_from_cluster`)."""
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ClusterError(
            f"`{TF_CONFIG}` must be valid JSON: {e.msg} at line {e.lineno} column {e.colno} "
            f"(char {e.pos}). Received: {TF_CONFIG}={_show(raw)}"
        ) from None
    except RecursionError:
        raise ClusterError(
            f"`{TF_CONFIG}` must be a JSON object with 'cluster' and 'task' fields; its arrays or objects are "
            f"nested too deeply to parse. Received: {TF_CONFIG}={_show(raw)}"
        ) from None
    if not isinstance(config, dict):
        raise ClusterError(
            f"`{TF_CONFIG}` must be a JSON object with 'cluster' and 'task' fields. "
            f"Received: {TF_CONFIG}={_show(raw)} ({_type_name(config)})"
        )
    for key in ("cluster", "task"):
        if key not in config:
            raise ClusterError(
                f"`{TF_CONFIG}` must have a `{key}` field. Received: {TF_CONFIG} with fields "
                f"{sorted(config)}"
            )
    task = config["task"]
    if not isinstance(task, dict):
        raise ClusterError(
            f"`task` must be an object with 'type' and 'index' fields. "
            f"Received: task={_show(task)} ({_type_name(task)})"
        )
    for key in ("type", "index"):
        if key not in task:
            raise ClusterError(
                f"`task.{key}` is required in {TF_CONFIG}. Received: task={_show(task)}"
            )
    return spec_from_cluster(config["cluster"], task["type"], task["index"], roles=roles)


def format_tf_config(addresses: Sequence[str] | Mapping[str, Sequence[str]], index: int,
                     task_type: str = "worker") -> str:
    """The ``TF_CONFIG`` JSON of task ``index`` of ``task_type`` (what
    :func:`parse_tf_config` reads back).

    ``addresses`` is either the addresses of the ``task_type`` tasks (a cluster of
    workers, or of one chief) or the whole cluster, task type -> addresses, with any of
    ``chief``, ``worker``, ``ps`` and ``evaluator``: a parameter-server job.
    """
    if isinstance(addresses, Mapping):
        allowed, cluster = TASK_TYPES, {}
        for kind, where in addresses.items():
            if kind not in TASK_TYPES:
                raise ClusterError(f"`addresses` must map task types {TASK_TYPES} to addresses. "
                                   f"Received: task type {kind!r}")
            if where:
                cluster[kind] = list(check_addresses(where))
        check_addresses([a for where in cluster.values() for a in where])  # no address twice in the job
    else:
        allowed, cluster = RING_TASK_TYPES, {task_type: list(check_addresses(addresses))}
    if task_type not in allowed:
        raise ClusterError(f"`task_type` must be one of {allowed}. Received: task_type={task_type!r}")
    mine = cluster.get(task_type, [])
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(mine):
        raise ClusterError(f"`index` must be an integer in [0, {len(mine)}). Received: index={index!r}")
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def cluster_from_resolver(resolver: Any, *, roles: bool = False) -> ClusterSpec:
    """Build a spec from a TensorFlow cluster resolver such as ``TFConfigClusterResolver``.

    Any object with ``cluster_spec().as_dict()``, ``task_type`` and ``task_id`` works;
    TensorFlow itself is never imported here.
    """
    try:
        cluster = resolver.cluster_spec().as_dict()
        task_type, task_id = resolver.task_type, resolver.task_id
    except AttributeError as e:
        raise ClusterError(
            "`resolver` must provide `cluster_spec().as_dict()`, `task_type` and `task_id`, "
            f"like tf.distribute.cluster_resolver.TFConfigClusterResolver ({e}). "
            f"Received: resolver={_show(resolver)}"
        ) from None
    if task_type is None or task_id is None:
        raise ClusterError(
            "`resolver.task_type` and `resolver.task_id` must be set. "
            f"Received: resolver.task_type={task_type!r}, resolver.task_id={task_id!r}"
        )
    if not isinstance(task_id, bool):
        try:
            task_id = operator.index(task_id)
        except TypeError:
            pass
    return spec_from_cluster(cluster, task_type, task_id, fields=_RESOLVER_FIELDS, roles=roles)
