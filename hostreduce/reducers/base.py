"""The one interface every reduction engine implements (engines are chosen by name in
``registry.py``).

A reducer runs collectives over named numpy arrays that live in host memory:
all-reduce, broadcast, all-gather, reduce-scatter, reduce, all-to-all (with per-rank
splits), point-to-point send/receive and barrier, on the whole job or on a process
group (``groups.py``). Collectives are asynchronous: ``allreduce_async`` returns a
:class:`Handle` whose ``wait()`` gives the result. All members must submit the same
names with the same shape, dtype, op and group; engines that can detect a disagreement
raise ``TensorMismatchError`` on every member.

The base class owns the contract every engine shares, so that each engine is written
against checked arguments only: the checks of ``name``, dtype, ``op``, ``out=``,
``root``, splits, groups and ``timeout`` (``_args.py``), refusing work once closed, a
0-d all-gather input taken as one row, wire compression (``compression.py``), and the
meaning of ``mean`` (integers: floor division). float16 and bfloat16 are reduced in 16
bits where they travel, each step in float32 rounded back to 16 bits (see
``is_low_precision``). A job always ends: see ``job_end.py`` for how live reducers are
closed at exit.
"""
from __future__ import annotations

import abc
from typing import Any, ClassVar, Iterable, Sequence

import numpy as np

from ..errors import ConfigError, ReducerClosedError
from .job_end import describe_exception, note_peer_failure, track, untrack
from ._args import (SUPPORTED_DTYPES, ReduceOp, apply_mean, check_array, check_reducible, check_counts, check_out, even_counts,
                    is_low_precision)

from .compression import compressed, parse_compression, wire_dtype
from .groups import Group, make_group
from .handle import Handle

__all__ = ["ReduceOp", "Handle", "Group", "Reducer", "SUPPORTED_DTYPES", "check_array", "check_out", "is_low_precision", "apply_mean"]


class Reducer(abc.ABC):
    """Collectives over host-resident numpy arrays.

    ``rank`` and ``size`` describe the job; results are identical on every rank. The
    public methods check their arguments and then call what a subclass implements, with
    a numpy array of a supported dtype, a parsed ``ReduceOp``, a valid ``out``, ``root``
    and splits (in group ranks), and a :class:`Group` of which this rank is a member
    (``self.world`` when none is given): ``_allreduce_async``, ``_broadcast_async``,
    ``_allgather_async`` (the array has at least one dimension), ``_reduce_scatter_async``,
    ``_reduce_async``, ``_alltoall_async``, ``_send_async``, ``_recv_async``,
    ``_barrier`` and ``_close``; ``_create_group``/``_destroy_group`` where a group needs
    engine state; ``_join`` where the engine can run the job's all-reduces for a rank
    that has run out of data. An engine with a faster path for a blocking all-reduce overrides
    ``_allreduce``; one that can cast inside its pipeline, ``_allreduce_wire_async`` (wire
    compression); one that can tell its peers why it stops overrides ``_close_failed``.
    """

    name: ClassVar[str] = ""
    # Whether ``out=`` must be C-contiguous (engines that write through a flat view).
    out_contiguous: ClassVar[bool] = False

    def __init__(self, compression: Any = "none") -> None:
        self._closed = False
        self._compression = parse_compression(compression)
        self._groups: dict[tuple[int, ...], Group] = {}
        self._world: Group | None = None

    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def size(self) -> int: ...

    # ------------------------------------------------------------------ groups
    @property
    def world(self) -> Group:
        """The group of every rank of the job."""
        if self._world is None:
            self._world = Group(tuple(range(self.size)), self.rank)
        return self._world

    def create_group(self, ranks: Iterable[int]) -> Group:
        """A process group of ``ranks`` (world ranks). Every member calls it (engines
        whose groups need every rank, Horovod's, say so); creating the same ranks again
        gives the same group."""
        self._check_open()
        group = make_group(ranks, self.rank, self.size)
        if group.ranks == self.world.ranks:
            return self.world
        if group.ranks not in self._groups:
            self._groups[group.ranks] = self._create_group(group)
        return self._groups[group.ranks]

    def destroy_group(self, group: Group) -> None:
        """Release ``group``; its collectives are refused afterwards."""
        self._check_open()
        if not isinstance(group, Group) or self._groups.get(group.ranks) is not group:
            raise ConfigError(f"`group` must be a live group made by this reducer's create_group (the world group "
                              f"cannot be destroyed). Received: group={group!r}")
        del self._groups[group.ranks]
        self._destroy_group(group)

    def _create_group(self, group: Group) -> Group:
        return group

    def _destroy_group(self, group: Group) -> None:
        pass

    def _group(self, group: Any) -> Group:
        if group is None:
            return self.world
        if not isinstance(group, Group) or (group is not self.world and self._groups.get(group.ranks) is not group):
            raise ConfigError(f"`group` must be None (the world) or a live group made by this reducer's "
                              f"create_group. Received: group={group!r}")
        if not group.is_member:
            raise ConfigError(f"Rank {self.rank} is not a member of {group}: only its members run its collectives. "
                              f"Received: group={group!r}")
        return group

    def _group_rank(self, arg: str, value: Any, group: Group) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < group.size:
            where = "" if group.size == self.size else f" (a rank of {group})"
            raise ConfigError(f"`{arg}` must be an integer in [0, {group.size}){where}. Received: {arg}={value!r}")
        return value

    # ------------------------------------------------------------------ collectives
    def allreduce_async(self, name: str, array: np.ndarray, op: ReduceOp | str = ReduceOp.SUM,
                        out: np.ndarray | None = None, group: Group | None = None,
                        compression: str | None = None) -> Handle:
        """Start an all-reduce of ``array``; the handle's result has its shape and dtype.

        ``out`` (optional) receives the result and may be ``array`` itself (in place).
        Integer ``mean`` rounds toward negative infinity. ``compression``: "fp16" or
        "bf16" sends float arrays in 16 bits (default: the reducer's).
        """
        arr, rop, out, grp = self._check_allreduce(name, array, op, out, group)
        wire = self._wire(arr, compression)
        if wire is not None:
            return self._allreduce_wire_async(name, arr, rop, out, grp, wire)
        return self._allreduce_async(name, arr, rop, out, grp)

    def broadcast_async(self, name: str, array: np.ndarray, root: int = 0, group: Group | None = None) -> Handle:
        """Start a broadcast of ``root``'s ``array`` (same shape and dtype everywhere;
        ``root`` is a rank of ``group``)."""
        self._check_open()
        arr = check_array(name, array)
        grp = self._group(group)
        return self._broadcast_async(name, arr, self._group_rank("root", root, grp), grp)

    def allgather_async(self, name: str, array: np.ndarray, group: Group | None = None) -> Handle:
        """Start an all-gather: every rank's array concatenated along axis 0 in rank
        order. Arrays must agree in dtype and in every dimension but the first."""
        self._check_open()
        arr = check_array(name, array)
        return self._allgather_async(name, arr.reshape(1) if arr.ndim == 0 else arr, self._group(group))

    def reduce_scatter_async(self, name: str, array: np.ndarray, op: ReduceOp | str = ReduceOp.SUM,
                             counts: Sequence[int] | None = None, group: Group | None = None,
                             compression: str | None = None) -> Handle:
        """Start a reduce-scatter: the arrays are reduced and rank r of ``group`` gets
        rows ``counts[r]`` of the result (split along axis 0; default: near-equal
        parts, the first ranks one row more, as Horovod splits)."""
        arr, rop, _, grp = self._check_allreduce(name, array, op, None, group)
        if arr.ndim == 0:
            raise ConfigError(f"Tensor {name!r}: a reduce-scatter splits axis 0; the array needs at least one "
                              f"dimension. Received: shape={arr.shape}")
        rows = arr.shape[0]
        cnt = even_counts(rows, grp.size) if counts is None else check_counts(name, "counts", counts, grp.size, rows)
        wire = self._wire(arr, compression)
        if wire is not None:
            return compressed(name, arr, wire, None, lambda a: self._reduce_scatter_async(name, a, rop, cnt, grp))
        return self._reduce_scatter_async(name, arr, rop, cnt, grp)

    def reduce_async(self, name: str, array: np.ndarray, root: int = 0, op: ReduceOp | str = ReduceOp.SUM,
                     group: Group | None = None, compression: str | None = None) -> Handle:
        """Start a reduction to ``root`` (a rank of ``group``): its handle gives the
        result there and None on the other ranks."""
        arr, rop, _, grp = self._check_allreduce(name, array, op, None, group)
        r = self._group_rank("root", root, grp)
        wire = self._wire(arr, compression)
        if wire is not None:
            return compressed(name, arr, wire, None, lambda a: self._reduce_async(name, a, rop, r, grp))
        return self._reduce_async(name, arr, rop, r, grp)

    def alltoall_async(self, name: str, array: np.ndarray, splits: Sequence[int] | None = None,
                       group: Group | None = None) -> Handle:
        """Start an all-to-all: rows ``splits[j]`` of ``array`` (in order along axis 0)
        go to rank j of ``group`` (default: equal parts). The handle gives
        ``(received, received_splits)``: what every rank sent here, concatenated in
        rank order, and how many rows came from each."""
        self._check_open()
        arr = check_array(name, array)
        grp = self._group(group)
        if arr.ndim == 0:
            raise ConfigError(f"Tensor {name!r}: an all-to-all splits axis 0; the array needs at least one "
                              f"dimension. Received: shape={arr.shape}")
        rows = arr.shape[0]
        if splits is None:
            if rows % grp.size:
                raise ConfigError(f"Tensor {name!r}: without `splits` the first dimension must divide evenly among "
                                  f"the {grp.size} ranks. Received: shape={arr.shape}")
            cnt = [rows // grp.size] * grp.size
        else:
            cnt = check_counts(name, "splits", splits, grp.size, rows)
        return self._alltoall_async(name, arr, cnt, grp)

    def send_async(self, name: str, array: np.ndarray, dst: int, group: Group | None = None) -> Handle:
        """Start sending ``array`` to rank ``dst`` of ``group``, which receives it with
        ``recv_async`` under the same name. The handle completes (with None) once the
        data is on its way; ``array`` must not change before then."""
        self._check_open()
        arr = check_array(name, array)
        grp = self._group(group)
        d = self._group_rank("dst", dst, grp)
        if d == grp.rank:
            raise ConfigError(f"Tensor {name!r}: `dst` must be another rank than this one. Received: dst={dst}")
        return self._send_async(name, arr, d, grp)

    def recv_async(self, name: str, src: int, shape: Sequence[int], dtype: Any,
                   group: Group | None = None) -> Handle:
        """Start receiving the array that rank ``src`` of ``group`` sends under
        ``name``; ``shape`` and ``dtype`` must be the sent array's."""
        self._check_open()
        try:
            shp = tuple(int(d) for d in shape)
            if any(d < 0 for d in shp):
                raise ValueError
        except (TypeError, ValueError):
            raise ConfigError(f"Tensor {name!r}: `shape` must be a sequence of non-negative integers. "
                              f"Received: shape={shape!r}") from None
        try:
            dt = np.dtype(dtype)
        except TypeError:
            dt = None
        template = check_array(name, np.empty(0, dt if dt is not None else np.uint8))
        grp = self._group(group)
        s = self._group_rank("src", src, grp)
        if s == grp.rank:
            raise ConfigError(f"Tensor {name!r}: `src` must be another rank than this one. Received: src={src}")
        return self._recv_async(name, shp, template.dtype, s, grp)

    def barrier(self, timeout: float | None = None, group: Group | None = None) -> None:
        """Block until every rank of ``group`` has entered the barrier (at most
        ``timeout`` seconds, where the engine bounds it)."""
        self._check_open()
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or timeout <= 0):
            raise ConfigError(f"`timeout` must be a number > 0 or None. Received: timeout={timeout!r}")
        self._barrier(timeout, self._group(group))

    def join(self, timeout: float | None = None) -> int:
        """This rank has no more data: block until every rank has joined, and return the
        last rank to join (the same on every rank), as Horovod's ``hvd.join()``.

        Until then this rank takes part in the other ranks' all-reduces of the whole job
        with zeros of their shape and dtype (a ``mean`` still divides by the job's size)
        and in their barriers; any other collective of the job submitted meanwhile fails
        with ``JoinedRankError`` on the ranks that submitted it. Collectives of process
        groups are not joined. ``timeout`` bounds the wait where the engine can (None:
        the engine's own limits: a peer lost, or one that runs no collective for
        ``timeout_s``, fails the join).
        """
        self._check_open()
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or timeout <= 0):
            raise ConfigError(f"`timeout` must be a number > 0 or None. Received: timeout={timeout!r}")
        if self.size == 1:
            return self.rank
        return int(self._join(timeout))

    def _join(self, timeout: float | None) -> int:
        raise self._missing("join")

    # Blocking conveniences.
    def allreduce(self, name: str, array: np.ndarray, op: ReduceOp | str = ReduceOp.SUM,
                  out: np.ndarray | None = None, group: Group | None = None,
                  compression: str | None = None) -> np.ndarray:
        arr, rop, out, grp = self._check_allreduce(name, array, op, out, group)
        if self._wire(arr, compression) is not None:
            return self.allreduce_async(name, arr, rop, out, grp, compression).wait()
        return self._allreduce(name, arr, rop, out, grp)

    def broadcast(self, name: str, array: np.ndarray, root: int = 0, group: Group | None = None) -> np.ndarray:
        return self.broadcast_async(name, array, root, group).wait()

    def allgather(self, name: str, array: np.ndarray, group: Group | None = None) -> np.ndarray:
        return self.allgather_async(name, array, group).wait()

    def reduce_scatter(self, name: str, array: np.ndarray, op: ReduceOp | str = ReduceOp.SUM,
                       counts: Sequence[int] | None = None, group: Group | None = None,
                       compression: str | None = None) -> np.ndarray:
        return self.reduce_scatter_async(name, array, op, counts, group, compression).wait()

    def reduce(self, name: str, array: np.ndarray, root: int = 0, op: ReduceOp | str = ReduceOp.SUM,
               group: Group | None = None, compression: str | None = None) -> np.ndarray | None:
        return self.reduce_async(name, array, root, op, group, compression).wait()

    def alltoall(self, name: str, array: np.ndarray, splits: Sequence[int] | None = None,
                 group: Group | None = None) -> tuple[np.ndarray, np.ndarray]:
        return self.alltoall_async(name, array, splits, group).wait()

    def send(self, name: str, array: np.ndarray, dst: int, group: Group | None = None) -> None:
        self.send_async(name, array, dst, group).wait()

    def recv(self, name: str, src: int, shape: Sequence[int], dtype: Any, group: Group | None = None) -> np.ndarray:
        return self.recv_async(name, src, shape, dtype, group).wait()

    # What engines implement, with checked arguments.
    @abc.abstractmethod
    def _allreduce_async(self, name: str, arr: np.ndarray, op: ReduceOp, out: np.ndarray | None,
                         group: Group) -> Handle: ...

    @abc.abstractmethod
    def _broadcast_async(self, name: str, arr: np.ndarray, root: int, group: Group) -> Handle: ...

    @abc.abstractmethod
    def _allgather_async(self, name: str, arr: np.ndarray, group: Group) -> Handle: ...

    @abc.abstractmethod
    def _barrier(self, timeout: float | None, group: Group) -> None: ...

    @abc.abstractmethod
    def _close(self) -> None: ...

    def _allreduce_wire_async(self, name: str, arr: np.ndarray, op: ReduceOp, out: np.ndarray | None,
                              group: Group, wire: np.dtype) -> Handle:
        """An all-reduce that travels and sums as ``wire``: cast before and after the engine's
        (an engine that casts inside its pipeline overrides this)."""
        return compressed(name, arr, wire, out, lambda a: self._allreduce_async(name, a, op, a, group))

    def _reduce_scatter_async(self, name: str, arr: np.ndarray, op: ReduceOp, counts: list[int],
                              group: Group) -> Handle:
        raise self._missing("reduce_scatter")

    def _reduce_async(self, name: str, arr: np.ndarray, op: ReduceOp, root: int, group: Group) -> Handle:
        raise self._missing("reduce")

    def _alltoall_async(self, name: str, arr: np.ndarray, splits: list[int], group: Group) -> Handle:
        raise self._missing("alltoall")

    def _send_async(self, name: str, arr: np.ndarray, dst: int, group: Group) -> Handle:
        raise self._missing("send")

    def _recv_async(self, name: str, shape: tuple[int, ...], dtype: np.dtype, src: int, group: Group) -> Handle:
        raise self._missing("recv")

    def _missing(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"The {self.name!r} reducer does not implement {what}")

    def _allreduce(self, name: str, arr: np.ndarray, op: ReduceOp, out: np.ndarray | None,
                   group: Group) -> np.ndarray:
        return self._allreduce_async(name, arr, op, out, group).wait()

    def close(self) -> None:
        """Release sockets, threads and buffers. Safe to call more than once."""
        if not self._closed:
            self._closed = True
            untrack(self)
            self._close()

    def _abort(self, reason: str) -> None:
        """Close after this process failed with ``reason`` (e.g. ``"ValueError: boom"``).

        Engines that can tell their peers override ``_close_failed`` so that every peer
        fails at once with an error naming this rank and ``reason``, instead of
        learning of an orderly goodbye.
        """
        if not self._closed:
            self._closed = True
            untrack(self)
            self._close_failed(reason)

    def _close_failed(self, reason: str) -> None:
        self._close()

    def _register_live(self) -> None:
        """Call at the end of a successful ``__init__``: until ``close()``, the reducer is
        closed at interpreter exit (with an abort if the exit is due to an unhandled
        exception), before the interpreter joins any thread that might wait on a peer."""
        track(self)

    @staticmethod
    def _peer_failed(error: BaseException) -> None:
        """Engines call this when a peer failed (not when it left in an orderly way): the
        process then exits non-zero even if the script catches the error."""
        note_peer_failure(error)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failure(self) -> BaseException | None:
        """Why this reducer can run no more collectives (a peer failed or left), or None
        while it can. Engines that learn of their peers' ends override it."""
        return None

    def _check_open(self) -> None:
        if self._closed:
            raise ReducerClosedError(f"The {self.name!r} reducer is closed")

    def _check_allreduce(self, name: str, array: Any, op: ReduceOp | str, out: Any,
                         group: Any) -> tuple[np.ndarray, ReduceOp, np.ndarray | None, Group]:
        self._check_open()
        arr = check_array(name, array)
        check_reducible(name, arr)
        rop = ReduceOp.parse(op)
        check_out(name, arr, out, self.out_contiguous)
        return arr, rop, out, self._group(group)

    def _wire(self, arr: np.ndarray, compression: str | None) -> np.dtype | None:
        """The 16-bit dtype ``arr`` travels as under ``compression`` (None: as it is)."""
        return wire_dtype(self._compression if compression is None else parse_compression(compression), arr.dtype)

    def __enter__(self) -> "Reducer":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
            self.close()
        else:  # the block failed: peers learn why at once
            self._abort(describe_exception(exc))
