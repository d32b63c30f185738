"""Horovod's Python-object collectives, in-place broadcasts, global-variable broadcast
(TF1), ``join`` and the ops that return the job's layout.

``broadcast_object`` / ``allgather_object`` pickle a Python object (with cloudpickle
where it is installed, as Horovod does, else :mod:`pickle`) and move its bytes through
the job's engine directly: they work the same eagerly, inside a TF1 graph (no session
is needed) and on a process set. ``rank_op`` and friends are constants of the graph
they are built in: hostreduce's layout is fixed when the job starts.
"""
from __future__ import annotations

import io
import json
import pickle
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import ConfigError, HostReduceError
from . import job as _engine
from .collectives import on_host
from .tf_errors import tf_errors
from .process_sets import ProcessSet, find, global_process_set, group_of

__all__ = ["broadcast_object", "broadcast_object_fn", "allgather_object", "grouped_allgather", "broadcast_",
           "broadcast_global_variables", "rank_op", "size_op", "local_rank_op", "local_size_op",
           "process_set_included_op", "join", "PROCESS_SET_ERROR_INIT", "PROCESS_SET_ERROR_UNKNOWN_SET"]

# process_set_included_op's error codes, as Horovod's.
PROCESS_SET_ERROR_INIT = -1
PROCESS_SET_ERROR_UNKNOWN_SET = -3


def _dumps(obj: Any) -> bytes:
    try:
        import cloudpickle
    except ImportError:  # pragma: no cover - cloudpickle is optional
        return pickle.dumps(obj)
    buffer = io.BytesIO()
    cloudpickle.dump(obj, buffer)
    return buffer.getvalue()


def _engine_and_group(process_set: Any) -> tuple[Any, Any]:
    _engine.channel()
    return _engine.job().reducer(), group_of(process_set)


def _root_in_set(root_rank: Any, process_set: Any) -> int:
    world = _engine.size()
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)) or not 0 <= root_rank < world:
        raise ConfigError(f"`root_rank` must be an integer in [0, {world}). Received: root_rank={root_rank!r}")
    if process_set is None or process_set is global_process_set:
        return int(root_rank)
    if root_rank not in (process_set.ranks or ()):
        raise ConfigError(f"`root_rank` must be a member of {process_set!r}. Received: root_rank={root_rank}")
    return list(process_set.ranks).index(int(root_rank))


def _object_name(name: Any, obj: Any, kind: str) -> str:
    if name is None:
        name = type(obj).__name__
    if not isinstance(name, str) or not name:
        raise ConfigError(f"`name` must be a non-empty string or None. Received: name={name!r}")
    return f"hvd.{kind}.{name}"


@tf_errors
def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: Any = global_process_set) -> Any:
    """``root_rank``'s ``obj`` (any picklable object) on every rank of the set.

    ``session`` is accepted for TF1 scripts and not needed: the bytes move through the
    engine directly, in any mode. ``name`` defaults to the object's class name, as in
    Horovod; every rank of the set must call this in the same order.
    """
    reducer, group = _engine_and_group(process_set)
    root = _root_in_set(root_rank, process_set)
    base = _object_name(name, obj, "broadcast_object")
    mine = _engine.rank() == int(root_rank)
    payload = np.frombuffer(_dumps(obj), np.uint8) if mine else np.zeros(0, np.uint8)
    size = reducer.broadcast(f"{base}.sz", np.array([payload.size], np.int64), root=root, group=group)
    data = payload if mine else np.zeros(int(size[0]), np.uint8)
    data = reducer.broadcast(f"{base}.t", data, root=root, group=group)
    return obj if mine else pickle.loads(np.asarray(data, np.uint8).tobytes())


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: Any = global_process_set) -> Callable[[Any], Any]:
    """A function ``fn(obj)`` that broadcasts ``obj`` from ``root_rank`` (as
    :func:`broadcast_object`; Horovod builds it once for a TF1 session)."""
    fixed = name or "broadcast_object_fn"

    def broadcast_fn(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, session=session, name=fixed, process_set=process_set)

    return broadcast_fn


@tf_errors
def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: Any = global_process_set) -> list[Any]:
    """Every rank's ``obj`` (any picklable object), as a list in rank order of the set."""
    reducer, group = _engine_and_group(process_set)
    base = _object_name(name, obj, "allgather_object")
    payload = np.frombuffer(_dumps(obj), np.uint8)
    sizes = reducer.allgather(f"{base}.sz", np.array([payload.size], np.int64), group=group)
    data = np.asarray(reducer.allgather(f"{base}.t", payload, group=group), np.uint8)
    out, at = [], 0
    for n in np.asarray(sizes).reshape(-1).tolist():
        out.append(pickle.loads(data[at:at + n].tobytes()))
        at += n
    return out


@tf_errors
def grouped_allgather(tensors: Sequence[Any], name: str | None = None, ignore_name_scope: bool = False,
                      process_set: Any = global_process_set) -> list[Any]:
    """:func:`allgather` of each tensor (ranks may differ in each one's first dimension)."""
    from .tensors import allgather

    base = _engine.collective_name("grouped_allgather", name)
    return [allgather(t, name=f"{base}/{i}", process_set=process_set) for i, t in enumerate(tensors)]


@tf_errors
def broadcast_(variables: Sequence[Any], root_rank: int, name: str | None = None,
               process_set: Any = global_process_set) -> list[Any]:
    """Assign ``root_rank``'s values to ``variables`` in place on every rank of the set;
    returns the variables' new values (Horovod's in-place broadcast)."""
    import tensorflow as tf

    from .tensors import broadcast_variables

    variables = list(variables)
    if not variables:
        return []
    op = broadcast_variables(variables, root_rank, process_set=process_set)
    if tf.executing_eagerly() or op is None:
        return [v.read_value() if hasattr(v, "read_value") else tf.convert_to_tensor(v) for v in variables]
    with tf.control_dependencies([op]):
        return [tf.identity(v.read_value() if hasattr(v, "read_value") else tf.convert_to_tensor(v))
                for v in variables]


def broadcast_global_variables(root_rank: int) -> Any:
    """An op that assigns ``root_rank``'s value to every global variable of the TF1 graph
    (``tf.compat.v1.global_variables()``). TF1 graphs only: eagerly, broadcast the model's
    and optimizer's variables with ``hvd.broadcast_variables`` instead."""
    import tensorflow as tf

    from .tensors import broadcast_variables

    if tf.executing_eagerly():
        raise HostReduceError(
            "hvd.broadcast_global_variables() does not support eager execution (it works only in a TF1 graph); "
            "use hvd.broadcast_variables(model.variables + optimizer.variables, root_rank) instead, or "
            "callbacks.BroadcastGlobalVariablesCallback(root_rank) in fit(). "
            f"Received: root_rank={root_rank!r}"
        )
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def _constant(value: int, name: str | None) -> Any:
    import tensorflow as tf

    return tf.constant(value, dtype=tf.int32, name=name)


def rank_op(name: str | None = None) -> Any:
    """This process's rank, as an int32 scalar tensor."""
    return _constant(_engine.rank(), name)


def local_rank_op(name: str | None = None) -> Any:
    """This process's local rank, as an int32 scalar tensor."""
    return _constant(_engine.local_rank(), name)


def local_size_op(name: str | None = None) -> Any:
    """The number of the job's processes on this host, as an int32 scalar tensor."""
    return _constant(_engine.local_size(), name)


def size_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """The size of the job (or of the registered process set ``process_set_id``), as an
    int32 scalar tensor."""
    process_set = find(process_set_id)
    if process_set is None:
        raise ConfigError(f"`process_set_id` names no registered process set. Received: "
                          f"process_set_id={process_set_id!r}")
    return _constant(process_set.size() or 0, name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """1 if this process belongs to process set ``process_set_id``, else 0; Horovod's
    negative codes when the job is not initialized (-1) or the set is unknown (-3)."""
    if not _engine.is_initialized():
        return _constant(PROCESS_SET_ERROR_INIT, name)
    process_set = find(process_set_id)
    if not isinstance(process_set, ProcessSet):
        return _constant(PROCESS_SET_ERROR_UNKNOWN_SET, name)
    return _constant(1 if process_set.included() else 0, name)


@tf_errors
def join() -> Any:
    """This rank has no more data: an int32 scalar op that waits until every rank has
    joined and then gives the last rank to join (the same on every rank), as Horovod's
    ``hvd.join()``. Eagerly it runs at once; in a graph, when the op runs.

    Until every rank has joined, this rank takes part in the other ranks' all-reduces
    of the whole job with zeros (``Average`` still divides by ``size()``) and in their
    barriers; their broadcasts, all-gathers, all-to-alls and reduce-scatters fail with
    ``tf.errors.FailedPreconditionError`` (``JoinedRankError``) on the ranks that run
    them, as in Horovod. Process sets other than the whole job are not joined. The
    join fails when a rank that has not joined is lost or closes, or when the ranks
    that have not joined run no collective for ``timeout_s`` (see the engine's docs).
    """
    import tensorflow as tf

    _engine.channel()

    def run(reducer: Any, arrays: list[np.ndarray]) -> list[np.ndarray]:
        last = reducer.join()
        _agree_on_names(reducer)
        return [np.asarray(last, np.int32)]

    return on_host("join", run, [], [tf.int32], [tf.TensorShape([])])[0]


def _agree_on_names(reducer: Any) -> None:
    """After a join: the ranks that had not joined ran unnamed collectives eagerly that
    the joined ones did not; every rank takes the highest count of each kind, so that
    the next unnamed collective has the same name on every rank."""
    payload = np.frombuffer(json.dumps(_engine.eager_counts(), sort_keys=True).encode(), np.uint8)
    sizes = reducer.allgather("hvd.join.names.sz", np.array([payload.size], np.int64))
    data = np.asarray(reducer.allgather("hvd.join.names", payload), np.uint8)
    at = 0
    for n in np.asarray(sizes).reshape(-1).tolist():
        _engine.advance_eager_counts(json.loads(data[at:at + n].tobytes()))
        at += n
