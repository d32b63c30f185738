"""The execution plane: running rank 0's plans, step by step in their order, on this
rank's data path, and completing the handles.

Every rank runs the steps it takes part in (those of its groups, its sends and
receives) in plan order, so the data path's collectives match across ranks with no
further agreement, and those of disjoint groups run at once. Their data is tagged with
the step's number from the plan (a per-rank count would differ between ranks that skip
different steps).
Steps run on the executor thread; on one host a follower's pipe reader runs the plans
itself as they arrive, saving a thread hand-off per collective, and the fast lane runs
its agreed all-reduces on the calling thread. A step takes its entries out of the
pending table and then owns their handles: whatever happens, it completes them. A step
that fails other than as planned (a lost peer, an engine bug) fails the job, since this
rank can no longer keep step with the others.

A rank that has joined runs the job's all-reduces that list it in ``joined`` on zeros
of the announced dtypes and shapes (it submitted none of them: they have no entry
here), passes the barriers that list it, and its join completes with the ``Joined``
step.

When rank 0 closes its reducer, no plan can come any more: what is still pending fails
once every plan rank 0 sent before its goodbye has run.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Union

import numpy as np

from ...errors import (CollectiveTimeoutError, HostReduceError, JoinedRankError, PeerLostError, TensorMismatchError,
                       UnmatchedCollectiveError)
from .._args import as_dtype
from ..base import Handle, ReduceOp
from .datapath import DataPath
from .messages import (AllGather, AllReduce, AllToAll, Barrier, Broadcast, Cause, Fail, Joined, P2P, Reduce,
                       ReduceScatter, Step, step_ranks)
from .pending import Pending, PendingTable

__all__ = ["Execution"]

_FAILURES: dict[Cause, type[HostReduceError]] = {
    Cause.MISMATCH: TensorMismatchError, Cause.DEPARTED: PeerLostError, Cause.UNMATCHED: UnmatchedCollectiveError,
    Cause.STALL: CollectiveTimeoutError, Cause.JOINED: JoinedRankError,
}


class _Goodbye:
    """Queued when rank 0 closed its reducer; ``wait``: the goodbye through the pipes
    (which comes after every plan) is expected, so wait for it first."""

    __slots__ = ("wait",)

    def __init__(self, wait: bool) -> None:
        self.wait = wait


_Queued = Union[list[Step], _Goodbye, None]


class Execution:
    def __init__(self, rank: int, size: int, timeout_s: float, table: PendingTable, *,
                 fail: Callable[..., None], explain_os_error: Callable[[OSError], BaseException],
                 joined_barrier: Callable[[], None] = lambda: None) -> None:
        self._rank, self._size, self._timeout = rank, size, timeout_s
        self._table = table
        self._fail, self._explain_os_error = fail, explain_os_error
        self._joined_barrier = joined_barrier   # this rank passed a barrier of the job as joined
        self._data: DataPath | None = None
        self._inline = False
        self._plans: "queue.SimpleQueue[_Queued]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._executor, name=f"hostreduce-ring-{rank}", daemon=True)

    def start(self, data: DataPath, inline: bool) -> None:
        """Run plans on ``data``; ``inline``: on the thread that delivers them."""
        self._data, self._inline = data, inline
        self._thread.start()

    def accept(self, plan: list[Step]) -> None:
        """A plan from rank 0 (queued plans run first: plans arrive in order)."""
        if self._inline:
            self.run(plan)
        else:
            self._plans.put(plan)

    def coordinator_left(self, through_pipe: bool) -> None:
        """Rank 0 closed its reducer: ``through_pipe``, its goodbye after every plan it
        sent through the pipes; otherwise its gRPC goodbye, which may overtake them."""
        if through_pipe:
            if self._inline:
                self._goodbye(wait=False)
        else:
            self._plans.put(_Goodbye(wait=self._inline))

    def stop(self) -> None:
        self._plans.put(None)

    def join(self, timeout: float) -> None:
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)

    # ------------------------------------------------------------------ running
    def _executor(self) -> None:
        while True:
            item = self._plans.get()
            if item is None:
                return
            if isinstance(item, _Goodbye):
                self._goodbye(item.wait)
            else:
                self.run(item)

    def run(self, plan: list[Step]) -> None:
        for step in plan:
            entries: list[Pending] = []
            try:
                if isinstance(step, Fail):
                    self._failed(step)
                    continue
                ranks = step_ranks(step)
                if ranks and self._rank not in ranks:
                    continue
                entries = self._table.take(step.names)
                if isinstance(step, (AllReduce, Barrier)) and self._rank in step.joined:
                    entries = self._as_joined(step, entries)
                    if not entries:   # a barrier this rank passes as joined
                        continue
                self._execute(step, entries)
            except Exception as e:  # an engine bug must not leave ranks hanging
                if isinstance(e, HostReduceError):
                    err: BaseException = e
                elif isinstance(e, OSError):
                    err = self._explain_os_error(e)
                else:
                    err = PeerLostError(f"Rank {self._rank}: collective failed: {type(e).__name__}: {e}")
                self._fail(err)
                for p in entries:
                    p.handle.set_error(err)

    def _as_joined(self, step: AllReduce | Barrier, entries: list[Pending]) -> list[Pending]:
        """The entries of a step that lists this rank as joined: zeros for every tensor of
        an all-reduce that this rank did not submit; none for a barrier."""
        if isinstance(step, Barrier):
            self._joined_barrier()
            return entries
        held = {p.handle.name: p for p in entries}
        op = ReduceOp.parse(step.op)
        out = []
        for name, (dtype, shape) in zip(step.names, step.zeros):
            p = held.get(name)
            if p is None:
                zeros = np.zeros(shape, as_dtype(dtype))
                p = Pending("allreduce", zeros, zeros, op, 0, Handle(name))  # type: ignore[arg-type]
            out.append(p)
        return out

    def _failed(self, step: Fail) -> None:
        if step.cause is Cause.LOST:  # a rank stopped answering: the job cannot go on
            self._fail(PeerLostError(f"Rank {self._rank}: {step.error}"))
            return
        if self._rank not in step.ranks:
            return
        cls = _FAILURES.get(step.cause, CollectiveTimeoutError)
        for p in self._table.take(step.names):
            p.handle.set_error(cls(step.error))

    def _execute(self, step: Step, entries: list[Pending]) -> None:
        if len(entries) != len(step.names):
            error = self._table.error
            if error is not None:  # failed meanwhile
                for p in entries:
                    p.handle.set_error(error)
                return
            raise PeerLostError(f"Rank {self._rank}: plan names collectives {step.names} not pending here")
        data = self._data
        assert data is not None
        if isinstance(step, Joined):
            for p in entries:
                p.handle.set_result(step.last)
            return
        if isinstance(step, Barrier):
            entries[0].handle.set_result(None)
            return
        if isinstance(step, AllReduce):
            self._allreduce(data, step, entries)
            return
        p, tag = entries[0], step.sid
        if isinstance(step, Broadcast):
            p.handle.set_result(data.broadcast(p.array, p.root, tag, step.group))
        elif isinstance(step, AllGather):
            p.handle.set_result(data.allgather(p.array, step.counts, tag, step.group))
        elif isinstance(step, ReduceScatter):
            p.handle.set_result(data.reduce_scatter(p.array, p.op, step.counts, tag, step.group))
        elif isinstance(step, Reduce):
            p.handle.set_result(data.reduce(p.array, p.op, step.root, tag, step.group))
        elif isinstance(step, AllToAll):
            p.handle.set_result(data.alltoall(p.array, step.splits, tag, step.group))
        elif isinstance(step, P2P):
            if self._rank == step.src:
                data.send(p.array, step.dst, tag)
                p.handle.set_result(None)
            else:
                p.handle.set_result(data.recv(p.array, step.src, tag))

    def _allreduce(self, data: DataPath, step: AllReduce, entries: list[Pending]) -> None:
        stats = self._table.stats
        stats["allreduce_tensors"] += len(entries)
        stats["allreduce_buckets"] += 1
        outs = [p.out if p.out is not None else np.empty(p.array.shape, p.array.dtype) for p in entries]
        parts = None
        if step.gather and self._rank == 0:
            assert step.parts is not None
            parts = [step.parts[n] for n in step.names]
        first = entries[0]   # the bucket's dtype, which every entry announced
        wire = first.array.dtype if first.wire is None else first.wire
        data.allreduce([p.array for p in entries], outs, first.op, step.sid, step.gather, parts, step.group, wire)
        for p, o in zip(entries, outs):
            p.handle.set_result(o)

    def _goodbye(self, wait: bool) -> None:
        """Rank 0 is gone: run the plans it sent before (which may still be on their
        way), then fail what is left, as an orderly end rather than a failure."""
        if wait:
            deadline = time.monotonic() + self._timeout
            while self._table.error is None and time.monotonic() < deadline:
                time.sleep(0.05)
        time.sleep(0.2)  # plans sent just before the goodbye may still be on their way
        while True:
            try:
                more = self._plans.get_nowait()
            except queue.Empty:
                break
            if more is None:
                self._plans.put(None)
                break
            if not isinstance(more, _Goodbye):
                self.run(more)
        self._fail(PeerLostError(f"Rank {self._rank}: rank 0 (the coordinator) closed its reducer; "
                                 "no further collectives can run"), failure=False)
