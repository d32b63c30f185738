"""One rank of a check of the collectives beyond all-reduce through the TensorFlow
surfaces: ``hostreduce.horovod`` (process sets, ``reducescatter``, ``alltoall``,
``Product``) and ``hostreduce.hccl``/``hostreduce.distribute`` (HCCL's groups and ops),
eagerly and inside ``tf.function``, against numpy references every rank computes.

``rank_main(rank, size)`` returns ``{"checks": n, "failures": [...]}``; run it with
``hostreduce.testing.run_ranks`` (the ring) or as a script under mpirun.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np


def _value(rank: int, shape: tuple[int, ...], salt: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * salt + rank)
    return rng.uniform(0.5, 1.5, size=shape).astype(np.float32)


def rank_main(rank: int, size: int) -> dict[str, Any]:
    import tensorflow as tf

    import hostreduce.horovod as hvd
    from hostreduce import distribute, hccl

    hvd.init()
    assert (hvd.rank(), hvd.size()) == (rank, size)
    checks, failures = 0, []

    def check(what: str, got: Any, expected: Any, rtol: float = 1e-5) -> None:
        nonlocal checks
        checks += 1
        got = np.asarray(got)
        if got.shape != np.shape(expected) or not np.allclose(got, expected, rtol=rtol, atol=0):
            failures.append(f"{what}: got {got.tolist()!r:.200}, expected {np.asarray(expected).tolist()!r:.200}")

    def both(fn: Callable[[], Any]) -> list[Any]:
        """``fn`` run eagerly, then traced."""
        return [fn(), tf.function(fn)()]

    everyone = [_value(r, (2 * size + 1, 3), 1) for r in range(size)]
    total = np.sum(everyone, axis=0)
    counts = [(2 * size + 1) // size + (1 if i < (2 * size + 1) % size else 0) for i in range(size)]
    lo = sum(counts[:rank])
    for mode, got in zip(("eager", "graph"), both(lambda: hvd.reducescatter(everyone[rank], op=hvd.Sum))):
        check(f"reducescatter sum {mode}", got, total[lo:lo + counts[rank]])
    got = hvd.reducescatter(everyone[rank])  # Average, as Horovod's default
    check("reducescatter average", got, total[lo:lo + counts[rank]] / size)
    check("allreduce product", hvd.allreduce(everyone[rank], op=hvd.Product), np.prod(everyone, axis=0))

    # All-to-all: rank i sends (i + 1) rows to every rank, each row filled with i.
    def a2a() -> Any:
        rows = np.full((size * (rank + 1), 2), rank, np.float32)
        return hvd.alltoall(rows, splits=[rank + 1] * size)

    for mode, (out, received) in zip(("eager", "graph"), both(a2a)):
        expected = np.concatenate([np.full((i + 1, 2), i, np.float32) for i in range(size)])
        check(f"alltoall {mode}", out, expected)
        check(f"alltoall splits {mode}", received, [i + 1 for i in range(size)])

    # Process sets: evens and odds (Horovod's own test shape), every rank registers both.
    evens = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    odds = hvd.add_process_set([r for r in range(size) if r % 2 == 1]) if size > 1 else None
    mine = evens if rank % 2 == 0 else odds
    members = mine.ranks
    set_total = np.sum([everyone[r] for r in members], axis=0)
    for mode, got in zip(("eager", "graph"),
                         both(lambda: hvd.allreduce(everyone[rank], op=hvd.Sum, process_set=mine))):
        check(f"process set allreduce {mode}", got, set_total)
    check("process set allgather", hvd.allgather(everyone[rank][:1], process_set=mine),
          np.concatenate([everyone[r][:1] for r in members]))
    root = members[-1]
    check("process set broadcast (root is a job rank)", hvd.broadcast(everyone[rank], root, process_set=mine),
          everyone[root])
    check("process set rank/size", [mine.rank(), mine.size(), int(mine.included())],
          [members.index(rank), len(members), 1])
    assert hvd.remove_process_set(evens) and (odds is None or hvd.remove_process_set(odds))

    # HCCL: a group of the first and last rank, and the world.
    pair = sorted({0, size - 1})
    hccl.create_group("pair", len(pair), pair)
    check("hccl world size/id", [hccl.get_rank_size(), hccl.get_rank_id()], [size, rank])
    if rank in pair:
        g = pair.index(rank)
        check("hccl group size/id", [hccl.get_rank_size("pair"), hccl.get_rank_id("pair"),
                                     hccl.get_world_rank_from_group_rank("pair", len(pair) - 1),
                                     hccl.get_group_rank_from_world_rank(rank, "pair")],
              [len(pair), g, pair[-1], g])
        pair_total = np.sum([everyone[r] for r in pair], axis=0)
        for mode, got in zip(("eager", "graph"), both(lambda: hccl.allreduce(everyone[rank], "sum", group="pair"))):
            check(f"hccl allreduce {mode}", got, pair_total)
        check("hccl allreduce max", hccl.allreduce(everyone[rank], "max", group="pair"),
              np.max([everyone[r] for r in pair], axis=0))
        got = hccl.reduce(everyone[rank], "sum", root_rank=0, group="pair")
        check("hccl reduce", got, pair_total if g == 0 else everyone[rank])
        x = everyone[rank][:2 * len(pair)]
        part = np.sum([everyone[r][:2 * len(pair)] for r in pair], axis=0)[2 * g:2 * g + 2]
        check("hccl reduce_scatter", hccl.reduce_scatter(x, "sum", len(pair), group="pair"), part)
        check("hccl allgather", hccl.allgather(everyone[rank][:1], len(pair), group="pair"),
              np.concatenate([everyone[r][:1] for r in pair]))
        check("hccl broadcast list", hccl.broadcast([everyone[rank]], 0, group="pair")[0], everyone[pair[0]])
        distribute_mean = distribute.all_reduce([everyone[rank]], "mean", group="pair")[0]
        check("distribute.all_reduce mean on a group", distribute_mean, pair_total / len(pair))
        if len(pair) == 2:
            other = 1 - g

            @tf.function
            def exchange() -> Any:
                if g == 0:
                    sent = hccl.send(everyone[rank], 7, other, group="pair")
                    with tf.control_dependencies([sent]):
                        return hccl.receive([2 * size + 1, 3], tf.float32, 8, other, group="pair")
                received = hccl.receive([2 * size + 1, 3], tf.float32, 7, other, group="pair")
                with tf.control_dependencies([received]):
                    sent = hccl.send(everyone[rank], 8, other, group="pair")
                with tf.control_dependencies([sent]):
                    return tf.identity(received)

            check("hccl send/receive", exchange(), everyone[pair[other]])
        # All-to-all-v over the world: rank i sends i+1 elements to every rank, placed in
        # reverse order in its buffer (displacements), with a gap of one element.
    n = size * (rank + 1)
    data = np.arange(n + size, dtype=np.float32) + 100 * rank
    send_counts = [rank + 1] * size
    send_displs = [(size - 1 - j) * (rank + 2) for j in range(size)]
    data = np.zeros(max(d + c for c, d in zip(send_counts, send_displs)), np.float32)
    for j, d in enumerate(send_displs):
        data[d:d + rank + 1] = 100 * rank + 10 * j + np.arange(rank + 1)
    recv_counts = [i + 1 for i in range(size)]
    recv_displs = [sum(recv_counts[:i]) + i for i in range(size)]
    got = hccl.all_to_all_v_dynamic(data, send_counts, send_displs, recv_counts, recv_displs)
    expected = np.zeros(recv_displs[-1] + recv_counts[-1], np.float32)
    for i in range(size):
        expected[recv_displs[i]:recv_displs[i] + i + 1] = 100 * i + 10 * rank + np.arange(i + 1)
    check("hccl all_to_all_v_dynamic", got, expected)
    hccl.destroy_group("pair")
    errors = []
    for what, fn in (("unregistered set", lambda: hvd.allreduce(everyone[rank], process_set=hvd.ProcessSet([0]))),
                     ("unknown hccl group", lambda: hccl.allreduce(everyone[rank], "sum", group="nope")),
                     ("hccl mean", lambda: hccl.allreduce(everyone[rank], "mean"))):
        try:
            fn()
            errors.append(f"{what}: no error")
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            errors.append(f"{what}: {type(e).__name__}: {e}")
    return {"checks": checks, "failures": failures, "errors": errors}


if __name__ == "__main__":  # under mpirun
    from mpi4py import MPI  # noqa: F401 - the launcher's variables give rank and size

    r, s = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0)), int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1))
    result = rank_main(r, s)
    if result["failures"]:
        raise AssertionError(result["failures"])
    print(f"OK rank {r}/{s}: {result['checks']} checks", flush=True)
