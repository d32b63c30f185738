"""Start rank processes from a fork server that has imported heavy modules once.

A rank normally starts as a fresh interpreter, which imports everything it uses:
TensorFlow alone takes seconds of CPU per rank. After ``preload(["tensorflow"])``, ranks
are forked from one server process (``multiprocessing``'s forkserver) that imported
TensorFlow when it started, and begin in a fraction of a second. The server has started
no TensorFlow runtime (it only imported the modules), so each rank still builds its own.

A forked rank would otherwise see the server's environment and output streams, which
are those of the moment the server started: each rank gets the caller's current
environment and standard output and error passed along instead. Variables that a
module may read while it is imported (``TF_*``, ``KERAS_*``, ``CUDA_*``, thread counts
of the math libraries), read by the server long before, cannot be changed that way: a
run whose ranks would see other values of them than the server saw starts its ranks
fresh, as without preloading.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import threading
from typing import Any, Mapping, Sequence

__all__ = ["preload", "rank_context", "Inherited"]

# Read while a preloaded module is imported, so fixed in the server from then on.
_IMPORT_TIME_PREFIXES = ("TF_", "KERAS_", "CUDA_", "OMP_", "OPENBLAS_", "MKL_", "PYTHON")
# ... except these, read when used: the cluster, and how much TensorFlow logs.
_READ_WHEN_USED = frozenset({"TF_CONFIG", "TF_CPP_MIN_LOG_LEVEL", "TF_CPP_MAX_VLOG_LEVEL"})

_lock = threading.Lock()
_modules: tuple[str, ...] = ()
_server_env: dict[str, str] | None = None  # the environment the server started with
_server_modules: tuple[str, ...] = ()


def preload(modules: Sequence[str] | None) -> list[str]:
    """Start the ranks of later ``run_ranks`` calls from a fork server that imports
    ``modules`` once (e.g. ``["tensorflow"]``); None or ``[]`` starts every rank as a
    fresh interpreter again. Modules that cannot be imported are skipped. The server
    starts with the first run after this call and serves the rest of the process's
    life, so the list cannot change once it has started. Returns the modules preloaded
    before the call."""
    global _modules
    names = () if modules is None else tuple(modules)
    if isinstance(modules, str) or not all(isinstance(m, str) and m for m in names):
        raise TypeError(f"`modules` must be a list of module names or None. Received: modules={modules!r}")
    with _lock:
        if _server_env is not None and names and names != _server_modules:
            raise RuntimeError(f"the fork server already runs with modules {list(_server_modules)} preloaded; "
                               f"it cannot change to {list(names)} (call preload once, before the first run)")
        before, _modules = list(_modules), names
    return before


def _import_time(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_TIME_PREFIXES) and k not in _READ_WHEN_USED}


def rank_context(rank_env: Mapping[str, str | None]) -> tuple[Any, "Inherited | None"]:
    """The multiprocessing context for a run whose ranks add ``rank_env`` to the
    caller's environment, and what a forked rank must take over from the caller
    (None for fresh ranks)."""
    global _server_env, _server_modules
    wanted = dict(os.environ)
    for key, value in rank_env.items():
        if value is None:
            wanted.pop(key, None)
        else:
            wanted[key] = str(value)
    with _lock:
        if not _modules:
            return multiprocessing.get_context("spawn"), None
        ctx = multiprocessing.get_context("forkserver")
        if _server_env is None:
            ctx.set_forkserver_preload(list(_modules))
            multiprocessing.forkserver.ensure_running()
            _server_env, _server_modules = dict(os.environ), _modules
        if _import_time(wanted) != _import_time(_server_env):
            return multiprocessing.get_context("spawn"), None
    return ctx, Inherited(dict(os.environ))


class _Fd:
    """A file descriptor of the caller, duplicated into the rank as it is started."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return (_identity, (multiprocessing.reduction.DupFd(self.fd),))


def _identity(x: Any) -> Any:
    return x


class Inherited:
    """The caller's environment and standard output and error, for a forked rank."""

    def __init__(self, environ: dict[str, str]) -> None:
        self.environ = environ
        self.streams = (_Fd(1), _Fd(2))

    def apply(self) -> None:
        for target, dup in zip((1, 2), self.streams):
            fd = dup.detach()  # type: ignore[attr-defined]  # a DupFd once unpickled
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(self.environ)
