"""Rank code for tests/test_horovod_exact.py: Horovod's TensorFlow API as Horovod's own
tests use it, in the three modes they run every case in (eager, ``tf.function``, a TF1
graph run by a ``Session``): the 8- and 16-bit integers and bool, Horovod's integer
scaling, gradients of the collectives, ``tf.errors`` types for mismatches across ranks
(the engine stays usable afterwards), the object collectives, the layout ops and build
queries, and ``broadcast_global_variables`` with its hook in a ``MonitoredSession``.

Run by the spawn harness (ring, ``TF_CONFIG``) or as a script under ``mpirun``
(``python horovod_exact.py``), printing ``RESULT rank R/N: checks=K``.
"""
from __future__ import annotations

import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

INTS = ("uint8", "int8", "uint16", "int16", "int32", "int64")
FLOATS = ("float16", "float32", "float64")


def run_in_mode(mode: str, build):
    """``build()`` eagerly, traced in a ``tf.function``, or in a TF1 graph by a session."""
    import tensorflow as tf

    if mode == "eager":
        out = build()
    elif mode == "function":
        out = tf.function(build)()
    else:
        with tf.Graph().as_default():
            fetches = build()
            with tf.compat.v1.Session() as session:
                session.run(tf.compat.v1.global_variables_initializer())
                return session.run(fetches)
    return tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, out)


def _summed(hvd, value, dtype):
    import tensorflow as tf

    return lambda: hvd.allreduce(tf.constant(value, dtype=dtype), op=hvd.Sum)


def check_mode(mode: str, rank: int, size: int) -> int:
    import tensorflow as tf

    import hostreduce.horovod as hvd

    checks = 0
    for name in INTS + FLOATS:
        dtype = tf.as_dtype(name)
        base = np.arange(12).reshape(3, 4) % (2 if name in ("uint8", "int8") else 50)

        got = run_in_mode(mode, _summed(hvd, tf.constant(base, dtype=dtype).numpy(), dtype))
        assert got.dtype == np.dtype(name) and (got == (base * size).astype(name)).all(), (mode, name, got)
        checks += 1

    # Horovod's integer scaling: in float64, truncated back.
    got = run_in_mode(mode, lambda: hvd.allreduce(tf.constant([3, 5], tf.int8), op=hvd.Sum, prescale_factor=0.5))
    assert got.tolist() == [1 * size, 2 * size], (mode, got)
    # bool moves (broadcast, all-gather) but is not reduced.
    flags = np.array([rank % 2 == 0, True])
    got = run_in_mode(mode, lambda: hvd.broadcast(tf.constant(flags), root_rank=size - 1))
    assert got.tolist() == [(size - 1) % 2 == 0, True], (mode, got)
    got = run_in_mode(mode, lambda: hvd.allgather(tf.constant(flags)))
    assert got.tolist() == sum(([r % 2 == 0, True] for r in range(size)), []), (mode, got)
    checks += 3

    # Gradients, as Horovod defines them.
    def gradients():
        x = tf.constant(np.ones((2, 3), np.float32) * (rank + 1))
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            summed = tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum))
            gathered = tf.reduce_sum(hvd.allgather(x) * 2.0)
            broadcast = tf.reduce_sum(hvd.broadcast(x, root_rank=0))
        return [tape.gradient(summed, x), tape.gradient(gathered, x), tape.gradient(broadcast, x)]

    # In a TF1 session the forward and backward collectives of one run start in any
    # order: the engines agree on the order (the MPI engine too).
    g_sum, g_gather, g_bcast = run_in_mode(mode, gradients)
    assert (g_sum == size).all(), (mode, g_sum)
    assert (g_gather == 2.0).all(), (mode, g_gather)
    assert (g_bcast == (1.0 if rank == 0 else 0.0)).all(), (mode, g_bcast)
    checks += 3

    # The layout ops.
    ops = run_in_mode(mode, lambda: [hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(), hvd.local_size_op(),
                              hvd.process_set_included_op(0)])
    assert [int(v) for v in ops] == [rank, size, hvd.local_rank(), hvd.local_size(), 1], (mode, ops)
    return checks + 1


def check_graph_errors(rank: int, size: int) -> int:
    """In a TF1 graph and in tf.function: ranks that disagree get
    tf.errors.FailedPreconditionError too, and the engine goes on."""
    import tensorflow as tf

    import hostreduce.horovod as hvd

    cases = [
        lambda: hvd.allreduce(tf.ones([5 + rank, 2])),
        lambda: hvd.broadcast(tf.ones([3], dtype=tf.int32 if rank % 2 == 0 else tf.float32), root_rank=0),
        lambda: hvd.allgather(tf.ones([2, 3 + rank])),
        lambda: hvd.reducescatter(tf.ones([4, 2 + rank])),
    ]
    for mode in ("graph", "function"):
        for i, case in enumerate(cases):
            try:
                run_in_mode(mode, case)
            except tf.errors.FailedPreconditionError:
                pass
            else:
                raise AssertionError(f"{mode} case {i}: no FailedPreconditionError")
            got = run_in_mode(mode, lambda: hvd.allreduce(tf.constant([1.0]), op=hvd.Sum))
            assert got.tolist() == [float(size)], (mode, i, got)
    return 2 * len(cases)


def check_errors(rank: int, size: int) -> int:
    """Eagerly: ranks that disagree get TensorFlow's error type (and hostreduce's) on
    every rank, and the next collective works."""
    import tensorflow as tf

    import hostreduce.horovod as hvd
    from hostreduce.errors import HostReduceError

    cases = [
        lambda: hvd.allreduce(tf.ones([17 + rank, 3])),
        lambda: hvd.allreduce(tf.ones([4], dtype=tf.int32 if rank % 2 == 0 else tf.float32)),
        lambda: hvd.broadcast(tf.ones([3]), root_rank=rank),
        lambda: hvd.allgather(tf.ones([2, 3 + rank])),
    ]
    for i, case in enumerate(cases):
        try:
            case()
        except tf.errors.FailedPreconditionError as exc:
            assert isinstance(exc, HostReduceError), (i, type(exc).__mro__)
        else:
            raise AssertionError(f"case {i}: no FailedPreconditionError")
        got = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)
        assert got.numpy().tolist() == [float(size)], (i, got)
    try:
        hvd.allreduce(tf.IndexedSlices(tf.ones([1, 3]), tf.constant([rank])), op=hvd.Max)
    except NotImplementedError:
        pass
    else:
        raise AssertionError("Max of IndexedSlices: no NotImplementedError")
    return len(cases) + 1


def check_objects_and_graph(rank: int, size: int) -> int:
    import tensorflow as tf

    import hostreduce.horovod as hvd

    obj = {"rank": rank, "items": list(range(rank + 2))}
    assert hvd.broadcast_object(obj, root_rank=size - 1) == {"rank": size - 1, "items": list(range(size + 1))}
    assert hvd.allgather_object(obj) == [{"rank": r, "items": list(range(r + 2))} for r in range(size)]
    assert hvd.broadcast_object_fn(root_rank=0)(f"from {rank}") == "from 0"
    assert isinstance(hvd.mpi_built(), bool) and hvd.nccl_built() == 0 and not hvd.gloo_enabled()
    assert hvd.is_homogeneous() and hvd._executing_eagerly()

    # A TF1 graph: broadcast_global_variables and BroadcastGlobalVariablesHook.
    with tf.Graph().as_default():
        v = tf.compat.v1.get_variable("v", initializer=tf.constant([float(rank), 1.0]), use_resource=True)
        bcast = hvd.broadcast_global_variables(size - 1)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(bcast)
            assert session.run(v).tolist() == [float(size - 1), 1.0]
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=tf.constant([float(rank)]), use_resource=True)
        hook = hvd.BroadcastGlobalVariablesHook(0)
        with tf.compat.v1.train.MonitoredSession(hooks=[hook]) as session:
            assert session.run(w).tolist() == [0.0]
    try:
        hvd.broadcast_global_variables(0)
    except RuntimeError:
        pass
    else:
        raise AssertionError("broadcast_global_variables eagerly: no RuntimeError")
    return 6


def rank_main(rank: int, size: int) -> int:
    import hostreduce.horovod as hvd

    hvd.init()
    checks = sum(check_mode(mode, rank, size) for mode in ("eager", "function", "graph"))
    checks += check_errors(rank, size) + check_graph_errors(rank, size) + check_objects_and_graph(rank, size)
    hvd.shutdown()
    return checks


if __name__ == "__main__":
    import hostreduce.horovod as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    total = rank_main(rank, size)
    print(f"RESULT rank {rank}/{size}: checks={total}", flush=True)
    sys.exit(0)
