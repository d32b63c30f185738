"""HCCL's collective ops and group management (TF Adapter's ``hccl_ops`` and
``hccl.manage.api``) on hostreduce's engines.

A script ported from Ascend changes its imports (or, where it wrote ``import npu_device
as npu``, only that line: ``npu.hccl`` is this module on ``import hostreduce as npu``)::

    from npu_bridge.hccl import hccl_ops        ->  from hostreduce import hccl as hccl_ops
    from hccl.manage.api import create_group    ->  from hostreduce.hccl import create_group

(``hostreduce.distribute`` re-exports every name too.) Groups are named as in HCCL:
``"hccl_world_group"`` is the whole job, ``create_group(name, rank_num, rank_ids)`` makes
another, which each of its members creates. Ranks inside a group (``root_rank``,
``dest_rank``, ``src_rank``) are group ranks. Each op runs one collective of the job's
engine on the host when its input exists, eagerly or inside ``tf.function``.
Reductions: ``"sum"``, ``"prod"``, ``"max"``, ``"min"`` (HCCL has no mean). ``fusion``
and ``fusion_id`` are accepted and checked; hostreduce's engines fuse on their own.
``reduce`` returns the result on the root and the input unchanged elsewhere.

The names and argument orders are TF Adapter's. Where its TF1 (``npu_bridge``) and TF2
(``npu_device``) ``hccl_ops`` differ (``allgather`` and ``reduce_scatter`` take
``fusion, fusion_id`` before ``group`` in TF1 only), the TF1 order is the signature and a
group name passed where ``fusion`` stands is taken as the group, so calls written for
either run. ``set_split_strategy_by_idx``/``set_split_strategy_by_size`` (``hccl.split.api``)
are checked and have no effect. The RDMA ops (``remote_read``, ``remote_ref_read``,
``remote_write``, ``remote_scatter_write``, ``gather_all_to_all_v``) raise
:class:`~hostreduce.errors.UnsupportedCallError` naming what to use instead.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

from ..errors import ConfigError, TensorMismatchError, UnsupportedCallError
from ..ops import job as _engine
from ..ops.collectives import on_host

__all__ = ["WORLD_GROUP", "create_group", "destroy_group", "get_rank_size", "get_local_rank_size", "get_rank_id",
           "get_local_rank_id", "get_world_rank_from_group_rank", "get_group_rank_from_world_rank",
           "allreduce", "allgather", "broadcast", "reduce", "reduce_scatter", "send", "receive",
           "all_to_all_v", "all_to_all_v_dynamic", "all_to_all_v_c", "set_split_strategy_by_idx",
           "set_split_strategy_by_size", "gather_all_to_all_v", "remote_read", "remote_ref_read", "remote_write",
           "remote_scatter_write"]

WORLD_GROUP = "hccl_world_group"
_REDUCTIONS = ("sum", "prod", "max", "min")
_lock = threading.Lock()
_groups: dict[str, Any] = {}


def _job() -> Any:
    if not _engine.is_initialized():
        _engine.init()
    return _engine.job()


def _reducer() -> Any:
    _engine.channel()
    return _engine.job().reducer()


def _group(group: Any) -> Any:
    """The engine group named ``group`` (None: the whole job)."""
    if group == WORLD_GROUP:
        _job()
        return None
    with _lock:
        found = _groups.get(group) if isinstance(group, str) else None
    if found is None:
        raise ConfigError(f"`group` must be {WORLD_GROUP!r} or a group made by create_group. Received: group={group!r}")
    return found


# --------------------------------------------------------------------------- groups
def create_group(group: str, rank_num: int, rank_ids: Sequence[int]) -> None:
    """Make group ``group`` of the world ranks ``rank_ids`` (``rank_num`` of them)."""
    if not isinstance(group, str) or not group or group == WORLD_GROUP:
        raise ConfigError(f"`group` must be a new non-empty name other than {WORLD_GROUP!r}. Received: group={group!r}")
    ranks = list(rank_ids)
    if isinstance(rank_num, bool) or not isinstance(rank_num, int) or rank_num != len(ranks):
        raise ConfigError(f"`rank_num` must be the number of `rank_ids` ({len(ranks)}). Received: rank_num={rank_num!r}")
    made = _reducer().create_group(ranks)
    with _lock:
        if group in _groups:
            raise ConfigError(f"`group` {group!r} exists already. Received: group={group!r}")
        _groups[group] = made


def destroy_group(group: str) -> None:
    with _lock:
        made = _groups.pop(group, None) if isinstance(group, str) else None
    if made is None:
        raise ConfigError(f"`group` must be a group made by create_group. Received: group={group!r}")
    reducer = _reducer()
    if made is not reducer.world:
        reducer.destroy_group(made)


def get_rank_size(group: str = WORLD_GROUP) -> int:
    g = _group(group)
    return _engine.size() if g is None else g.size


def get_rank_id(group: str = WORLD_GROUP) -> int:
    g = _group(group)
    if g is None:
        return _engine.rank()
    if not g.is_member:
        raise ConfigError(f"Rank {_engine.rank()} is not a member of group {group!r}. Received: group={group!r}")
    return g.rank


def get_local_rank_size(group: str = WORLD_GROUP) -> int:
    """Ranks of ``group`` on this host."""
    if _group(group) is None:
        return _engine.local_size()
    return len(_local_members(group))


def get_local_rank_id(group: str = WORLD_GROUP) -> int:
    """This rank's place among the ranks of ``group`` on this host."""
    if _group(group) is None:
        return _engine.local_rank()
    return _local_members(group).index(_engine.rank())


def _local_members(group: str) -> list[int]:
    spec = _engine.job().cluster
    hosts = [a.rsplit(":", 1)[0] for a in (spec.addresses or ())]
    g = _group(group)
    if not hosts:  # no addresses (mpirun): every rank counts as local
        return list(g.ranks)
    mine = hosts[_engine.rank()]
    return [r for r in g.ranks if hosts[r] == mine]


def get_world_rank_from_group_rank(group: str, group_rank_id: int) -> int:
    g = _group(group)
    size = _engine.size() if g is None else g.size
    if isinstance(group_rank_id, bool) or not isinstance(group_rank_id, int) or not 0 <= group_rank_id < size:
        raise ConfigError(f"`group_rank_id` must be an integer in [0, {size}). Received: group_rank_id={group_rank_id!r}")
    return group_rank_id if g is None else g.ranks[group_rank_id]


def get_group_rank_from_world_rank(world_rank_id: int, group: str) -> int:
    g = _group(group)
    ranks = list(range(_engine.size())) if g is None else list(g.ranks)
    if world_rank_id not in ranks:
        raise ConfigError(f"`world_rank_id` must be a rank of group {group!r} ({ranks}). "
                          f"Received: world_rank_id={world_rank_id!r}")
    return ranks.index(world_rank_id)


# --------------------------------------------------------------------------- ops
def _reduction(reduction: Any) -> str:
    if reduction not in _REDUCTIONS:
        raise ConfigError(f"`reduction` must be one of {list(_REDUCTIONS)}. Received: reduction={reduction!r}")
    return reduction


def check_fusion(fusion: Any, fusion_id: Any) -> None:
    """``fusion`` and ``fusion_id`` are accepted when they are integers (the engines fuse
    on their own)."""
    for argument, value in (("fusion", fusion), ("fusion_id", fusion_id)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"`{argument}` must be an integer. Received: {argument}={value!r}")


def _group_in_fusion(fusion: Any, fusion_id: Any, group: Any) -> tuple[Any, Any, Any]:
    """TF2's ``allgather``/``reduce_scatter`` take ``group`` where TF1's take ``fusion``: a
    name in that place is the group."""
    if not isinstance(fusion, str):
        return fusion, fusion_id, group
    if group != WORLD_GROUP and group != fusion:
        raise ConfigError(f"`group` is given twice, as {fusion!r} (in the place of `fusion`) and as {group!r}. "
                          f"Received: fusion={fusion!r}, group={group!r}")
    return 0, fusion_id, fusion


def _run(kind: str, run: Any, inputs: list[Any], dtypes: list[Any], shapes: list[Any]) -> list[Any]:
    return on_host(f"hccl {kind}", run, inputs, dtypes, shapes)


def _name(kind: str, group: Any) -> str:
    return _engine.collective_name(f"hccl.{kind}.{group}", None)


def allreduce(tensor: Any, reduction: str, fusion: int = 1, fusion_id: int = -1, group: str = WORLD_GROUP) -> Any:
    import tensorflow as tf

    op, g = _reduction(reduction), _group(group)
    check_fusion(fusion, fusion_id)
    tensor = tf.convert_to_tensor(tensor)
    name = _name("allreduce", group)
    return _run("allreduce", lambda r, a: [r.allreduce(name, a[0], op, group=g)], [tensor], [tensor.dtype],
                [tensor.shape])[0]


def allgather(tensor: Any, rank_size: int, fusion: int = 0, fusion_id: int = -1, group: str = WORLD_GROUP) -> Any:
    """Every rank's ``tensor`` concatenated along axis 0 in group-rank order."""
    import tensorflow as tf

    fusion, fusion_id, group = _group_in_fusion(fusion, fusion_id, group)
    check_fusion(fusion, fusion_id)
    g = _group(group)
    _check_rank_size(rank_size, group)
    tensor = tf.convert_to_tensor(tensor)
    name = _name("allgather", group)
    rows = None if tensor.shape.rank == 0 or tensor.shape[0] is None else tensor.shape[0] * rank_size
    shape = tf.TensorShape([rows]).concatenate(tensor.shape[1:]) if tensor.shape.rank else tf.TensorShape([rank_size])
    return _run("allgather", lambda r, a: [r.allgather(name, a[0], group=g)], [tensor], [tensor.dtype], [shape])[0]


def broadcast(tensor: Any, root_rank: int, fusion: int = 2, fusion_id: int = 0, group: str = WORLD_GROUP) -> Any:
    """``root_rank``'s tensor (or list of tensors, as TF Adapter passes them) on every
    rank of ``group``."""
    import tensorflow as tf

    g = _group(group)
    check_fusion(fusion, fusion_id)
    listed = isinstance(tensor, (list, tuple))
    outs = []
    for t in (tensor if listed else [tensor]):
        t = tf.convert_to_tensor(t)
        name = _name("broadcast", group)
        outs.append(_run("broadcast", lambda r, a, n=name: [r.broadcast(n, a[0], root=root_rank, group=g)], [t],
                         [t.dtype], [t.shape])[0])
    return outs if listed else outs[0]


def reduce(tensor: Any, reduction: str, root_rank: int, fusion: int = 0, fusion_id: int = -1,
           group: str = WORLD_GROUP) -> Any:
    import tensorflow as tf

    op, g = _reduction(reduction), _group(group)
    check_fusion(fusion, fusion_id)
    tensor = tf.convert_to_tensor(tensor)
    name = _name("reduce", group)

    def run(r: Any, a: list[np.ndarray]) -> list[np.ndarray]:
        out = r.reduce(name, a[0], root=root_rank, op=op, group=g)
        return [a[0] if out is None else out]

    return _run("reduce", run, [tensor], [tensor.dtype], [tensor.shape])[0]


def reduce_scatter(tensor: Any, reduction: str, rank_size: int, fusion: int = 0, fusion_id: int = -1,
                   group: str = WORLD_GROUP) -> Any:
    """The reduction of every rank's ``tensor``, split evenly along axis 0: group rank r
    gets part r (the first dimension must divide by ``rank_size``, as in HCCL)."""
    import tensorflow as tf

    fusion, fusion_id, group = _group_in_fusion(fusion, fusion_id, group)
    op, g = _reduction(reduction), _group(group)
    check_fusion(fusion, fusion_id)
    _check_rank_size(rank_size, group)
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0 or (tensor.shape[0] is not None and tensor.shape[0] % rank_size):
        raise ConfigError(f"`tensor`'s first dimension must divide by rank_size={rank_size}. "
                          f"Received: shape={tensor.shape}")
    name = _name("reduce_scatter", group)
    rows = None if tensor.shape[0] is None else tensor.shape[0] // rank_size
    return _run("reduce_scatter", lambda r, a: [r.reduce_scatter(name, a[0], op, group=g).copy()], [tensor],
                [tensor.dtype], [tf.TensorShape([rows]).concatenate(tensor.shape[1:])])[0]


def _sr_name(sr_tag: Any, src: int, dst: int, group: str) -> str:
    if isinstance(sr_tag, bool) or not isinstance(sr_tag, int):
        raise ConfigError(f"`sr_tag` must be an integer. Received: sr_tag={sr_tag!r}")
    return f"hccl.sr.{group}.{sr_tag}.{src}->{dst}"


def send(tensor: Any, sr_tag: int, dest_rank: int, group: str = WORLD_GROUP) -> Any:
    """Send ``tensor`` to ``dest_rank``, which receives it with the same ``sr_tag``.
    Returns an op (None eagerly, where the send is done on return)."""
    import tensorflow as tf

    g = _group(group)
    me = get_rank_id(group)
    name = _sr_name(sr_tag, me, dest_rank, group)
    tensor = tf.convert_to_tensor(tensor)

    def run(r: Any, a: list[np.ndarray]) -> list[np.ndarray]:
        r.send(name, a[0], dest_rank, group=g)
        return [np.int32(0)]

    done = _run("send", run, [tensor], [tf.int32], [tf.TensorShape([])])[0]
    return None if tf.executing_eagerly() else done.op


def receive(shape: Any, data_type: Any, sr_tag: int, src_rank: int, group: str = WORLD_GROUP) -> Any:
    """The tensor ``src_rank`` sends with ``sr_tag`` (of ``shape`` and ``data_type``)."""
    import tensorflow as tf

    g = _group(group)
    me = get_rank_id(group)
    name = _sr_name(sr_tag, src_rank, me, group)
    dtype = tf.as_dtype(data_type)
    dims = [int(d) for d in (shape.as_list() if isinstance(shape, tf.TensorShape) else shape)]
    return _run("receive", lambda r, a: [r.recv(name, src_rank, dims, dtype.as_numpy_dtype, group=g)], [],
                [dtype], [tf.TensorShape(dims)])[0]


def all_to_all_v_dynamic(send_data: Any, send_counts: Any, send_displacements: Any, recv_counts: Any,
                         recv_displacements: Any, group: str = WORLD_GROUP) -> Any:
    """All-to-all of a flat ``send_data``: ``send_counts[j]`` elements from
    ``send_displacements[j]`` go to group rank j; what rank j sends here lands at
    ``recv_displacements[j]`` (``recv_counts[j]`` elements, checked)."""
    import tensorflow as tf

    g = _group(group)
    name = _name("alltoallv", group)
    data = tf.reshape(tf.convert_to_tensor(send_data), [-1])
    ints = [tf.cast(tf.reshape(tf.convert_to_tensor(x), [-1]), tf.int64)
            for x in (send_counts, send_displacements, recv_counts, recv_displacements)]

    def run(r: Any, a: list[np.ndarray]) -> list[np.ndarray]:
        flat, scount, sdisp, rcount, rdisp = a
        packed = np.concatenate([flat[d:d + c] for c, d in zip(scount, sdisp)]) if len(scount) else flat[:0]
        received, counts = r.alltoall(name, packed, [int(c) for c in scount], group=g)
        if [int(c) for c in counts] != [int(c) for c in rcount]:
            raise TensorMismatchError(f"all_to_all_v_dynamic {name!r}: recv_counts {list(rcount)} differ from what "
                                      f"the ranks sent here: {list(counts)}")
        out = np.zeros(int(max((d + c for c, d in zip(rcount, rdisp)), default=0)), flat.dtype)
        at = 0
        for c, d in zip(rcount, rdisp):
            out[d:d + c] = received[at:at + c]
            at += c
        return [out]

    return _run("all_to_all_v", run, [data, *ints], [data.dtype], [tf.TensorShape([None])])[0]


all_to_all_v = all_to_all_v_dynamic


def all_to_all_v_c(send_data: Any, send_count_matrix: Any, rank: Any, fusion: int = 0, fusion_id: int = -1,
                   group: str = WORLD_GROUP) -> Any:
    """All-to-all of a flat ``send_data`` given every rank's counts:
    ``send_count_matrix[i][j]`` elements go from group rank i to group rank j, packed in
    rank order on both sides; ``rank`` is this rank's place in ``group``."""
    import tensorflow as tf

    check_fusion(fusion, fusion_id)
    matrix = tf.cast(tf.convert_to_tensor(send_count_matrix), tf.int64)
    if matrix.shape.rank != 2:
        raise ConfigError(f"`send_count_matrix` must be a matrix (group size x group size). "
                          f"Received: shape={matrix.shape}")
    send_counts, recv_counts = matrix[rank], matrix[:, rank]
    return all_to_all_v_dynamic(send_data, send_counts, tf.cumsum(send_counts, exclusive=True), recv_counts,
                                tf.cumsum(recv_counts, exclusive=True), group)


def _split_strategy(argument: str, values: Any, group: str) -> None:
    _group(group)
    listed = list(values) if isinstance(values, (list, tuple)) else None
    if not listed or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in listed):
        raise ConfigError(f"`{argument}` must be a non-empty list of non-negative numbers. "
                          f"Received: {argument}={values!r}")


def set_split_strategy_by_idx(idxList: Any, group: str = WORLD_GROUP) -> None:  # noqa: N803 (HCCL's name)
    """Checked, no effect: the engines fuse gradients as they are produced."""
    _split_strategy("idxList", idxList, group)


def set_split_strategy_by_size(dataSizeList: Any, group: str = WORLD_GROUP) -> None:  # noqa: N803 (HCCL's name)
    """Checked, no effect: the engines fuse gradients as they are produced."""
    _split_strategy("dataSizeList", dataSizeList, group)


def _unsupported(name: str, instead: str) -> UnsupportedCallError:
    return UnsupportedCallError(f"hostreduce.hccl.{name} is not supported: it reads or writes another device's "
                                f"memory by address (RDMA). Use {instead} instead.")


def gather_all_to_all_v(addrinfo: Any, addrinfo_count_per_rank: Any, recv_counts: Any, recv_displacements: Any,
                        dtype: Any, addr_length: Any, group: str = WORLD_GROUP) -> Any:
    raise _unsupported("gather_all_to_all_v", "all_to_all_v(send_data, send_counts, send_displacements, "
                       "recv_counts, recv_displacements) on the gathered data")


def remote_read(tensorRemote: Any, data_type: Any) -> Any:  # noqa: N803 (HCCL's name)
    raise _unsupported("remote_read", "parameter servers (hostreduce.ParameterServerStrategy) for tables "
                       "read by rows, or all_to_all_v to exchange rows")


def remote_ref_read(tensorRemote: Any, cache: Any, offset: Any) -> Any:  # noqa: N803 (HCCL's name)
    raise _unsupported("remote_ref_read", "parameter servers (hostreduce.ParameterServerStrategy) for tables "
                       "read by rows, or all_to_all_v to exchange rows")


def remote_write(tensorRemote: Any, tensorLocal: Any, data_type: Any) -> Any:  # noqa: N803 (HCCL's name)
    raise _unsupported("remote_write", "parameter servers (hostreduce.ParameterServerStrategy) for tables "
                       "updated by rows, or send/receive")


def remote_scatter_write(tensorRemote: Any, tensorLocal: Any, offset: Any) -> Any:  # noqa: N803 (HCCL's name)
    raise _unsupported("remote_scatter_write", "parameter servers (hostreduce.ParameterServerStrategy) for "
                       "tables updated by rows, or send/receive")


def _check_rank_size(rank_size: Any, group: str) -> None:
    size = get_rank_size(group)
    if rank_size != size:
        raise ConfigError(f"`rank_size` must be the size of group {group!r} ({size}). Received: rank_size={rank_size!r}")


def forget_groups() -> None:
    """At the job's end (``shutdown()``): group names end with it."""
    with _lock:
        _groups.clear()


_engine.on_shutdown(forget_groups)
