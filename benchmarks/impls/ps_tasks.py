"""The processes of the parameter-server benchmark (``parameter_server.py``): what each
task of each mode runs, and how its traffic is counted.

* ``hostreduce`` modes (``sync``, ``async``, ``allreduce``): every task runs the
  recommender example's ``model_fn`` under hostreduce's Estimator
  (``ParameterServerStrategy`` on ps and workers; ``MultiWorkerStrategy`` for the
  dense all-reduce); the training tasks time their steps with a hook.
* ``tf``: TensorFlow's ``ParameterServerStrategy``: ps and worker tasks run
  ``tf.distribute.Server``; the coordinator builds the same model from ``tf.Variable``s
  (the tables sharded by ``variable_partitioner``), schedules the steps with
  ``ClusterCoordinator`` and times them.

Traffic: ``socket_bytes(pids)`` sums, over every TCP socket the processes own, the
bytes the kernel acknowledged as sent plus the bytes received (``ss -tinp``): the same
measure for both systems, gRPC and HTTP/2 framing included. A window's traffic is the
difference of two readings.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.impls import training
from benchmarks.impls.training import tf_threads

__all__ = ["socket_bytes", "hostreduce_task", "tf_server_task", "tf_coordinator_task", "example_module"]

ADAM = {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7}  # Keras's defaults, as in the example's Adam
_PID = re.compile(r"pid=(\d+),")
_COUNTERS = re.compile(r"\b(bytes_acked|bytes_received):(\d+)")


def example_module() -> Any:
    """``examples/recommender/wide_deep.py``: the model and data every mode trains."""
    return training.example_module("recommender", "wide_deep")


def socket_bytes(pids: list[int]) -> dict[int, int]:
    """Bytes sent (acknowledged) plus received so far over the TCP sockets of each pid."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=30).stdout
    totals = {pid: 0 for pid in pids}
    owner = None
    for line in out.splitlines():
        if not line.startswith(("\t", " ")):  # a socket's line; its counters follow on the next
            found = _PID.findall(line)
            owner = int(found[0]) if found and int(found[0]) in totals else None
        elif owner is not None:
            totals[owner] += sum(int(v) for _, v in _COUNTERS.findall(line))
    return totals


def _write(workdir: Path, name: str, record: dict) -> None:
    (workdir / f"{name}.json").write_text(json.dumps(record))


# --------------------------------------------------------------------------- hostreduce


def hostreduce_task(plan: dict, cell: dict, workdir: Path) -> None:
    """One task of a hostreduce job (ps or training task; the roles come from TF_CONFIG)."""
    tf_threads(plan)
    import hostreduce

    wd = example_module()
    if cell["mode"] == "allreduce":
        strategy = hostreduce.MultiWorkerStrategy()
        role, rank = "worker", strategy.rank
    else:
        strategy = hostreduce.ParameterServerStrategy(sync=cell["mode"] == "sync", sparse="lazy",
                                                         shard_bytes=plan["shard_bytes"])
        role = strategy.role
        rank = strategy.rank if role == "worker" else None
    params = {"vocab": cell["vocab"], "dim": plan["dim"], "learning_rate": 1e-3}
    estimator = hostreduce.Estimator(wd.model_fn, params=params,
                                     config=hostreduce.RunConfig(train_distribute=strategy, log_step_count_steps=None))
    warmup, steps = plan["warmup"], plan["steps"]
    marks: dict[str, Any] = {}
    losses: list[float] = []

    def traffic() -> dict[str, Any]:
        client = strategy.job.client if cell["mode"] != "allreduce" else None
        return {"socket": socket_bytes([os.getpid()])[os.getpid()],
                "client_sent": dict(client.bytes_sent) if client else {},
                "client_received": dict(client.bytes_received) if client else {}}

    def hook(step: int, loss: float) -> None:
        losses.append(loss)
        if step == warmup:  # readings outside the timed window
            marks["start"] = traffic()
            marks["t0"] = time.perf_counter()
        elif step == warmup + steps:
            marks["t1"] = time.perf_counter()
            marks["end"] = traffic()

    # A ps task serves inside train() and ends its process when the chief's ends.
    estimator.train(wd.make_input_fn(plan["batch"], cell["vocab"], seed=0), max_steps=warmup + steps, hooks=[hook])
    _write(workdir, f"rank{rank}", {"role": role, "rank": rank, "steps": steps, "seconds": marks["t1"] - marks["t0"],
                                    "start": marks["start"], "end": marks["end"], "first_loss": losses[0],
                                    "last_loss": losses[-1]})
    estimator.close()


# --------------------------------------------------------------------------- TensorFlow


def tf_server_task(workdir: Path) -> None:
    """A ps or worker task of TensorFlow's ParameterServerStrategy: serve until the
    coordinator says it is done (``tf.distribute.Server.join`` never returns)."""
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id,
                         protocol=resolver.rpc_layer or "grpc", start=True)
    deadline = time.monotonic() + float(os.environ.get("PS_BENCH_TIMEOUT_S", "3600"))
    while not (workdir / "done").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    os._exit(0)  # the server's threads never end on their own


def _uniform(shape: tuple[int, ...], limit: float) -> Any:
    """An initializer run where the variable lives (each ps makes its own shard)."""
    import tensorflow as tf

    def init(shard_info: Any = None) -> Any:
        return tf.random.uniform(shard_info.shape if shard_info is not None else shape, -limit, limit)

    return init


def _zeros(shape: tuple[int, ...]) -> Any:
    import tensorflow as tf

    def init(shard_info: Any = None) -> Any:
        return tf.zeros(shard_info.shape if shard_info is not None else shape)

    return init


def _parts(variable: Any) -> list[Any]:
    """A sharded variable's shards; an unsplit variable alone."""
    return list(getattr(variable, "variables", [variable]))


def tf_coordinator_task(plan: dict, cell: dict, workdir: Path) -> None:
    """The coordinator of TensorFlow's ParameterServerStrategy: the example's model in
    plain TF, Adam applied on the ps (only the batch's rows of the tables, as the
    hostreduce ps do with ``sparse="lazy"``), steps scheduled over the workers."""
    tf_threads(plan)
    import tensorflow as tf

    wd = example_module()
    vocab, dim, batch = cell["vocab"], plan["dim"], plan["batch"]
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    # Split variables of shard_bytes and more over both ps, as hostreduce's placement does.
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=plan["shard_bytes"],
                                                                              max_shards=plan["ps"])
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    b1, b2, eps = ADAM["beta_1"], ADAM["beta_2"], ADAM["epsilon"]
    sizes = [wd.FIELDS * dim + wd.DENSE, *wd.HIDDEN, 1]
    with strategy.scope():
        # Sharded variables first, so the round-robin placement puts part i of every
        # table and of its slots on ps i.
        tables = [tf.Variable(_uniform((vocab, dim), 0.05), shape=(vocab, dim), dtype=tf.float32, name="deep"),
                  tf.Variable(_zeros((vocab, 1)), shape=(vocab, 1), dtype=tf.float32, name="wide")]
        slots = [[tf.Variable(_zeros(tuple(t.shape)), shape=t.shape, dtype=tf.float32, name=f"{t.name[:-2]}_{s}")
                  for s in ("m", "v")] for t in tables]
        dense = []
        for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:])):
            limit = (6.0 / (n_in + n_out)) ** 0.5  # Keras's glorot_uniform
            dense += [tf.Variable(_uniform((n_in, n_out), limit), shape=(n_in, n_out), dtype=tf.float32),
                      tf.Variable(_zeros((n_out,)), shape=(n_out,), dtype=tf.float32)]
        dense_slots = [[tf.Variable(_zeros(tuple(v.shape)), shape=v.shape, dtype=tf.float32) for _ in range(2)]
                       for v in dense]
        iterations = tf.Variable(0, dtype=tf.int64)

    def dataset_fn(input_context: Any = None) -> Any:
        return tf.data.Dataset.range(1 << 62).map(lambda i: wd.click_batch(0, 0, i, batch, vocab)).prefetch(2)

    def forward(features: Any, labels: Any) -> Any:
        ids = features["ids"]
        rows = tf.nn.embedding_lookup(tables[0], ids)
        h = tf.concat([tf.reshape(rows, [-1, wd.FIELDS * dim]), features["x"]], axis=1)
        for i in range(0, len(dense), 2):
            h = tf.matmul(h, dense[i]) + dense[i + 1]
            if i + 2 < len(dense):
                h = tf.nn.relu(h)
        logits = h + tf.reduce_sum(tf.nn.embedding_lookup(tables[1], ids), axis=1)
        return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))

    def replica_fn(features: Any, labels: Any) -> Any:
        shards = [p for t in tables for p in _parts(t)]
        dense_parts = [p for v in dense for p in _parts(v)]
        with tf.GradientTape() as tape:
            loss = forward(features, labels)
        grads = tape.gradient(loss, shards + dense_parts)
        with tf.device(iterations.device):
            t = tf.cast(iterations.assign_add(1), tf.float32)
            alpha = 1e-3 * tf.sqrt(1.0 - tf.pow(b2, t)) / (1.0 - tf.pow(b1, t))
        k = 0
        for table, (m_table, v_table) in zip(tables, slots):
            for var, m, v in zip(_parts(table), _parts(m_table), _parts(v_table)):
                g = grads[k]
                k += 1
                # Duplicate ids summed on the worker, as hostreduce's client does before a push.
                ids, pos = tf.unique(g.indices)
                g = tf.math.unsorted_segment_sum(g.values, pos, tf.shape(ids)[0])
                with tf.device(var.device):  # the update runs on the ps: only ids and rows travel
                    m_rows, v_rows = tf.gather(m, ids), tf.gather(v, ids)
                    m_rows += (g - m_rows) * (1 - b1)
                    v_rows += (tf.square(g) - v_rows) * (1 - b2)
                    m.scatter_update(tf.IndexedSlices(m_rows, ids))
                    v.scatter_update(tf.IndexedSlices(v_rows, ids))
                    var.scatter_sub(tf.IndexedSlices(m_rows * alpha / (tf.sqrt(v_rows) + eps), ids))
        slot_parts = [(m, v) for pair in dense_slots for m, v in zip(_parts(pair[0]), _parts(pair[1]))]
        for var, g, (m, v) in zip(dense_parts, grads[k:], slot_parts):
            g = tf.convert_to_tensor(g)
            with tf.device(var.device):
                m.assign_add((g - m) * (1 - b1))
                v.assign_add((tf.square(g) - v) * (1 - b2))
                var.assign_sub(m * alpha / (tf.sqrt(v) + eps))
        return loss

    @tf.function
    def worker_fn(iterator: Any) -> Any:
        features, labels = next(iterator)
        return strategy.run(replica_fn, args=(features, labels))

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    pids = [int((workdir / f"pid.worker{i}").read_text()) for i in range(plan["workers"])]
    first = coordinator.schedule(worker_fn, args=(iterator,))
    for _ in range(plan["warmup"] * plan["workers"] - 1):
        coordinator.schedule(worker_fn, args=(iterator,))
    coordinator.join()
    start = socket_bytes(pids)
    t0 = time.perf_counter()
    total = plan["steps"] * plan["workers"]  # the same number of batches as the hostreduce jobs train
    last = None
    for _ in range(total):
        last = coordinator.schedule(worker_fn, args=(iterator,))
    coordinator.join()
    t1 = time.perf_counter()
    end = socket_bytes(pids)
    placement = {"tables": [[p.device for p in _parts(t)] for t in tables],
                 "slots": [[p.device for p in _parts(s)] for pair in slots for s in pair]}
    _write(workdir, "coordinator", {"role": "coordinator", "steps": total, "seconds": t1 - t0,
                                    "socket_start": start, "socket_end": end, "first_loss": float(first.fetch()),
                                    "last_loss": float(last.fetch()), "placement": placement})
