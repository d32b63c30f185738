"""A worker's view of the parameter servers: one call fans out to every ps concerned at
once (blocking gRPC calls on ``calls.py``'s threads), and the answers are merged back into whole variables.

Rows: the ids of a lookup are made unique first, routed to the ps that hold them
(``placement.route``) and the pulled rows spread back over the original positions;
a gradient's duplicate rows are summed before they are sent. Traffic is thus one row
per distinct id of the batch, whatever the size of the table.

A session is bound to the connection that logged in (``handshake.py``): when a channel
reconnects, the ps refuses the next call unread and the client logs in again on the new
connection and repeats it, once. :meth:`close` ends the sessions.

Every call has a deadline of ``timeout_s``; a ps that dies or stops answering raises
PeerLostError naming its task and address at once (a closed connection) or at the
deadline (a hung one); the calls still in flight to the other ps are abandoned
(``calls.py``).
"""
from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Mapping, Sequence

import numpy as np

from .. import errors
from ..errors import ConfigError, PeerLostError
from ..transport.grpc_options import channel_credentials, grpc_options
from . import checkpoint, wire
from .calls import CallThreads
from .handshake import REBIND, SESSION_KEY, login
from .optimizers import HostOptimizer
from .placement import DEFAULT_SHARD_BYTES, Placement, VarSpec, place
from .rows import sum_duplicates

__all__ = ["PSClient"]

_GRACE_S = 5.0  # beyond a call's deadline, before its silence counts as the ps lost


class PSClient:
    def __init__(self, ps_addresses: Sequence[str], rank: int, num_workers: int, secret: str, *,
                 timeout_s: float = 30.0, connect_timeout_s: float = 60.0, tls_ca: bytes | None = None) -> None:
        if not ps_addresses:
            raise ConfigError("`ps_addresses` must name at least one ps task. Received: ps_addresses=[]")
        if not isinstance(rank, int) or not 0 <= rank < num_workers:
            raise ConfigError(f"`rank` must be in [0, {num_workers}). Received: rank={rank!r}")
        self.addresses, self.rank, self.num_workers = tuple(ps_addresses), rank, num_workers
        self.timeout_s, self._secret = float(timeout_s), secret
        self.placement: Placement | None = None
        self.bytes_sent: dict[str, int] = {}
        self.bytes_received: dict[str, int] = {}
        self._stubs: list[dict[str, Any]] = []
        self._meta: list[tuple] = []
        self._channels: list[Any] = []
        self._threads = CallThreads(f"hostreduce-ps-client{rank}")
        self._tls_ca = tls_ca  # PEM the ps's certificates are checked against: connect over TLS
        self._login_lock = threading.Lock()
        self._cut_step: int | None = None  # the step of the last cut, until its save
        self.logins = 0  # how many times this client logged in (once per ps, and once per reconnection)
        self._connect(connect_timeout_s)

    # ------------------------------------------------------------------ plumbing
    def _connect(self, connect_timeout_s: float) -> None:
        import grpc

        deadline = time.monotonic() + connect_timeout_s
        for m, addr in enumerate(self.addresses):
            options = grpc_options(self.timeout_s)
            channel = (grpc.secure_channel(addr, channel_credentials(self._tls_ca), options=options) if self._tls_ca
                       else grpc.insecure_channel(addr, options=options))
            self._channels.append(channel)
            self._meta.append(self._login(m, channel, deadline))
            self._stubs.append({n: channel.unary_unary(f"/{wire.SERVICE}/{n}") for n in wire.METHODS})

    def _login(self, m: int, channel: Any, deadline: float) -> tuple:
        token = login(channel, wire.SERVICE, self._secret, self.rank, m, self.num_workers, self.addresses[m],
                      deadline, num_ps=len(self.addresses))
        self.logins += 1
        return ((SESSION_KEY, token),)

    def _invoke(self, m: int, method: str, request: bytes, timeout: float) -> bytes:
        """One call to ps ``m``; when its channel has reconnected since the login (the ps
        refused the session unread), log in again there and repeat the call once."""
        import grpc

        meta = self._meta[m]
        try:
            return self._stubs[m][method](request, timeout=timeout, metadata=meta)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAUTHENTICATED or REBIND not in (e.details() or ""):
                raise
        with self._login_lock:
            if self._meta[m] is meta:  # not renewed by another call meanwhile
                self._meta[m] = self._login(m, self._channels[m], time.monotonic() + timeout)
            meta = self._meta[m]
        return self._stubs[m][method](request, timeout=timeout, metadata=meta)

    def _error(self, m: int, method: str, e: Any) -> Exception:
        import grpc

        code, details = e.code(), e.details() or ""
        where = f"ps task {m} at {self.addresses[m]!r}"
        if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.PERMISSION_DENIED) and ": " in details:
            kind, _, text = details.partition(": ")
            cls = getattr(errors, kind, None)
            if isinstance(cls, type) and issubclass(cls, errors.HostReduceError):
                return cls(f"Worker {self.rank}, {method} on {where}: {text}")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return ConfigError(f"Worker {self.rank}: {where} refused {method}: {details}. A ps receives messages of "
                               "at most ps_max_message_bytes (HOSTREDUCE_PS_MAX_MESSAGE_BYTES); raise it on the ps "
                               "for larger registrations or pushes")
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return errors.AuthenticationError(f"Worker {self.rank}: {where} refused {method}: {details}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return PeerLostError(f"Worker {self.rank}: {where} did not answer {method} within timeout_s="
                                 f"{self.timeout_s:g} (the ps is hung or unreachable)")
        return PeerLostError(f"Worker {self.rank}: {where} is lost: {method} failed with {code.name} ({details}); "
                             "its process ended or the network failed")

    def _call(self, method: str, requests: Mapping[int, bytes], timeout: float | None = None
              ) -> dict[int, tuple[dict, list[np.ndarray]]]:
        """Send ``requests[m]`` to every ps ``m`` at once; the unpacked replies by ps."""
        return self._call_all([(method, requests)], timeout)[0]

    def _call_all(self, batches: Sequence[tuple[str, Mapping[int, bytes]]], timeout: float | None = None
                  ) -> list[dict[int, tuple[dict, list[np.ndarray]]]]:
        """Every request of every ``(method, {ps: request})`` in flight at once (one
        round trip for all); the unpacked replies of each batch, by ps."""
        done: queue.Queue = queue.Queue()  # not a SimpleQueue: its get() can overrun its timeout
        deadline_s = timeout or self.timeout_s
        waiting = set()
        for i, (method, requests) in enumerate(batches):
            for m, req in requests.items():
                self.bytes_sent[method] = self.bytes_sent.get(method, 0) + len(req)
                waiting.add((i, m))
                self._threads.submit(self._invoke, (m, method, req, deadline_s),
                                     lambda raw, exc, i=i, m=m: done.put((i, m, raw, exc)))
        out: list[dict[int, tuple[dict, list[np.ndarray]]]] = [{} for _ in batches]
        # gRPC ends every call by its deadline; this bound only guards against a call
        # whose end is never reported, so that no wait here is without a limit.
        give_up = time.monotonic() + deadline_s + _GRACE_S
        while waiting:
            try:
                i, m, raw, exc = done.get(timeout=max(0.0, give_up - time.monotonic()))
            except queue.Empty:
                i, m = min(waiting)
                raise PeerLostError(f"Worker {self.rank}: ps task {m} at {self.addresses[m]!r} did not answer "
                                    f"{batches[i][0]} within {deadline_s:g} s (the ps is hung or unreachable)"
                                    ) from None
            waiting.discard((i, m))
            method = batches[i][0]
            if exc is not None:
                raise self._error(m, method, exc)
            self.bytes_received[method] = self.bytes_received.get(method, 0) + len(raw)
            out[i][m] = wire.unpack(raw)
        return out

    def _need(self) -> Placement:
        if self.placement is None:
            raise ConfigError(f"Worker {self.rank}: no variables yet; call register() (chief) or wait_ready()")
        return self.placement

    # ------------------------------------------------------------------ set-up
    def register(self, values: Mapping[str, np.ndarray], optimizer: HostOptimizer | dict, *,
                 shard_bytes: int = DEFAULT_SHARD_BYTES, step: int | None = None, hold: bool = False,
                 model_dir: str | None = None) -> Placement:
        """Place ``values`` over the ps and initialise them (the chief; a second call
        with the same variables keeps the values the ps hold); ``step``: the sync step
        the ps start from (the job's step when it resumes). ``hold``: other workers'
        :meth:`wait_ready` waits on until :meth:`open` (the chief restores first).
        ``model_dir``: the directory the ps checkpoints go under; :meth:`save` and
        :meth:`restore` are refused anywhere else (and everywhere without it)."""
        values = {n: np.asarray(v) for n, v in values.items()}
        config = optimizer.get_config() if isinstance(optimizer, HostOptimizer) else dict(optimizer)
        p = place([VarSpec(n, v.shape, v.dtype.name) for n, v in values.items()], len(self.addresses),
                  shard_bytes=shard_bytes)
        requests = {}
        for m in range(p.num_ps):
            names = p.on(m)
            parts = [p[n].split(values[n].astype(p[n].spec.dtype, copy=False))[m] for n in names]
            requests[m] = wire.pack({"placement": p.to_json(), "optimizer": config, "names": names, "step": step,
                                     "hold": hold, "model_dir": None if model_dir is None else os.path.abspath(model_dir)},
                                    parts)
        self._call("Register", requests, timeout=max(self.timeout_s, 60.0))
        self.placement = p
        return p

    def open(self) -> None:
        """The chief: the ps hold the values to start from; other workers may pull."""
        self._call("Open", {m: wire.pack({}) for m in range(len(self.addresses))})

    def wait_ready(self, timeout_s: float | None = None) -> Placement:
        """Wait until the chief registered the variables on every ps and opened them;
        their placement."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            infos = self._call("Info", {m: wire.pack({}) for m in range(len(self.addresses))})
            if all(h["placement"] is not None and h.get("open", True) for h, _ in infos.values()):
                self.placement = Placement.from_json(infos[0][0]["placement"])
                return self.placement
            if time.monotonic() > deadline:
                raise errors.CollectiveTimeoutError(f"Worker {self.rank}: the chief did not register the variables "
                                                    "on every ps within the timeout")
            time.sleep(0.05)

    # ------------------------------------------------------------------ pulls
    def pull(self, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """The current values of ``names`` (default: every variable), whole."""
        p = self._need()
        dense = self._dense_requests(list(p.entries) if names is None else list(names))
        return self._merge_dense(dense, self._call("PullDense", dense[2]))

    def pull_rows(self, ids: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """For each variable, its rows at ``ids`` (any shape, repeats allowed): an array
        of shape ``ids.shape + row shape``."""
        rows = self._rows_requests(ids)
        return self._merge_rows(rows, self._call("PullRows", rows[2]))

    def pull_step(self, ids: Mapping[str, np.ndarray], names: Sequence[str]
                  ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """``(pull_rows(ids), pull(names))`` in one call per ps, as a training step needs
        its rows and its dense variables: a ps's ``PullRows`` request names the dense
        variables it holds too, and its reply carries them after the rows. (Each call
        costs both ends far more than its bytes: the fewer, the shorter the step.)
        The bytes of the dense values are counted as ``PullDense``'s."""
        rows, dense = self._rows_requests(ids, pack=False), self._dense_requests(list(names), pack=False)
        requests = {}
        for m in range(self._need().num_ps):
            row_names, row_ids = rows[1][m]
            if row_names or dense[1][m]:
                requests[m] = wire.pack({"names": row_names, "dense": dense[1][m]}, row_ids)
        replies = self._call("PullRows", requests)
        row_replies, dense_replies = {}, {}
        for m, (header, arrays) in replies.items():
            k = len(rows[1][m][0])
            row_replies[m], dense_replies[m] = (header, arrays[:k]), (header, arrays[k:])
            moved = sum(a.nbytes for a in arrays[k:])
            self.bytes_received["PullRows"] -= moved
            self.bytes_received["PullDense"] = self.bytes_received.get("PullDense", 0) + moved
        return self._merge_rows(rows, row_replies), self._merge_dense(dense, dense_replies)

    def _dense_requests(self, names: list[str], pack: bool = True
                        ) -> tuple[list[str], dict[int, list[str]], dict[int, bytes]]:
        p = self._need()
        per_ps = {m: [n for n in names if p[n].local_rows(m) > 0 or p[n].ps == m] for m in range(p.num_ps)}
        return names, per_ps, {m: wire.pack({"names": ns}) for m, ns in per_ps.items() if ns and pack}

    def _merge_dense(self, request: tuple[list[str], dict[int, list[str]], dict[int, bytes]],
                     replies: Mapping[int, tuple[dict, list[np.ndarray]]]) -> dict[str, np.ndarray]:
        p = self._need()
        names, per_ps, _ = request
        parts: dict[str, dict[int, np.ndarray]] = {}
        for m, (_, arrays) in replies.items():
            for n, arr in zip(per_ps[m], arrays):
                parts.setdefault(n, {})[m] = arr
        out = {}
        for n in names:
            got = parts[n]
            out[n] = p[n].merge([got.get(m, np.empty((0,) + p[n].spec.shape[1:], p[n].spec.dtype))
                                 for m in range(p.num_ps)])
        return out

    def _rows_requests(self, ids: Mapping[str, np.ndarray], pack: bool = True
                       ) -> tuple[list, dict[int, tuple[list, list]], dict[int, bytes]]:
        p = self._need()
        plan, requests = [], {m: ([], []) for m in range(p.num_ps)}
        for n, raw in ids.items():
            flat = _ids(n, raw)
            if flat.ndim == 1 and bool(np.all(flat[1:] > flat[:-1])):  # sorted and distinct already (a step's ids)
                uniq, inverse = flat, None
            else:
                uniq, inverse = np.unique(flat.reshape(-1), return_inverse=True)
            routes = p[n].route(uniq)
            plan.append((n, flat.shape, uniq, inverse, routes))
            for m, (pos, local) in enumerate(routes):
                if len(pos):
                    requests[m][0].append(n)
                    requests[m][1].append(local)
        packed = {m: wire.pack({"names": ns}, arrs) for m, (ns, arrs) in requests.items() if ns and pack}
        return plan, requests, packed

    def _merge_rows(self, request: tuple[list, dict[int, tuple[list, list]], dict[int, bytes]],
                    replies: Mapping[int, tuple[dict, list[np.ndarray]]]) -> dict[str, np.ndarray]:
        p = self._need()
        plan, requests, _ = request
        got = {m: dict(zip(requests[m][0], arrays)) for m, (_, arrays) in replies.items()}
        out = {}
        for n, shape, uniq, inverse, routes in plan:
            rows = np.empty((len(uniq),) + p[n].spec.shape[1:], dtype=p[n].spec.dtype)
            for m, (pos, _) in enumerate(routes):
                if len(pos):
                    rows[pos] = got[m][n]
            out[n] = rows if inverse is None else np.take(rows, inverse.reshape(-1), axis=0).reshape(
                shape + rows.shape[1:])
        return out

    # ------------------------------------------------------------------ pushes
    def push(self, dense: Mapping[str, np.ndarray] | None = None,
             rows: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None, *, step: int | None = None) -> None:
        """Send gradients: ``dense`` whole, ``rows`` as ``(ids, values)`` (an
        IndexedSlices' indices and values). Sync mode: ``step`` is required, every ps
        gets a push (maybe empty) and the call returns when step ``step`` is applied.
        Async mode: ``step``, if given, is this worker's step count (every ps gets a
        push; the chief can save only at a step some push reported).

        A floating-point gradient of another precision than its variable is converted
        to the variable's dtype here (the dtype TensorFlow's optimizers apply in); any
        other dtype, and a shape other than the variable's, is refused. The ps check
        everything again and convert nothing."""
        p = self._need()
        dense, rows = dict(dense or {}), dict(rows or {})
        per_ps: dict[int, tuple[list, list, list, list]] = {m: ([], [], [], []) for m in range(p.num_ps)}
        for n, g in dense.items():
            g = _gradient(n, g, p[n].spec.dtype)
            if g.shape != tuple(p[n].spec.shape):
                raise errors.TensorMismatchError(f"Worker {self.rank}: the gradient of {n!r} must have shape "
                                                 f"{tuple(p[n].spec.shape)}. Received: shape={g.shape}")
            for m, part in enumerate(p[n].split(g)):
                if p[n].local_rows(m) > 0 or p[n].ps == m:
                    per_ps[m][0].append(n)
                    per_ps[m][1].append(part)
        for n, (ids, vals) in rows.items():
            vals = _gradient(n, vals, p[n].spec.dtype)
            uniq, summed = sum_duplicates(_ids(n, ids), vals.reshape((-1,) + tuple(p[n].spec.shape[1:])))
            for m, (pos, local) in enumerate(p[n].route(uniq)):
                if len(pos):
                    per_ps[m][2].append(n)
                    per_ps[m][3].extend((local, np.take(summed, pos, axis=0)))
        requests = {m: wire.pack({"step": step, "dense": d, "rows": r}, da + ra)
                    for m, (d, da, r, ra) in per_ps.items() if step is not None or d or r}
        self._call("Push", requests)

    # ------------------------------------------------------------------ job
    def cut(self, step: int, names: Sequence[str] = ()) -> dict[str, np.ndarray]:
        """The chief: every ps holds its shard as of one consistent point for a
        :meth:`save` of ``step`` (``cut.py``: async applies paused until every ps has
        settled the same pushes of every worker, then a snapshot, then the applies go
        on); returns the values of ``names`` at that point, whole, for the caller's own
        checkpoint. In sync mode the ps are at step ``step`` and nothing is paused."""
        count = len(self.addresses)
        resumed = False
        try:
            until: dict[str, int] = {}
            for _ in range(2):  # the second round lets the pushes in flight to some ps reach them
                replies = self._call("Pause", {m: wire.pack({"until": until}) for m in range(count)})
                settled = [replies[m][0]["settled"] for m in range(count)]
                target = {r: max(s.get(r, 0) for s in settled) for r in set().union(*settled)}
                if all(s.get(r, 0) == n for s in settled for r, n in target.items()):
                    break
                until = target
            values = self.pull(list(names)) if names else {}
            self._call("Resume", {m: wire.pack({"snapshot": step}) for m in range(count)})
            resumed = True
        finally:
            if not resumed:
                try:
                    self._call("Resume", {m: wire.pack({}) for m in range(count)})
                except errors.HostReduceError:
                    pass  # the error that ended the cut is the one to raise
        self._cut_step = step
        return values

    def save(self, directory: str, step: int, *, keep: int = 3, publish: bool = True) -> None:
        """Checkpoint every shard at ``step``, one consistent point of all of them (the
        :meth:`cut` of ``step`` made just before, else one made here); publish the index
        once all are written (``publish=False``: the caller publishes it later, with
        :meth:`publish`)."""
        p = self._need()
        if self._cut_step != step:
            self.cut(step)
        self._cut_step = None
        self._call("Save", {m: wire.pack({"dir": directory, "step": step}) for m in range(p.num_ps)},
                   timeout=max(self.timeout_s, 300.0))
        if publish:
            self.publish(directory, step, keep=keep)

    def publish(self, directory: str, step: int, *, keep: int = 3) -> None:
        """Name the shards of ``step`` (all written) as the checkpoint to restore."""
        checkpoint.publish_index(directory, step, self._need(), self._optimizer_config())
        checkpoint.prune(directory, keep)

    def _optimizer_config(self) -> dict:
        return self._call("Info", {0: wire.pack({})})[0][0]["optimizer"]

    def restore(self, directory: str) -> int | None:
        """Load the checkpoint ``directory``'s index names into every ps (re-sharded if it
        was written by another number of ps); its step, or None if there is none."""
        self._need()
        if checkpoint.read_index(directory) is None:
            return None
        replies = self._call("Restore", {m: wire.pack({"dir": directory}) for m in range(len(self.addresses))},
                             timeout=max(self.timeout_s, 300.0))
        return int(replies[0][0]["step"])

    def info(self) -> dict[str, Any]:
        """ps 0's state: ``step`` (the last step applied in sync mode), ``mode``,
        ``optimizer`` and ``placement`` (None before registration)."""
        return self._call("Info", {0: wire.pack({})})[0][0]

    def workers(self) -> dict[str, Any]:
        """What ps 0 knows of the workers: ``done`` (ranks whose process ended),
        ``failed`` (rank -> its error), ``lost`` (silent for ``timeout_s``)."""
        return self.info()["workers"]

    def done(self, failure: str | None = None) -> None:
        """This worker's process ends (``failure``: with that error): every ps is told."""
        self._call("Done", {m: wire.pack({"failure": failure}) for m in range(len(self.addresses))},
                   timeout=min(self.timeout_s, 5.0))

    def heartbeat(self) -> None:
        """One call to every ps, so that each knows this worker is alive."""
        self._call("Info", {m: wire.pack({}) for m in range(len(self.addresses))})

    def shutdown(self, failure: str | None = None) -> list[str]:
        """End the job: every ps still alive returns from ``serve()`` (the chief only);
        ``failure`` says the job failed, and why. Returns the errors of the ps that
        could not be told (lost ones), if any."""
        lost = []
        for m in range(len(self.addresses)):
            try:
                self._call("Shutdown", {m: wire.pack({"failure": failure})}, timeout=min(self.timeout_s, 5.0))
            except PeerLostError as e:
                lost.append(str(e))
        return lost

    def close(self) -> None:
        """End this worker's sessions on every ps still answering, then close the channels."""
        if self._channels:
            try:
                self._call("Logout", {m: wire.pack({}) for m in range(len(self._channels))},
                           timeout=min(self.timeout_s, 2.0))
            except errors.HostReduceError:
                pass  # a ps already gone: its sessions went with it
        for channel in self._channels:
            channel.close()
        self._channels = []
        self._threads.close()


def _gradient(name: str, grad: Any, dtype: str) -> np.ndarray:
    """``grad`` as an array of ``dtype``: floating point converted, anything else refused."""
    grad = np.asarray(grad)
    if grad.dtype != dtype:
        if grad.dtype.kind != "f":
            raise errors.TensorMismatchError(f"the gradient of {name!r} must be floating point ({dtype}). "
                                             f"Received: dtype={grad.dtype.name}")
        grad = grad.astype(dtype)
    return grad


def _ids(name: str, ids: Any) -> np.ndarray:
    """Row ids as int64; ConfigError for anything but integers (a float id is not rounded)."""
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu" and ids.size:
        raise ConfigError(f"row ids of {name!r} must be integers. Received: dtype={ids.dtype.name}")
    return ids.astype(np.int64, copy=False)
