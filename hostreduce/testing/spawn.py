"""Run one function in N separate processes, as the ranks of a local job, for tests.

Every rank gets ``TF_CONFIG`` for a cluster of loopback addresses and a shared fresh
``HOSTREDUCE_SECRET``. A failing or hanging rank ends the whole run at once, and no
rank process outlives the call. The error for ranks that did not finish in time shows
every thread's stack of each, taken just before it was killed.
"""
from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Mapping, Sequence

from ..cluster import format_tf_config
from ..errors import ConfigError, RankFailedError, RankTimeoutError
from ..processes import alive as _alive, free_ports
from ._stacks import collect as collect_stacks, install as install_stacks
from .preloading import Inherited, rank_context

__all__ = [
    "run_ranks",
    "run_ranks_allow_failure",
    "RankFailedError",
    "RankTimeoutError",
    "RankOutcome",
]

_SECRET_VAR = "HOSTREDUCE_SECRET"
_HOST = "127.0.0.1"


class RankOutcome(str):
    """How a rank ended without returning a value; compares equal to its text.

    The text is ``"<ExceptionType>: <message>"`` when the rank raised, ``"killed"``
    when it was killed by a signal, ``"exited with code N"`` when it exited without
    returning, and ``"timeout"`` when it had not finished in time.

    Attributes:
        kind: ``error``, ``killed``, ``exited`` or ``timeout``.
        exc_type: name of the exception type (``error`` only, else '').
        traceback: the formatted traceback (``error``), every thread's stack when the
            time was up (``timeout``), else ''.
        exitcode: the process exit code (negative signal number when killed), or None.
    """

    kind: str
    exc_type: str
    traceback: str
    exitcode: int | None

    def __new__(
        cls, text: str, kind: str, exc_type: str = "", traceback_text: str = "", exitcode: int | None = None
    ) -> "RankOutcome":
        obj = super().__new__(cls, text)
        obj.kind = kind
        obj.exc_type = exc_type
        obj.traceback = traceback_text
        obj.exitcode = exitcode
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (RankOutcome, (str(self), self.kind, self.exc_type, self.traceback, self.exitcode))


# --------------------------------------------------------------------------- child side


def _die_with_parent(parent_pid: int, forked: bool) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (best effort). A rank
    forked by the fork server (``forked``) dies with the server, which ends when the
    caller does."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if (not forked and os.getppid() != parent_pid) or not _alive(parent_pid):
        os._exit(1)


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    env: Mapping[str, str | None],
    conn: multiprocessing.connection.Connection,
    parent_pid: int,
    inherited: Inherited | None = None,
    stacks_path: str | None = None,
) -> None:
    """Body of one rank process: set up the environment, run ``fn``, report back."""
    if stacks_path is not None:  # what the parent reads when this rank does not finish in time
        install_stacks(stacks_path)
    try:
        os.setsid()  # Own process group, so the parent can kill whatever this rank starts.
    except OSError:
        pass
    _die_with_parent(parent_pid, forked=inherited is not None)
    if inherited is not None:
        inherited.apply()
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        result = fn(rank, world_size, *args)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent.
        report: tuple[Any, ...] = ("error", type(exc).__name__, str(exc), traceback.format_exc())
    else:
        report = ("ok", result)
    try:
        conn.send(report)
    except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable result.
        conn.send(("error", type(exc).__name__, f"cannot send the result of rank {rank}: {exc}",
                   traceback.format_exc()))
    finally:
        conn.close()


# -------------------------------------------------------------------------- parent side

_live: set[multiprocessing.process.BaseProcess] = set()
_live_lock = threading.Lock()


def _kill(proc: multiprocessing.process.BaseProcess) -> None:
    """SIGKILL a rank and everything in its process group, then reap it."""
    if proc.pid is not None:
        for kill in (os.killpg, os.kill):
            try:
                kill(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    proc.join(timeout=10.0)
    with _live_lock:
        _live.discard(proc)


@atexit.register
def _kill_all_live() -> None:
    with _live_lock:
        procs = list(_live)
    for proc in procs:
        _kill(proc)


def _check_args(fn: Any, world_size: Any, timeout: Any, env: Any) -> None:
    if not callable(fn):
        raise TypeError(f"`fn` must be a callable. Received: fn={fn!r}")
    if getattr(fn, "__name__", "") == "<lambda>" or "<locals>" in getattr(fn, "__qualname__", ""):
        raise TypeError(
            f"`fn` must be an importable top-level function (ranks run in fresh processes). Received: fn={fn!r}"
        )
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"`world_size` must be an integer >= 1. Received: world_size={world_size!r}")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise ConfigError(f"`timeout` must be a number > 0. Received: timeout={timeout!r}")
    if env is not None and not isinstance(env, Mapping):
        raise TypeError(f"`env` must be a mapping of names to strings or None. Received: env={env!r}")


def _rank_env(
    rank: int, world_size: int, addresses: Sequence[str], secret: str,
    env: Mapping[str, str | None] | None, transport_env: bool,
) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    if transport_env:
        out["TF_CONFIG"] = format_tf_config(addresses, rank)
        out[_SECRET_VAR] = secret
    for key, value in (env or {}).items():
        out[str(key)] = None if value is None else str(value)
    return out


def _run(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], timeout: float,
    env: Mapping[str, str | None] | None, transport_env: bool, stop_on_failure: bool,
) -> tuple[list[Any], list[int], int | None]:
    """Run the ranks; returns (outcome per rank, ranks that timed out, first failed rank)."""
    _check_args(fn, world_size, timeout, env)
    ctx, inherited = rank_context(env or {})
    addresses = [f"{_HOST}:{p}" for p in free_ports(world_size, _HOST)] if transport_env else []
    secret = secrets.token_hex(32)
    stacks_dir = tempfile.mkdtemp(prefix="hostreduce-stacks-")
    stacks_paths = {rank: os.path.join(stacks_dir, str(rank)) for rank in range(world_size)}
    stacks: dict[int, str] = {}
    procs: list[multiprocessing.process.BaseProcess] = []
    conns: list[multiprocessing.connection.Connection] = []
    outcomes: dict[int, Any] = {}
    timed_out: list[int] = []
    first_failed: int | None = None
    try:
        for rank in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, tuple(args),
                      _rank_env(rank, world_size, addresses, secret, env, transport_env), send_end, os.getpid(),
                      inherited, stacks_paths[rank]),
                name=f"rank{rank}",
            )
            with _live_lock:
                _live.add(proc)
            proc.start()
            send_end.close()
            procs.append(proc)
            conns.append(recv_end)

        deadline = time.monotonic() + timeout
        pending = set(range(world_size))
        closed: set[int] = set()
        while pending and not (first_failed is not None and stop_on_failure):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = sorted(pending)
                stacks = collect_stacks({r: procs[r] for r in timed_out}, stacks_paths)
                break
            waitables: list[Any] = [conns[r] for r in pending if r not in closed]
            waitables += [procs[r].sentinel for r in pending]
            ready = set(multiprocessing.connection.wait(waitables, timeout=remaining))
            for rank in sorted(pending):
                conn, proc = conns[rank], procs[rank]
                if conn not in ready and proc.sentinel not in ready:
                    continue
                report = None
                try:
                    if rank not in closed and (conn in ready or conn.poll(0)):
                        report = conn.recv()
                except (EOFError, OSError):
                    report = None
                if report is None:
                    if proc.sentinel not in ready and proc.is_alive():
                        closed.add(rank)  # Pipe closed before the exit; wait for the sentinel.
                        continue
                    proc.join(timeout=5.0)
                    code = proc.exitcode
                    if code is not None and code < 0:
                        outcomes[rank] = RankOutcome("killed", "killed", exitcode=code)
                    else:
                        outcomes[rank] = RankOutcome(f"exited with code {code}", "exited", exitcode=code)
                elif report[0] == "ok":
                    outcomes[rank] = report[1]
                else:
                    _, exc_type, message, tb = report
                    outcomes[rank] = RankOutcome(f"{exc_type}: {message}", "error", exc_type, tb)
                pending.discard(rank)
                if first_failed is None and isinstance(outcomes[rank], RankOutcome):
                    first_failed = rank
    finally:
        for proc in procs:
            _kill(proc)
        for conn in conns:
            conn.close()
        shutil.rmtree(stacks_dir, ignore_errors=True)
    for rank in timed_out:
        outcomes[rank] = RankOutcome("timeout", "timeout", traceback_text=stacks.get(rank, ""))
    for rank in range(world_size):
        outcomes.setdefault(rank, RankOutcome("killed", "killed", exitcode=procs[rank].exitcode))
    return [outcomes[r] for r in range(world_size)], timed_out, first_failed


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout: float = 60.0,
    env: Mapping[str, str | None] | None = None,
    transport_env: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return the results.

    Args:
        fn: an importable top-level function; its return value must be picklable.
        world_size: number of rank processes, >= 1.
        args: extra positional arguments (picklable) passed to every rank.
        timeout: seconds to wait for every rank.
        env: variables set in every rank's environment before ``fn`` runs; a value of
            None removes the variable. Applied after (and so overriding) the job
            variables below.
        transport_env: when True, every rank gets ``TF_CONFIG`` for a cluster of free
            loopback ports and a shared fresh ``HOSTREDUCE_SECRET``.

    Returns:
        The return value of every rank, in rank order.

    Raises:
        RankFailedError: a rank raised or died; every other rank is killed at once.
        RankTimeoutError: ``timeout`` elapsed; every rank is killed, those that had not
            finished after every thread's stack is taken from them for the message.
    """
    outcomes, timed_out, rank = _run(
        fn, world_size, tuple(args), timeout, env, transport_env, stop_on_failure=True
    )
    if rank is not None:
        out = outcomes[rank]
        if out.kind == "error":
            message = f"rank {rank} of {world_size} failed with {out}\n\n{out.traceback}"
        else:
            message = f"rank {rank} of {world_size} died without returning a result ({out}, exit code {out.exitcode})"
        raise RankFailedError(message, rank, out.exc_type or out.kind, out.traceback)
    if timed_out:
        stacks = {r: outcomes[r].traceback for r in timed_out}
        raise RankTimeoutError(
            f"ranks {timed_out} of {world_size} had not finished after {timeout:g} s; all ranks were killed. "
            "Every thread's stack of each when the time was up:\n"
            + "".join(f"\n--- rank {r} ---\n{stacks[r]}\n" for r in timed_out),
            timed_out, stacks,
        )
    return outcomes


def run_ranks_allow_failure(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout: float = 60.0,
    env: Mapping[str, str | None] | None = None,
    transport_env: bool = True,
) -> list[Any]:
    """Like :func:`run_ranks`, but wait for every rank and never raise for a rank.

    Returns:
        One entry per rank, in rank order: the rank's return value, or a
        :class:`RankOutcome` string: ``"<ExceptionType>: <message>"`` when it raised,
        ``"killed"`` when a signal killed it, ``"exited with code N"`` when it exited
        without returning, ``"timeout"`` when it had not finished within ``timeout``
        (its ``traceback``: every thread's stack then).
    """
    outcomes, _, _ = _run(fn, world_size, tuple(args), timeout, env, transport_env, stop_on_failure=False)
    return outcomes
