"""The collectives the benchmarks time, one class per peer, in the worker processes:
hostreduce's ring reducer (:class:`Ring`), Open MPI through mpi4py (:class:`Mpi`),
TensorFlow's collective ring (:class:`TfRing`), and grpcio alone moving a ring's bytes
(:class:`GrpcFloor`).

Each has the same interface: ``rank``, ``size``, ``prepare(nelem)`` -> a :class:`Cell`
(one preallocated float32 buffer and the collective that reduces it), ``max_over_ranks``
(the ranks agree on a value), ``barrier`` and ``close``. :func:`open_collective` makes
one by name. Imported by the workers only (numpy, hostreduce, mpi4py, TensorFlow are
imported when a collective is made).
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

from benchmarks.harness.measure import time_op

__all__ = ["Cell", "Ring", "GrpcFloor", "Mpi", "TfRing", "open_collective"]


class Cell:
    """One preallocated buffer and the collective that reduces it. ``check`` (optional)
    replaces the comparison of the result with the expected sum."""

    def __init__(self, run: Callable[[], Any], fill: Callable[[float], None], result: Callable[[], Any],
                 check: Callable[[], bool] | None = None):
        self.run, self.fill, self.result, self.check = run, fill, result, check

    def verify(self, rank: int, size: int, nelem: int) -> bool:
        """One collective of ``rank + 1`` from every rank: each of the ``nelem`` elements
        must equal N(N+1)/2. Leaves the buffer zeroed (zeros stay zeros: no overflow to
        inf over thousands of repetitions)."""
        import numpy as np

        self.fill(float(rank + 1))
        self.run()
        if self.check is not None:
            correct = self.check()
        else:
            res = np.asarray(self.result())
            correct = bool(res.shape == (nelem,) and np.all(res == size * (size + 1) / 2.0))
            del res
        self.fill(0.0)
        return correct


def _check_scatter(np: Any, got: list[Any], size: int, nelem: int) -> Callable[[], bool]:
    """The reduce-scatter's check: this rank's S/N elements, each N(N+1)/2."""
    return lambda: bool(got[0] is not None and got[0].size == nelem // size
                        and np.all(got[0] == size * (size + 1) / 2.0))


class Ring:
    """hostreduce's ``ring`` reducer on the cluster of ``TF_CONFIG``: ``allreduce(name,
    buf, op="sum", out=buf)``, or ``reduce_scatter`` of the buffer in N blocks."""

    def __init__(self, transport: str, collective: str = "allreduce") -> None:
        import numpy as np
        from hostreduce.cluster import resolve_cluster
        from hostreduce.config import Config
        from hostreduce.reducers import create_reducer

        self._np = np
        config = Config.from_env(transport=transport)
        self.compression = config.compression
        t0 = time.perf_counter()
        self.reducer = create_reducer("ring", cluster=resolve_cluster(), config=config)
        self.connect_s = time.perf_counter() - t0
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
        to_s = time_op(lambda: to_wire(src, wire), reps)
        from_s = time_op(lambda: from_wire(w, np.float32, src), reps)
        return {"to_wire_ms": round(min(to_s) * 1e3, 3), "from_wire_ms": round(min(from_s) * 1e3, 3)}

    def prepare(self, nelem: int) -> Cell:
        np = self._np
        buf = np.empty(nelem, dtype=np.float32)
        buf.fill(0.0)  # touch every page now, not in the timed loop
        name, r = f"bench.f32.{nelem}", self.reducer
        if self._collective == "reduce_scatter":
            got: list[Any] = [None]

            def scatter() -> None:
                got[0] = r.reduce_scatter(name, buf.reshape(self.size, -1), op="sum")

            return Cell(scatter, buf.fill, lambda: got[0], _check_scatter(np, got, self.size, nelem))

        def run() -> None:
            r.allreduce(name, buf, op="sum", out=buf)

        return Cell(run, buf.fill, lambda: buf)

    def max_over_ranks(self, value: float) -> float:
        v = self._np.array([value], dtype=self._np.float64)
        self.reducer.allreduce("bench.agree", v, op="max", out=v)
        return float(v[0])

    def barrier(self) -> None:
        self.reducer.barrier()

    def close(self) -> None:
        self.reducer.close()


class GrpcFloor:
    """The least time any ring over grpcio can take on this machine: each rank streams
    the bytes a ring all-reduce sends per rank, 2(N-1)/N * S, to the next rank in
    messages of the ring's chunk size over one grpcio call, while it receives as many
    from the previous rank. No reduction, no negotiation, no step synchronization, no
    framing or authentication of hostreduce's; glibc's malloc is tuned as the ring
    tunes it. A hostreduce ring (gRPC) serves only for the barrier and the agreement
    on repetitions. Its addresses: ``BENCH_FLOOR_ADDRESSES``."""

    def __init__(self) -> None:
        import queue
        from concurrent import futures

        import grpc
        import numpy as np
        from hostreduce.config import Config
        from hostreduce.transport.malloc import tune_malloc

        self._np = np
        self._ring = Ring("grpc")
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

    def prepare(self, nelem: int) -> Cell:
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

        return Cell(run, buf.fill, lambda: buf, check=lambda: got[0] == total)

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


class Mpi:
    """Open MPI through mpi4py (under mpirun): ``Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)``,
    or ``Reduce_scatter_block``."""

    def __init__(self, collective: str = "allreduce") -> None:
        import numpy as np
        from mpi4py import MPI

        self._np, self._mpi = np, MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self._collective = collective

    def prepare(self, nelem: int) -> Cell:
        np, MPI, comm = self._np, self._mpi, self.comm
        buf = np.empty(nelem, dtype=np.float32)
        buf.fill(0.0)
        if self._collective == "reduce_scatter":
            mine = np.empty(nelem // self.size, dtype=np.float32)
            mine.fill(0.0)

            def scatter() -> None:
                comm.Reduce_scatter_block(buf, mine, op=MPI.SUM)

            return Cell(scatter, buf.fill, lambda: mine, _check_scatter(np, [mine], self.size, nelem))

        def run() -> None:
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

        return Cell(run, buf.fill, lambda: buf)

    def max_over_ranks(self, value: float) -> float:
        return float(self.comm.allreduce(value, op=self._mpi.MAX))

    def barrier(self) -> None:
        self.comm.Barrier()

    def close(self) -> None:
        pass


class TfRing:
    """TensorFlow's own collective ring: MultiWorkerMirroredStrategy(RING) over gRPC,
    the all-reduce traced in a ``tf.function`` over a variable prepared beforehand."""

    def __init__(self) -> None:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import numpy as np
        import tensorflow as tf

        from benchmarks.impls.training import tf_ring_strategy

        self._np, self._tf = np, tf
        self.strategy = tf_ring_strategy()
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

    def prepare(self, nelem: int) -> Cell:
        np, tf = self._np, self._tf
        var = tf.Variable(np.zeros(nelem, np.float32))
        step = self._make_allreduce(var)
        last: list[Any] = [None]

        def run() -> None:
            last[0] = None  # release the previous result before producing the next
            last[0] = step()

        def fill(value: float) -> None:
            var.assign(tf.fill([nelem], tf.constant(value, tf.float32)))

        return Cell(run, fill, lambda: last[0].numpy())

    def max_over_ranks(self, value: float) -> float:
        onehot = self._np.zeros(self.size, self._np.float32)
        onehot[self.rank] = value
        self._agree_var.assign(onehot)
        return float(self._np.max(self._agree().numpy()))

    def barrier(self) -> None:
        self._agree()

    def close(self) -> None:
        pass


def open_collective(kind: str, transport: str = "grpc", collective: str = "allreduce") -> Any:
    """The collective of one peer: ``ring`` (with ``transport``), ``mpi``, ``tf`` or ``floor``."""
    if kind == "ring":
        return Ring(transport, collective)
    if kind == "mpi":
        return Mpi(collective)
    if kind == "floor":
        return GrpcFloor()
    if kind == "tf":
        return TfRing()
    raise ValueError(f"`kind` must be one of ring, mpi, tf, floor. Received: kind={kind!r}")
