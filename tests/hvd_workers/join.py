"""Rank code for tests/test_horovod_join.py: Horovod's ``test_horovod_join_allreduce`` on
CPU (dtypes int32, int64, float16, float32, float64; dims 1 to 3; rank 0 or 1 joins
first) in the three modes (eager, ``tf.function``, a TF1 graph run by a ``Session``),
and what Horovod's join tests check besides: ``Average`` divides by the job's size,
fused all-reduces, broadcasts and all-gathers refused with
``tf.errors.FailedPreconditionError`` while a rank has joined, a barrier passed by a
joined rank, and unnamed collectives that match again after a join.

Run by the spawn harness (ring, ``TF_CONFIG``) or as a script under ``mpirun``
(``python join.py``), printing ``RESULT rank R/N: checks=K``.
"""
from __future__ import annotations

import itertools
import os
import sys

import numpy as np

from tests.hvd_workers.horovod_exact import run_in_mode

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

DTYPES = ("int32", "int64", "float16", "float32", "float64")
MODES = ("eager", "function", "graph")


def check_join_allreduce(mode: str, rank: int, size: int) -> int:
    """Horovod's test_horovod_join_allreduce, on CPU."""
    import tensorflow as tf

    import hostreduce.horovod as hvd

    checks = 0
    rng = np.random.default_rng(1234)
    for name, dim, first_join_rank in itertools.product(DTYPES, (1, 2, 3), (0, 1)):
        dtype = tf.as_dtype(name)
        value = rng.uniform(-100, 100, [17] * dim).astype(name)
        if rank == first_join_rank:
            ret = run_in_mode(mode, hvd.join)
        else:
            summed = run_in_mode(mode, lambda: hvd.allreduce(tf.constant(value, dtype=dtype), op=hvd.Sum))
            ret = run_in_mode(mode, hvd.join)
            expected = value.astype(np.float64) * (size - 1)
            threshold = 0 if size <= 3 or name.startswith("int") else 1e-4
            assert summed.dtype == np.dtype(name) and summed.shape == value.shape, (mode, name, summed.dtype)
            assert np.max(np.abs(summed.astype(np.float64) - expected)) <= threshold, (mode, name, dim)
        assert np.asarray(ret).dtype == np.int32 and np.asarray(ret).shape == (), (mode, ret)
        assert int(ret) != first_join_rank, (mode, name, dim, first_join_rank, ret)
        assert hvd.allgather_object(int(ret)) == [int(ret)] * size, (mode, ret)
        checks += 1
    return checks


def check_average_and_fusion(mode: str, rank: int, size: int) -> int:
    """Average divides by the job's size (the joined rank counts, as in Horovod), also for
    all-reduces fused in one group."""
    import tensorflow as tf

    import hostreduce.horovod as hvd

    a = np.arange(5 * 3, dtype=np.float32).reshape(5, 3) + rank
    b = np.arange(17, dtype=np.float64) * 2.0
    for first_join_rank in range(size):
        if rank == first_join_rank:
            ret = run_in_mode(mode, hvd.join)
        else:
            got_a, got_b = run_in_mode(mode, lambda: hvd.grouped_allreduce([tf.constant(a), tf.constant(b)],
                                                                    op=hvd.Average))
            ret = run_in_mode(mode, hvd.join)
            others = [r for r in range(size) if r != first_join_rank]
            expected_a = sum(np.arange(15, dtype=np.float32).reshape(5, 3) + r for r in others) / size
            np.testing.assert_allclose(got_a, expected_a, rtol=1e-6)
            np.testing.assert_allclose(got_b, b * (size - 1) / size, rtol=1e-12)
        assert int(ret) != first_join_rank, (mode, ret)
    return 1


def check_refused_while_joined(mode: str, rank: int, size: int) -> int:
    """Horovod's test_horovod_join_allgather and test_horovod_join_broadcast: the ranks
    that did not join get FailedPreconditionError, and the join goes on."""
    import tensorflow as tf

    import hostreduce.horovod as hvd

    cases = [lambda: hvd.allgather(tf.ones([17, 17, 17])),
             lambda: hvd.broadcast(tf.ones([17, 17, 17]), root_rank=(rank + 1) % size),
             lambda: hvd.reducescatter(tf.ones([4, 2]), op=hvd.Sum)]
    for case, first_join_rank in itertools.product(cases, range(size)):
        if rank == first_join_rank:
            ret = run_in_mode(mode, hvd.join)
        else:
            try:
                run_in_mode(mode, case)
            except tf.errors.FailedPreconditionError:
                pass
            else:
                raise AssertionError(f"{mode}: no FailedPreconditionError while rank {first_join_rank} joined")
            ret = run_in_mode(mode, hvd.join)
        assert int(ret) != first_join_rank, (mode, ret)
    return 1


def check_barrier_and_names(rank: int, size: int) -> int:
    """A barrier passes the joined rank, and unnamed eager collectives match again after
    a join in which only some ranks ran them."""
    import tensorflow as tf

    import hostreduce.horovod as hvd
    from hostreduce.ops import job

    if rank == 0:
        assert int(hvd.join()) == size - 1
    else:
        job.job().reducer().barrier()
        for _ in range(3):
            hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)
        assert int(hvd.join()) == size - 1
    job.job().reducer().barrier()
    got = hvd.allreduce(tf.constant([float(rank)]), op=hvd.Sum)
    assert got.numpy().tolist() == [float(sum(range(size)))], got
    return 1


def rank_main(rank: int, size: int) -> int:
    import hostreduce.horovod as hvd

    hvd.init()
    checks = 0
    for mode in MODES:
        checks += check_join_allreduce(mode, rank, size)
        checks += check_average_and_fusion(mode, rank, size)
        checks += check_refused_while_joined(mode, rank, size)
    checks += check_barrier_and_names(rank, size)
    hvd.shutdown()
    return checks


def rank_main_once(rank: int, size: int) -> int:
    """One join in the process, eagerly: what Horovod 0.28.1's own TensorFlow join does
    reliably on CPU (the 'horovod' engine runs it)."""
    import tensorflow as tf

    import hostreduce.horovod as hvd
    from hostreduce.ops import job

    hvd.init()
    value = np.arange(17 * 3, dtype=np.float32).reshape(17, 3)
    if rank == 0:
        ret = hvd.join()
    else:
        summed = hvd.allreduce(tf.constant(value), op=hvd.Sum)
        assert (summed.numpy() == value * (size - 1)).all(), summed
        averaged = hvd.grouped_allreduce([tf.constant(value), tf.constant(value[0])], op=hvd.Average)
        np.testing.assert_allclose(averaged[0].numpy(), value * (size - 1) / size, rtol=1e-6)
        try:
            hvd.broadcast(tf.constant(value), root_rank=size - 1)
        except tf.errors.FailedPreconditionError:
            pass
        else:
            raise AssertionError("broadcast while rank 0 joined: no FailedPreconditionError")
        job.job().reducer().barrier()
        ret = hvd.join()
    assert int(ret) == size - 1, ret
    assert hvd.allgather_object(int(ret)) == [size - 1] * size
    hvd.shutdown()
    return 1


CHECKS = len(MODES) * (len(DTYPES) * 3 * 2 + 2) + 1


if __name__ == "__main__":
    import hostreduce.horovod as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    total = rank_main_once(rank, size) if sys.argv[1:] == ["once"] else rank_main(rank, size)
    print(f"RESULT rank {rank}/{size}: checks={total}", flush=True)
    sys.exit(0)


# ---------------------------------------------------------------- the ring's join under faults (no TensorFlow)
def _ring(**overrides):
    from hostreduce.cluster import resolve_cluster
    from hostreduce.config import Config
    from hostreduce.reducers import create_reducer

    return create_reducer("ring", cluster=resolve_cluster(), config=Config.from_env(**overrides))


def ring_join_peer_killed(rank: int, size: int) -> str:
    """Rank 1 joins; rank 0 runs an all-reduce with its zeros, then is killed: the join
    fails with PeerLostError."""
    import signal

    r = _ring()
    if rank == 1:
        try:
            r.join()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return type(exc).__name__
        return "joined"
    got = r.allreduce("a", np.full(4, 3.0, np.float32))
    assert got.tolist() == [3.0] * 4, got
    os.kill(os.getpid(), signal.SIGKILL)
    return "not reached"


def ring_join_peer_closed(rank: int, size: int) -> str:
    """Rank 0 joins; rank 1 runs an all-reduce and closes without joining: the join
    fails with PeerLostError naming rank 1."""
    r = _ring()
    if rank == 0:
        try:
            r.join()
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"
        return "joined"
    assert r.allreduce("a", np.ones(2, np.int64), op="mean").tolist() == [0, 0]  # (1 + 0) // 2
    r.close()
    return "closed"


def ring_join_stalls(rank: int, size: int, marks: str) -> str:
    """Rank 1 joins; rank 0 runs nothing for longer than timeout_s: the join fails with
    CollectiveTimeoutError, and rank 0 goes on once it has."""
    from tests.marks import mark, wait_for_marks

    r = _ring(timeout_s=1.0)
    if rank == 1:
        try:
            r.join()
        except Exception as exc:  # noqa: BLE001
            outcome = type(exc).__name__
        else:
            outcome = "joined"
        mark(marks, "join-ended")
        return outcome
    wait_for_marks(marks, ["join-ended"])
    return "waited"
