"""A ps task: serves its shard of the variables over gRPC until the chief ends the job.

One generic gRPC service (``SERVICE``) bound to exactly the address the cluster
gives this task. ``Hello``/``Login`` are the handshake (``handshake.py``); every other
method takes and returns one ``wire`` message and runs only for an authenticated
worker: which handler a call gets is decided from its metadata before its body is read
(``_Admission``), so a stranger's call is refused unread and holds no thread; the
handler then checks, still before the body, that the session's token comes on the
connection that logged in (``handshake.py``) and that the call carries a deadline of at
most :meth:`ParameterServer.call_limit_s`. gRPC refuses a message over
``max_message_bytes`` from its length, unbuffered. Errors
travel as the call's status with ``"<ErrorClass>: message"`` as its details, and the
client raises the same class.

``mode="sync"``: a push carries one worker's gradients of step S for this ps and
returns when every worker's have been summed and applied (``barrier.py``).
``mode="async"``: each push is applied on arrival; a worker silent for ``timeout_s``
is logged as lost and the others go on.

Workers: the chief registers the variables and ``Open``s the ps once they hold the
values to start from (after a restore), so no worker pulls values in between. Every
other worker says ``Done`` when its process ends (with its error if it failed); a worker
silent for ``timeout_s`` (every worker sends a heartbeat) or never heard of within
``timeout_s`` of the registration is lost. ``Info`` reports them, so the chief can end
the job only once every worker is done or lost.

What a ps accepts from an authenticated worker (a buggy or compromised one included):

- a push is checked whole before any of it is applied (``ShardStore.check_push``:
  known names, exact shapes and dtypes, integral 1-D row ids in range, and with
  ``nonfinite="refuse"`` no NaN or Inf); in sync mode a refused push fails its step for
  every worker of it with the same error, and nothing of the step is applied;
- a pull's names and row ids are checked the same way;
- control calls are the chief's (worker 0): ``Register`` (and so holding the ps),
  ``Open``, ``Pause``/``Resume`` (a checkpoint's cut, ``cut.py``), ``Save``, ``Restore``,
  ``Shutdown``. ``Save`` and ``Restore`` work only under
  the ``model_dir`` the chief registered (its real path: no ``..`` or symbolic link leads
  out), and ``Save`` only at a step the ps has reached (sync: its step; async: the
  highest step a push reported).

``startup_timeout_s``: a job that does not form ends too. Unless the chief has
registered the variables within that time of this ps's start (or of the chief's first
login here, if later), serving ends with :attr:`failure` naming why: the chief never
logged in, or did but never registered (it failed elsewhere: another ps, its model);
which workers did log in; what was refused meanwhile (another secret, a cluster whose
worker or ps count differs from this ps's).

``chief_timeout_s``: once the chief (worker 0) has called, a chief silent for that long
(its strategy sends a heartbeat) ends the serving with :attr:`failure` set, so a ps of
a job whose chief was killed does not serve forever. The chief's ``Shutdown`` says
whether the job succeeded (:attr:`failure` names it when not).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent import futures
from typing import Any, Callable

import numpy as np

from ..errors import ClusterError, ConfigError, HostReduceError, RoleError, TensorMismatchError
from ..transport.grpc_options import grpc_options, server_credentials
from .checkpoint import load_part, read_index, write_shard
from .wire import METHODS, SERVICE, WireError, pack, unpack
from .barrier import StepBarrier
from .cut import ApplyGate
from .handshake import Gate
from .placement import Placement
from .store import Contribution, ShardStore

__all__ = ["ParameterServer"]

log = logging.getLogger("hostreduce.ps")

# The furthest deadline a call may carry (at least; 4 x timeout_s when longer): the
# chief's checkpoint and registration calls move whole shards, the others one step.
_CONTROL_CALLS = frozenset({"Register", "Save", "Restore"})
_CONTROL_CALL_S, _DATA_CALL_S = 600.0, 60.0


class ParameterServer:
    def __init__(self, index: int, ps_addresses: list[str] | tuple[str, ...], num_workers: int, secret: str, *,
                 mode: str = "sync", timeout_s: float = 30.0, reduce: str = "sum",
                 chief_timeout_s: float | None = None, tune_malloc: bool = True, nonfinite: str = "apply",
                 startup_timeout_s: float | None = None, max_message_bytes: int = 1 << 30,
                 tls: tuple[bytes, bytes] | None = None) -> None:
        if mode not in ("sync", "async"):
            raise ConfigError(f"`mode` must be 'sync' or 'async'. Received: mode={mode!r}")
        if reduce not in ("sum", "mean"):
            raise ConfigError(f"`reduce` must be 'sum' or 'mean'. Received: reduce={reduce!r}")
        if nonfinite not in ("apply", "refuse"):
            raise ConfigError(f"`nonfinite` must be 'apply' or 'refuse'. Received: nonfinite={nonfinite!r}")
        if not isinstance(index, int) or not 0 <= index < len(ps_addresses):
            raise ClusterError(f"`index` must be in [0, {len(ps_addresses)}). Received: index={index!r}")
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ClusterError(f"`num_workers` must be an integer >= 1. Received: num_workers={num_workers!r}")
        if not secret:
            raise ConfigError("`secret` must be a non-empty string (HOSTREDUCE_SECRET). Received: secret=''")
        self.index, self.addresses, self.num_workers = index, tuple(ps_addresses), num_workers
        self.mode, self.timeout_s = mode, float(timeout_s)
        self.store = ShardStore(index)
        self.barrier = StepBarrier(index, num_workers, self._apply_step, lambda: self.store.step, reduce=reduce)
        self.gate = Gate(index, num_workers, len(ps_addresses), secret)
        self.applies = ApplyGate(index)    # async: pushes counted per worker, paused for a checkpoint's cut
        self._held: tuple[int, dict[str, np.ndarray]] | None = None  # the last cut's step and snapshot
        self.bytes_in: dict[str, int] = {}
        self.bytes_out: dict[str, int] = {}
        self._seen: dict[int, float] = {}
        self._lost: set[int] = set()
        self._finished: dict[int, str | None] = {}  # worker -> its error, or None (Done)
        self._registered_at: float | None = None
        self._opened = False
        self._stopped = threading.Event()
        self._server: Any = None
        self.chief_timeout_s = chief_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._started_at = time.monotonic()
        self.tune_malloc = tune_malloc     # Config.tune_malloc, as the ring's processes
        self.failure: str | None = None   # why serving ended other than by a successful job's Shutdown
        # NaN/Inf gradients: applied, as TensorFlow's optimizers do, or refused.
        self.refuse_nonfinite = nonfinite == "refuse"
        self.model_dir: str | None = None  # the real path Save and Restore stay under (the chief's Register)
        self._reached = 0                  # async: the highest step a checked push reported
        self.max_message_bytes = max_message_bytes  # gRPC refuses a larger request unread (Config.ps_max_message_bytes)
        self._tls = tls                    # (certificate chain, private key) PEM: serve over TLS

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        import grpc

        if self.tune_malloc:  # each step's message buffers: reused, not page-faulted in afresh
            from ..transport.malloc import tune_malloc

            tune_malloc()
        addr = self.addresses[self.index]
        # Strangers hold no thread (their calls are answered or refused at once, unread),
        # so the pool is the workers': a few calls each at once (a step's pull and push,
        # a heartbeat, Done), the chief's control calls, and room for handshakes.
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4 * self.num_workers + 8,
                                                              thread_name_prefix=f"hostreduce-ps{self.index}"),
                                   options=grpc_options(self.timeout_s, self.max_message_bytes))
        handlers = {"Hello": grpc.stream_unary_rpc_method_handler(self.gate.hello),
                    "Login": grpc.stream_unary_rpc_method_handler(self.gate.login)}
        for name in METHODS:
            # stream_unary: the handler runs before the body is read, so that it checks the
            # session's connection and the call's deadline first.
            handlers[name] = grpc.stream_unary_rpc_method_handler(self._wrap(name, getattr(self, f"_{name.lower()}")))
        self._server.add_generic_rpc_handlers((_Admission(self.gate, handlers),))
        try:
            bound = (self._server.add_secure_port(addr, server_credentials(*self._tls)) if self._tls
                     else self._server.add_insecure_port(addr))
        except RuntimeError:
            bound = 0
        if not bound:
            raise ClusterError(f"ps task {self.index} cannot listen on {addr!r}: the port is taken or the address "
                               "is not local")
        self._server.start()
        self._started_at = time.monotonic()
        threading.Thread(target=self._watch, daemon=True, name=f"hostreduce-ps{self.index}-watch").start()
        log.info("ps task %d serving on %s (%s, %d workers)", self.index, addr, self.mode, self.num_workers)

    def serve(self) -> None:
        """Start, serve until the chief calls ``Shutdown``, then return."""
        if self._server is None:
            self.start()
        self._stopped.wait()
        self.stop()

    def stop(self) -> None:
        self._stopped.set()
        self.gate.refusals.flush(force=True)
        # Pushes still waiting for a step would hold their threads (and the process's
        # exit) until their wait ends; no worker will complete that step now.
        self.barrier.abort(self.failure or "the chief ended the job")
        self.applies.abort(self.failure or "the chief ended the job")
        if self._server is not None:
            self._server.stop(grace=1.0).wait()

    def _watch(self) -> None:
        period = max(0.1, min(self.timeout_s, self.chief_timeout_s or self.timeout_s,
                              self.startup_timeout_s or self.timeout_s) / 4)
        while not self._stopped.wait(period):
            now = time.monotonic()
            self.gate.refusals.flush()
            if self._registered_at is None and self.startup_timeout_s:
                since = max(self._started_at, self.gate.logins().get(0, self._started_at))
                if now - since > self.startup_timeout_s:
                    self.failure = self._startup_failure(now)
                    log.error("%s; this ps stops serving", self.failure)
                    self._stopped.set()
                    return
            chief = self._seen.get(0)
            if self.chief_timeout_s and chief is not None and now - chief > self.chief_timeout_s:
                self.failure = (f"ps task {self.index}: the chief (worker 0) has not called for {now - chief:.1f} s "
                                f"(chief_timeout_s={self.chief_timeout_s:g}): its process ended without ending "
                                "the job")
                log.error("%s; this ps stops serving", self.failure)
                self._stopped.set()
                return
            if self._registered_at is None:
                continue
            for rank in range(self.num_workers):
                seen = self._seen.get(rank, self._registered_at)
                if now - seen > self.timeout_s and rank not in self._lost and rank not in self._finished:
                    self._lost.add(rank)
                    log.warning("ps task %d: worker %d %s for %.1f s (timeout_s=%g): lost%s", self.index, rank,
                                "has not called" if rank in self._seen else "never called", now - seen,
                                self.timeout_s, "; async training goes on without it" if self.mode == "async" else "")

    def _startup_failure(self, now: float) -> str:
        logins = self.gate.logins()
        if 0 in logins:
            text = (f"the chief (worker 0) logged in {now - logins[0]:.1f} s ago but never registered the variables "
                    "(it failed before: with another ps, or building its model)")
        else:
            text = "the chief (worker 0) never logged in to this ps"
        others = sorted(r for r in logins if r)
        text += f"; worker(s) {others} logged in" if others else "; no other worker logged in"
        refused = self.gate.refusals.by_claim()
        if refused:
            text += "; refused meanwhile: " + "; ".join(
                f"{n} connection(s) that claimed to be worker {r} ({why})" for r, (n, why) in sorted(refused.items()))
        elif self.gate.refusals.count:
            text += f"; refused meanwhile {self.gate.refusals.count} connection(s) that failed the handshake"
        return (f"ps task {self.index}: the job did not form within startup_timeout_s={self.startup_timeout_s:g}: "
                + text)

    # ------------------------------------------------------------------ dispatch
    def call_limit_s(self, name: str) -> float:
        """The furthest deadline a call of method ``name`` may carry: a call without a
        deadline, or with a later one, is refused unread, so that no call holds a handler
        thread for longer (a worker that never sends its request, or a sync push whose
        step never completes, is bounded by its deadline)."""
        return max(_CONTROL_CALL_S if name in _CONTROL_CALLS else _DATA_CALL_S, 4 * self.timeout_s)

    def _wrap(self, name: str, fn: Callable[..., tuple[dict, list[np.ndarray]]]) -> Callable[[Any, Any], bytes]:
        limit = self.call_limit_s(name)

        def handler(request_iterator: Any, context: Any) -> bytes:
            import grpc

            # Before the body is read: the session's connection, then the deadline.
            rank = self.gate.worker(context)
            left = context.time_remaining()
            if left > limit:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"ConfigError: ps task {self.index}: a {name} call must carry a deadline of at most "
                              f"{limit:g} s. Received: " + ("no deadline" if left > 1e9 else f"{left:.0f} s"))
            self._seen[rank] = time.monotonic()
            if rank in self._lost:
                self._lost.discard(rank)
                log.warning("ps task %d: worker %d is back", self.index, rank)
            request = next(request_iterator, None)
            if request is None:  # cancelled, or its deadline passed, before the request came
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ConfigError: ps task {self.index}: a {name} "
                              "call without a request")
            self.bytes_in[name] = self.bytes_in.get(name, 0) + len(request)
            try:
                header, arrays = unpack(request)
                reply = pack(*fn(rank, header, arrays, context))
            except WireError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ConfigError: ps task {self.index}: {e}")
            except RoleError as e:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{type(e).__name__}: {e}")
            except HostReduceError as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{type(e).__name__}: {e}")
            except (KeyError, ValueError, TypeError) as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"ConfigError: ps task {self.index}: malformed {name} request ({type(e).__name__}: {e})")
            self.bytes_out[name] = self.bytes_out.get(name, 0) + len(reply)
            return reply
        return handler

    def _logout(self, rank: int, h: dict, a: list, ctx: Any) -> tuple[dict, list]:
        self.gate.logout(ctx)
        return {}, []

    def _info(self, rank: int, h: dict, a: list, ctx: Any) -> tuple[dict, list]:
        p = self.store.placement
        return {"placement": p.to_json() if p else None, "optimizer": self.store.optimizer_config,
                "step": self.store.step, "mode": self.mode, "open": self._opened,
                "workers": {"done": sorted(r for r, e in self._finished.items() if e is None),
                            "failed": {str(r): e for r, e in self._finished.items() if e is not None},
                            "lost": sorted(self._lost)}}, []

    def _chief(self, rank: int, call: str) -> None:
        if rank != 0:
            raise RoleError(f"ps task {self.index}: only the chief (worker 0) may call {call}. Received: {call} "
                            f"from worker {rank}")

    def _register(self, rank: int, h: dict, a: list, ctx: Any) -> tuple[dict, list]:
        self._chief(rank, "Register")
        placement = Placement.from_json(h["placement"])
        if placement.num_ps != len(self.addresses):
            raise ClusterError(f"registration placed variables over {placement.num_ps} ps; this job has "
                               f"{len(self.addresses)}")
        names = _names(h, "names")
        if len(names) != len(a):
            raise TensorMismatchError(f"Register: {len(names)} names for {len(a)} arrays")
        model_dir = h.get("model_dir")
        if model_dir is not None:
            if not isinstance(model_dir, str) or not model_dir:
                raise ConfigError(f"`model_dir` must be a non-empty path. Received: model_dir={model_dir!r}")
            model_dir = os.path.realpath(model_dir)
            if self.model_dir is not None and model_dir != self.model_dir:
                raise RoleError(f"ps task {self.index} serves model_dir {self.model_dir!r}; a registration named "
                                f"another. Received: model_dir={model_dir!r}")
        new = self.store.register(placement, h["optimizer"], dict(zip(names, a)))
        if model_dir is not None:
            self.model_dir = model_dir
        if new and type(h.get("step")) is int and h["step"] >= 0:
            self.store.step = h["step"]  # a job resumed from a checkpoint without ps shards
        self._opened = not h.get("hold", False)
        if self._registered_at is None:
            self._registered_at = time.monotonic()
        return {"new": new}, []

    def _open(self, rank: int, h: dict, a: list, ctx: Any) -> tuple[dict, list]:
        self._chief(rank, "Open")
        self._opened = True
        return {}, []

    def _done(self, rank: int, h: dict, a: list, ctx: Any) -> tuple[dict, list]:
        failure = h.get("failure")
        self._finished[rank] = str(failure)[:500] if failure else None
        self._lost.discard(rank)
        if failure:
            log.warning("ps task %d: worker %d failed: %s%s", self.index, rank, failure,
                        "; async training goes on without it" if self.mode == "async" else "")
        return {}, []

    def _pulldense(self, rank: int, h: dict, a: list, ctx: Any) -> tuple[dict, list]:
        return {}, self.store.pull(_names(h, "names", distinct=False))

    def _pullrows(self, rank: int, h: dict, a: list, ctx: Any) -> tuple[dict, list]:
        """The rows of ``names`` at the ids in the arrays, then the values of the dense
        variables named ``dense`` (a training step's pull, one call)."""
        names, dense = _names(h, "names", distinct=False), _names(h, "dense", required=False, distinct=False)
        if len(names) != len(a):
            raise TensorMismatchError(f"PullRows: {len(names)} names for {len(a)} id arrays")
        rows = [self.store.pull_rows(n, ids) for n, ids in zip(names, a)]
        return {}, rows + self.store.pull(dense)

    def _push(self, rank: int, h: dict, a: list, ctx: Any) -> tuple[dict, list]:
        step = h.get("step")
        wait = self._wait_s(ctx)
        if self.mode == "async":
            counted = type(step) is int
            self.applies.enter(rank, counted, wait)  # waits while the chief holds a checkpoint's cut
            try:
                part = self._check_push(h, a)
                self._apply_step(None, part)
            finally:
                self.applies.leave(rank, counted)
            if counted and step > self._reached:
                self._reached = step
            return {}, []
        if type(step) is not int:
            raise ConfigError(f"`step` must be an integer in sync mode. Received: step={step!r}")
        try:
            part = self._check_push(h, a)
        except HostReduceError as e:
            raise self.barrier.refuse(rank, step, e) from None
        self.barrier.arrive(rank, step, part, wait)
        return {"step": self.store.step}, []

    def _wait_s(self, ctx: Any) -> float:
        """How long a call may wait for others here: ``timeout_s``, within its deadline."""
        left = ctx.time_remaining()
        return self.timeout_s if left is None else max(0.05, min(self.timeout_s, left - 0.5))

    def _check_push(self, h: dict, a: list) -> Contribution:
        """The push in ``h`` and ``a``, checked whole (``ShardStore.check_push``)."""
        try:
            dense_names, row_names = _names(h, "dense"), _names(h, "rows")
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"ps task {self.index}: malformed Push header ({type(e).__name__}: {e})") from None
        both = set(dense_names) & set(row_names)
        if both:
            raise ConfigError(f"ps task {self.index}: a push names {sorted(both)[:5]} both as dense and as rows")
        if len(a) != len(dense_names) + 2 * len(row_names):
            raise TensorMismatchError(f"Push: {len(a)} arrays for {len(dense_names)} dense and {len(row_names)} rows")
        dense = dict(zip(dense_names, a[:len(dense_names)]))
        rest = a[len(dense_names):]
        rows = {n: (rest[2 * i], rest[2 * i + 1]) for i, n in enumerate(row_names)}
        return self.store.check_push(dense, rows, finite=self.refuse_nonfinite)

    def _apply_step(self, step: int | None, part: Contribution) -> None:
        self.store.apply(part)
        if step is not None:
            self.store.step = step

    def _checkpoint_dir(self, h: dict, call: str) -> str:
        """The directory ``h`` names, if it is the registered ``model_dir`` or inside it."""
        directory = h.get("dir")
        if not isinstance(directory, str) or not directory:
            raise ConfigError(f"`dir` of {call} must be a non-empty path. Received: dir={directory!r}")
        if self.model_dir is None:
            raise RoleError(f"ps task {self.index}: {call} needs the chief to register a model_dir first (saves "
                            f"and restores stay under it). Received: {call} of {directory!r}")
        real = os.path.realpath(directory)
        if os.path.commonpath([real, self.model_dir]) != self.model_dir:
            raise RoleError(f"ps task {self.index}: {call} only under model_dir {self.model_dir!r}. Received: "
                            f"dir={directory!r} (real path {real!r})")
        return real

    def _save_step(self, h: dict, call: str) -> int:
        """The step ``h`` names, if this ps may save it: in sync mode its own step, in
        async mode one some push reported."""
        step = h.get("step")
        reached = self.store.step if self.mode == "sync" else max(self.store.step, self._reached)
        if type(step) is not int or step < 0:
            raise ConfigError(f"`step` of {call} must be an integer >= 0. Received: step={step!r}")
        if (self.mode == "sync" and step != reached) or step > reached:
            raise TensorMismatchError(f"ps task {self.index} is at step {reached}; asked to save step {step}")
        if self.store.placement is None:
            raise ConfigError(f"ps task {self.index}: nothing to save, no variables are registered")
        return step

    def _pause(self, rank: int, h: dict, a: list, ctx: Any) -> tuple[dict, list]:
        """The chief's cut (``cut.py``): hold the async applies, let through the pushes
        ``until`` names; the counts of pushes settled per worker. (Sync mode: nothing to
        hold, a step completes only with the chief's push.)"""
        self._chief(rank, "Pause")
        until = h.get("until") or {}
        if not isinstance(until, dict) or not all(
                isinstance(r, str) and r.isdigit() and int(r) < self.num_workers and type(n) is int and n >= 0
                for r, n in until.items()):
            raise ConfigError(f"`until` of Pause must map worker ranks to counts. Received: until={str(until)[:80]}")
        if self.mode == "sync":
            return {"settled": {}}, []
        settled = self.applies.pause({int(r): n for r, n in until.items()}, self._wait_s(ctx),
                                     lambda: self._lost | set(self._finished))
        return {"settled": {str(r): n for r, n in settled.items()}}, []

    def _resume(self, rank: int, h: dict, a: list, ctx: Any) -> tuple[dict, list]:
        """End the chief's cut: snapshot the shard for a ``Save`` of ``snapshot`` (the
        step), if named, then let the applies go on."""
        self._chief(rank, "Resume")
        try:
            if h.get("snapshot") is not None:
                step = self._save_step({"step": h["snapshot"]}, "Resume")
                self._held = (step, self.store.snapshot())
        finally:
            self.applies.resume()
        return {}, []

    def _save(self, rank: int, h: dict, a: list, ctx: Any) -> tuple[dict, list]:
        self._chief(rank, "Save")
        directory = self._checkpoint_dir(h, "Save")
        step = self._save_step(h, "Save")
        held, self._held = self._held, None
        arrays = held[1] if held is not None and held[0] == step else self.store.snapshot()
        path = write_shard(directory, step, self.index, self.store.placement.num_ps, arrays)  # type: ignore[union-attr]
        return {"path": path}, []

    def _restore(self, rank: int, h: dict, a: list, ctx: Any) -> tuple[dict, list]:
        self._chief(rank, "Restore")
        directory = self._checkpoint_dir(h, "Restore")
        index = read_index(directory)
        p = self.store.placement
        if index is None or p is None:
            raise ConfigError(f"ps task {self.index}: no ps checkpoint in {directory!r}" if index is None
                              else f"ps task {self.index}: register the variables before restoring")
        slots = tuple(self.store.optimizer.slots)  # type: ignore[union-attr]
        arrays = load_part(directory, index, p, self.index, slots)
        self.store.load(arrays, int(index["step"]))
        return {"step": self.store.step}, []

    def _shutdown(self, rank: int, h: dict, a: list, ctx: Any) -> tuple[dict, list]:
        self._chief(rank, "Shutdown")
        if h.get("failure"):
            self.failure = f"ps task {self.index}: the chief ended the job after a failure: {h['failure']}"
        threading.Timer(0.2, self._stopped.set).start()  # after this reply is on its way
        return {}, []


def _names(h: dict, key: str, *, required: bool = True, distinct: bool = True) -> list[str]:
    """The list of variable names at ``h[key]``, each once if ``distinct`` (absent: []
    unless ``required``)."""
    if key not in h and not required:
        return []
    names = h[key]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"`{key}` must be a list of variable names. Received: {key}={str(names)[:80]}")
    if distinct and len(set(names)) != len(names):
        raise ConfigError(f"`{key}` must name each variable once. Received: {key}={str(names)[:80]}")
    return names


class _Admission:
    """Which handler a call gets, decided from its method and metadata alone, before
    gRPC reads its body or gives it a thread (``grpc.GenericRpcHandler``'s ``service``
    runs on the server's polling thread): an unknown method is refused there (gRPC
    answers UNIMPLEMENTED), a call without a valid session token gets a handler that
    refuses it without reading its body, and ``Hello``/``Login`` read only metadata."""

    def __init__(self, gate: Gate, handlers: dict[str, Any]) -> None:
        import grpc

        self._gate = gate
        self._prefix = f"/{SERVICE}/"
        self._handlers = handlers
        self._refuse = grpc.stream_unary_rpc_method_handler(gate.no_session)
        self._open = {"Hello", "Login"}

    def service(self, details: Any) -> Any:
        method = details.method if isinstance(details.method, str) else ""
        name = method[len(self._prefix):] if method.startswith(self._prefix) else None
        handler = self._handlers.get(name) if name else None
        if handler is None:
            self._gate.refusals.refuse("an unknown peer", None, f"unknown method {method[:80]!r}", set(),
                                       kind="unknown method")
            return None
        if name in self._open or self._gate.session(details.invocation_metadata) is not None:
            return handler
        return self._refuse
