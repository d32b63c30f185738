#!/usr/bin/env python
"""The overlap of a device-like backward pass with the reduction, on hostreduce's host
layers alone: for machines with many cores and no TensorFlow.

    python benchmarks/overlap_engine.py                 # resnet50 + bert_base, 1 and 10 Gbit/s, N = 2, 4 (root)
    python benchmarks/overlap_engine.py --quick         # smoke run: resnet50, 1 Gbit/s, N = 2 (< 60 s)
    python benchmarks/overlap_engine.py --profiles resnet50 --networks 10gbit --np 2,4,8

``overlap.py --compute device`` runs the whole step in TensorFlow: the device-like
layers are ops of a traced step, and hostreduce's Estimator hands their gradients off.
This script keeps everything of that step that runs on the host and leaves TensorFlow
out, so that it runs where TensorFlow is not installed (a many-core machine with numpy
and grpcio) and separates what the host's cores allow from what the engines do:

* **the device**: every layer's backward pass ends at the time the profile gives it
  (``benchmarks/profiles``, the same rule as ``overlap.py``), on a timer that holds no
  core; its gradients are ready at that moment, as arrays made once (device memory);
* **the hand-off**: the Estimator's own ``HostCallExchange`` (``hostreduce.streaming``):
  each ready gradient is copied into its host buffer and its all-reduce started at once
  (``streamed``), or copied and started after the backward pass (``sequential``), in
  the exchange's fusion buckets and order;
* **the host apply**: after the backward pass, as the Estimator's per-gradient apply
  does, the host waits for each reduction in submission order and updates that
  tensor's parameters with Adam at once, while later reductions are on the wire. The
  update is numpy (TensorFlow's fused CPU kernel in the real step), split in chunks
  over ``cores / N`` threads per worker.
* **an experiment** (``overlapped``, the ring only; no Estimator mode does this): a host
  thread waits for each reduction as soon as its gradient is handed off and applies it
  beside the rest of the backward pass, instead of after it.

Systems, each in the same cells of the simulated cluster (``netcluster.py``: one
network namespace per worker, links shaped with ``tc``):

| system | reduction | update |
|---|---|---|
| ``ring`` | hostreduce's ring, its default data path between hosts (``tcp``), ``sequential``, ``streamed`` and ``overlapped`` | host, per gradient |
| ``ring-grpc`` | the same ring with its data over the gRPC port (``transport="grpc"``), ``streamed`` | host, per gradient |
| ``mpi`` | hostreduce's MPI engine (mpi4py, under ``mpirun``), ``streamed`` | host, per gradient |
| ``openmpi`` | Open MPI through mpi4py with Horovod's schedule: a background thread takes the ready gradients every 1 ms cycle, fuses up to 64 MiB into one buffer and all-reduces it | on the device (the profile's update time), as Horovod's |

Per row: step (slowest rank's median), compute alone (the device pass with no
reduction), reduction alone (every gradient at once), apply alone, hidden fraction
``(compute + reduction - step) / reduction``, and the host CPU per step and worker.
Horovod itself (and TensorFlow's hand-off ops) need TensorFlow: those rows are
``overlap.py --compute device``'s. Results: ``<out>/overlap.engine.json`` and ``.png``,
and one streamed step of the ring per rank on a time axis
(``overlap.engine.timeline.<profile>-<network>-np<N>.png``; ``-overlapped.png``: the
experiment's).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import netcluster as NC  # noqa: E402
from benchmarks.harness import cli, jobs, peers, placement, report  # noqa: E402
from benchmarks.harness.measure import link_bound_ms  # noqa: E402
from benchmarks.impls.device import compute_ms, layer_times_ms, load_profile, update_ms  # noqa: E402

SYSTEMS: dict[str, tuple[peers.Peer, str, list[str]]] = {
    "ring": (peers.HOSTREDUCE_RING, "hostreduce ring (TCP)", ["sequential", "streamed", "overlapped"]),
    "ring-grpc": (peers.HOSTREDUCE_RING_GRPC, "hostreduce ring (gRPC data path)", ["streamed"]),
    "mpi": (peers.HOSTREDUCE_MPI, "hostreduce MPI engine", ["streamed"]),
    "openmpi": (peers.OPEN_MPI, "Open MPI, Horovod's schedule", ["fused-cycle"]),
}
SCHEDULE_LABELS = {"sequential": "sequential", "streamed": "streamed, apply after the backward pass",
                   "overlapped": "experiment: apply beside the backward pass",
                   "fused-cycle": "1 ms cycles, 64 MiB fusion, update on device"}
DEFAULT = "streamed"  # the Estimator's default schedule (RunConfig(host_apply="per_gradient"))
TARGET_HIDDEN = 0.9   # 1 Gbit/s, wherever compute >= reduction
TARGET_STEP = 1.05    # 10 Gbit/s: step / compute alone
CYCLE_S = 0.001       # Horovod's default cycle time
FUSION_BYTES = 64 * 1024 * 1024  # Horovod's default fusion threshold
ADAM = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-7}
CHUNK = 1 << 20       # elements per chunk of the host update


# =========================================================================== worker: the device


class Device:
    """The profile's backward pass on a timer: ``run(on_ready)`` calls ``on_ready(i)``
    for each gradient tensor ``i`` when its layer's backward pass ends (last layer
    first), sleeping (GIL released) in between. The times are absolute from the start:
    a slow ``on_ready`` does not delay the device, as an accelerator runs on while the
    host copies."""

    def __init__(self, profile: dict, batch: int) -> None:
        import numpy as np

        times = layer_times_ms(profile, batch)
        self.forward_s = sum(f for f, _ in times) / 1e3
        shapes = [tuple(s) for layer in profile["layers"] for s in layer["tensors"]]
        self.shapes = shapes
        owner = [li for li, layer in enumerate(profile["layers"]) for _ in layer["tensors"]]
        self.events: list[tuple[float, list[int]]] = []  # (seconds from start, tensors ready)
        t = self.forward_s
        for li in range(len(profile["layers"]) - 1, -1, -1):
            t += times[li][1] / 1e3
            self.events.append((t, [i for i, o in enumerate(owner) if o == li][::-1]))  # a layer's last tensor first
        self.compute_s = t
        self.grads = [np.full(s, 1e-3, np.float32) for s in shapes]  # the device's gradient memory

    def run(self, on_ready: Callable[[int], None] | None = None) -> float:
        """One forward and backward pass; returns its start (perf_counter)."""
        t0 = time.perf_counter()
        for at, tensors in self.events:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            if on_ready is not None:
                for i in tensors:
                    on_ready(i)
        return t0


# =========================================================================== worker: the host update


class HostAdam:
    """Adam on host-resident parameters, one tensor at a time, in chunks over a thread
    pool (numpy releases the GIL in its loops)."""

    def __init__(self, shapes: list[tuple[int, ...]], threads: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import numpy as np

        self.np = np
        self.params = [np.zeros(s, np.float32).reshape(-1) for s in shapes]
        self.m = [np.zeros_like(p) for p in self.params]
        self.v = [np.zeros_like(p) for p in self.params]
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="host-apply")
        self.step = 0
        self.lr_t = 0.0

    def begin_step(self) -> None:
        self.step += 1
        b1, b2 = ADAM["beta1"], ADAM["beta2"]
        self.lr_t = ADAM["lr"] * math.sqrt(1 - b2 ** self.step) / (1 - b1 ** self.step)

    def apply(self, i: int, grad: Any) -> list[Any]:
        """Start the update of tensor ``i``; returns its futures."""
        g = grad.reshape(-1)
        n = g.size
        return [self.pool.submit(self._chunk, i, g, lo, min(n, lo + CHUNK)) for lo in range(0, n, CHUNK)]

    def _chunk(self, i: int, g: Any, lo: int, hi: int) -> float:
        np = self.np
        b1, b2, eps = ADAM["beta1"], ADAM["beta2"], ADAM["eps"]
        p, m, v, gs = self.params[i][lo:hi], self.m[i][lo:hi], self.v[i][lo:hi], g[lo:hi]
        tmp = np.multiply(gs, 1 - b1)
        m *= b1
        m += tmp
        np.multiply(gs, gs, out=tmp)
        tmp *= 1 - b2
        v *= b2
        v += tmp
        np.sqrt(v, out=tmp)
        tmp += eps
        np.divide(m, tmp, out=tmp)
        tmp *= self.lr_t
        p -= tmp
        return time.perf_counter()


# =========================================================================== worker: the systems


class HostReduceSystem:
    """hostreduce's ring or MPI engine behind the Estimator's hand-off exchange."""

    def __init__(self, kind: str, device: Device, threads: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from hostreduce.cluster import resolve_cluster
        from hostreduce.config import Config
        from hostreduce.reducers import create_reducer
        from hostreduce.streaming import HostCallExchange
        from hostreduce.timeline import Timeline

        config = Config.from_env()
        if kind.startswith("ring"):
            self.reducer = create_reducer("ring", cluster=resolve_cluster(), config=config)
        else:
            self.reducer = create_reducer("mpi", config=config)
        self.rank, self.size = self.reducer.rank, self.reducer.size
        self.device = device
        self.adam = HostAdam(device.shapes, threads)
        specs = [(s, "float32") for s in device.shapes]
        reducer = self.reducer
        self.exchanges = {
            defer: HostCallExchange(f"engine.{'seq' if defer else 'str'}", specs, lambda: reducer,
                                    ordered=not kind.startswith("ring"), timeline=Timeline(None), defer=defer)
            for defer in (False, True)}
        self.host_thread = ThreadPoolExecutor(1, thread_name_prefix="host-program")
        self.engine = type(self.reducer).__name__
        self.transport = getattr(self.reducer, "transport", None)
        self.trace: dict[str, list] = {}

    def barrier(self) -> None:
        self.reducer.barrier()

    def step(self, schedule: str, trace: bool = False) -> None:
        exchange = self.exchanges[schedule == "sequential"]
        slots, grads, defer = exchange.slots, self.device.grads, exchange.defer
        ready, applied = [0.0] * len(slots), [0.0] * len(slots)

        completed = [0.0] * len(slots)

        def watch(i: int) -> None:  # when the reduction itself ends (the host waits later)
            if trace:
                slots[i].handle.add_done_callback(lambda _h, i=i: completed.__setitem__(i, time.perf_counter()))

        reduced = [0.0] * len(slots)
        pending: list[tuple[int, list[Any]]] = []
        handed = [threading.Event() for _ in slots] if schedule == "overlapped" else None

        def on_ready(i: int) -> None:
            ready[i] = time.perf_counter()
            if defer:
                slots[i].stage(grads[i])
            else:
                slots[i].hand_off(grads[i])
                watch(i)
                if handed is not None:
                    handed[i].set()

        def wait_and_apply(wait: Callable[[int], Any]) -> None:
            self.adam.begin_step()
            for i in range(len(slots) - 1, -1, -1):  # submission order: the last tensor's first
                buf = wait(i)
                reduced[i] = time.perf_counter()
                pending.append((i, self.adam.apply(i, buf)))

        def wait_beside(i: int) -> Any:
            assert handed is not None
            if not handed[i].wait(120.0):
                raise TimeoutError(f"gradient {i} was not handed off within 120 s")
            return slots[i].wait(120.0)

        # The experiment: a host thread waits and applies beside the device's backward pass.
        host = self.host_thread.submit(wait_and_apply, wait_beside) if handed is not None else None
        t0 = self.device.run(on_ready)
        backward_end = time.perf_counter()
        exchange.start_deferred()
        if defer:
            for i in range(len(slots)):
                watch(i)
        if host is not None:
            host.result()
        else:
            wait_and_apply(lambda i: slots[i].wait(120.0))
        for i, futures in pending:
            applied[i] = max(f.result() for f in futures)
        if trace:
            rel = lambda ts: [round((t - t0) * 1e3, 3) for t in ts]  # noqa: E731
            self.trace[schedule] = {"ready_ms": rel(ready), "completed_ms": rel(completed), "reduced_ms": rel(reduced),
                                    "applied_ms": rel(applied),
                                    "backward_end_ms": round((backward_end - t0) * 1e3, 3),
                                    "submitted_ms": [round(s / 1e3 - t0 * 1e3, 3) for s in exchange.submit_times_us]}

    def reduce_alone(self) -> None:
        slots, grads = self.exchanges[False].slots, self.device.grads
        for i in range(len(slots) - 1, -1, -1):
            slots[i].hand_off(grads[i])
        for i in range(len(slots) - 1, -1, -1):
            slots[i].wait(120.0)

    def apply_alone(self) -> None:
        self.adam.begin_step()
        pending = [self.adam.apply(i, g) for i, g in enumerate(self.device.grads)]
        for futures in pending:
            for f in futures:
                f.result()

    def close(self) -> None:
        self.reducer.barrier()
        self.adam.pool.shutdown()
        self.host_thread.shutdown()
        self.reducer.close()


class HorovodSchedule:
    """Open MPI (mpi4py) with Horovod's schedule: a background thread runs cycles of
    1 ms; in each, the ranks agree on which gradients are ready on all of them (one
    all-reduce of a readiness vector, as Horovod's response cache does), fuse those, in
    one order on every rank, into buffers of up to 64 MiB and all-reduce them. The
    optimizer's update then runs on the device (the profile's time)."""

    def __init__(self, device: Device, profile: dict) -> None:
        import numpy as np
        from mpi4py import MPI

        self.np, self.MPI = np, MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.device = device
        self.update_s = update_ms(profile) / 1e3
        self.outs = [np.zeros(g.size, np.float32) for g in device.grads]
        self.order = [i for _, tensors in device.events for i in tensors]  # the device's order, equal on every rank
        self.fusion = np.zeros(FUSION_BYTES // 4, np.float32)
        self.engine, self.transport = f"Open MPI {MPI.Get_library_version().splitlines()[0].strip()}", "mpi"
        self.trace: dict[str, list] = {}
        self._total = len(device.grads)
        self._ready = np.zeros(self._total, np.int32)
        self._cond = threading.Condition()
        self._active = self._finished = self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="cycle", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._active and not self._stop:
                        self._cond.wait(1.0)
                    if self._stop:
                        return
                self._one_step()
                with self._cond:
                    self._active, self._finished = False, True
                    self._cond.notify_all()
        except BaseException as exc:  # reported by the waiting step
            with self._cond:
                self._error, self._finished = exc, True
                self._cond.notify_all()

    def _one_step(self) -> None:
        np, MPI = self.np, self.MPI
        done = np.zeros(self._total, bool)
        agreed = np.zeros(self._total, np.int32)
        while not done.all():
            time.sleep(CYCLE_S)
            with self._cond:
                local = self._ready.copy()
            self.comm.Allreduce(local, agreed, op=MPI.MIN)
            ready = [i for i in self.order if agreed[i] and not done[i]]
            while ready:
                batch, nbytes = [], 0
                while ready and (not batch or nbytes + self.outs[ready[0]].nbytes <= FUSION_BYTES):
                    i = ready.pop(0)
                    batch.append(i)
                    nbytes += self.outs[i].nbytes
                if len(batch) == 1 and self.outs[batch[0]].nbytes > FUSION_BYTES:
                    buf = self.outs[batch[0]]
                    self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
                    buf /= self.size
                else:
                    off = 0
                    for i in batch:
                        n = self.outs[i].size
                        self.fusion[off:off + n] = self.outs[i]
                        off += n
                    self.comm.Allreduce(MPI.IN_PLACE, self.fusion[:off], op=MPI.SUM)
                    off = 0
                    for i in batch:
                        n = self.outs[i].size
                        np.multiply(self.fusion[off:off + n], 1.0 / self.size, out=self.outs[i])
                        off += n
                done[batch] = True

    def _start(self) -> None:
        with self._cond:
            self._ready[:] = 0
            self._active, self._finished = True, False
            self._cond.notify_all()

    def _submit(self, i: int) -> None:
        self.np.copyto(self.outs[i], self.device.grads[i].reshape(-1))  # the device's copy to host memory
        with self._cond:
            self._ready[i] = 1

    def _wait_all(self) -> None:
        deadline = time.monotonic() + 120.0
        with self._cond:
            while not self._finished:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the all-reduces did not finish in 120 s")
                self._cond.wait(left)
            if self._error is not None:
                raise self._error

    def barrier(self) -> None:
        self.comm.Barrier()

    def step(self, schedule: str, trace: bool = False) -> None:
        self._start()
        self.device.run(self._submit)
        self._wait_all()
        time.sleep(self.update_s)

    def reduce_alone(self) -> None:
        self._start()
        for i in range(self._total):
            self._submit(i)
        self._wait_all()

    def apply_alone(self) -> None:
        time.sleep(self.update_s)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(5)
        self.comm.Barrier()


def _measure(plan: dict, workdir: Path) -> None:
    profile = load_profile(plan["profile"])
    device = Device(profile, plan["batch"])
    system = plan["system"]
    if system == "openmpi":
        sysm: Any = HorovodSchedule(device, profile)
    else:
        sysm = HostReduceSystem(system, device, plan["apply_threads"])
    rank = sysm.rank
    out = open(workdir / f"rank{rank}.jsonl", "a")
    out.write(json.dumps({"kind": "hello", "rank": rank, "size": sysm.size, "engine": sysm.engine,
                          "transport": sysm.transport}) + "\n")
    out.flush()

    def timed(fn: Callable[[], Any], reps: int) -> tuple[list[float], list[float]]:
        walls, cpus = [], []
        for _ in range(reps):
            sysm.barrier()
            t, c = time.perf_counter(), time.process_time()
            fn()
            walls.append(round((time.perf_counter() - t) * 1e3, 3))
            cpus.append(round((time.process_time() - c) * 1e3, 3))
        return walls, cpus

    schedules = plan["schedules"]
    for s in schedules:  # warm-up: buffers, connections, fusion layout
        for _ in range(plan["warmup_steps"]):
            sysm.barrier()
            sysm.step(s)
    steps: dict[str, tuple[list[float], list[float]]] = {s: ([], []) for s in schedules}
    for rnd in range(plan["rounds"]):
        for s in (schedules if rnd % 2 == 0 else schedules[::-1]):
            w, c = timed(lambda s=s: sysm.step(s), plan["steps_per_round"])
            steps[s][0].extend(w)
            steps[s][1].extend(c)
    for s in schedules:  # one more step per schedule, traced for the timeline picture
        sysm.barrier()
        sysm.step(s, trace=True)
    sysm.reduce_alone()
    red, red_cpu = timed(sysm.reduce_alone, plan["reduce_reps"])
    comp, _ = timed(device.run, plan["reduce_reps"])
    app, app_cpu = timed(sysm.apply_alone, plan["reduce_reps"])
    for s in schedules:
        out.write(json.dumps({"kind": "mode", "rank": rank, "mode": s, "step_ms": steps[s][0],
                              "cpu_ms": steps[s][1], "trace": sysm.trace.get(s)}) + "\n")
    out.write(json.dumps({"kind": "alone", "rank": rank, "bytes": int(sum(g.nbytes for g in device.grads)),
                          "tensors": len(device.grads), "reduce_ms": red, "reduce_cpu_ms": red_cpu,
                          "compute_ms": comp, "compute_nominal_ms": round(device.compute_s * 1e3, 3),
                          "apply_ms": app, "apply_cpu_ms": app_cpu}) + "\n")
    out.close()
    sysm.close()


# =========================================================================== coordinator


def _rows(profile: str, batch: int, network: str, n: int, system: str, rate_bps: float | None,
          records: list[dict]) -> list[dict]:
    by_kind: dict[str, dict[int, list[dict]]] = {}
    for rec in records:
        by_kind.setdefault(rec.get("kind", ""), {}).setdefault(rec["rank"], []).append(rec)
    alone = {r: recs[0] for r, recs in by_kind.get("alone", {}).items()}
    if len(alone) != n:
        return []
    reps = min(len(a["reduce_ms"]) for a in alone.values())
    reduction = statistics.median(max(alone[r]["reduce_ms"][i] for r in alone) for i in range(reps))
    compute = max(statistics.median(a["compute_ms"]) for a in alone.values())
    apply_ms = max(statistics.median(a["apply_ms"]) for a in alone.values())
    first = next(iter(alone.values()))
    hello = next(iter(by_kind.get("hello", {}).values()), [{}])[0]
    modes: dict[str, dict[int, dict]] = {}
    for r, recs in by_kind.get("mode", {}).items():
        for rec in recs:
            modes.setdefault(rec["mode"], {})[r] = rec
    rows = []
    for mode, per_rank in modes.items():
        if len(per_rank) != n:
            continue
        step = max(statistics.median(rec["step_ms"]) for rec in per_rank.values())
        row = {"profile": profile, "network": network, "np": n, "system": system, "schedule": mode,
               "label": f"{SYSTEMS[system][1]}: {SCHEDULE_LABELS[mode]}", "engine": hello.get("engine"),
               "transport": hello.get("transport"), "link_rate_bps": rate_bps,
               "step_ms": round(step, 3), "compute_ms": round(compute, 3),
               "compute_nominal_ms": first["compute_nominal_ms"], "reduction_ms": round(reduction, 3),
               "apply_alone_ms": round(apply_ms, 3),
               "reduction_cpu_ms": round(statistics.mean(statistics.median(a["reduce_cpu_ms"]) for a in alone.values()), 3),
               "apply_cpu_ms": round(statistics.mean(statistics.median(a["apply_cpu_ms"]) for a in alone.values()), 3),
               "gradient_bytes": first["bytes"], "gradient_tensors": first["tensors"],
               "hidden_fraction": round((compute + reduction - step) / reduction, 4),
               "step_over_compute": round(step / compute, 4),
               "cpu_ms_per_step": round(statistics.mean(statistics.median(rec["cpu_ms"]) for rec in per_rank.values()), 3),
               "rank_step_ms": {str(k): v["step_ms"] for k, v in sorted(per_rank.items())},
               "trace": {str(k): v.get("trace") for k, v in sorted(per_rank.items()) if v.get("trace")}}
        if rate_bps:
            row["reduction_link_bound_ms"] = round(link_bound_ms(n, row["gradient_bytes"], rate_bps), 3)
        rows.append(_finish_row(row, batch))
    return rows


def _finish_row(row: dict, batch: int) -> dict:
    """The fields derived from the profile at ``batch``: the case's name, the backward
    pass's time, what can hide at most, and the row's bound in words."""
    profile = load_profile(row["profile"])
    forward = sum(f for f, _ in layer_times_ms(profile, batch))
    backward = compute_ms(profile, batch) - forward
    row["batch"] = batch
    row["case"] = profile["stem"] if batch == profile["batch"] else f"{profile['stem']}, batch {batch}"
    row["backward_nominal_ms"] = round(backward, 3)
    red = row["reduction_ms"]
    # No gradient exists before the backward pass begins, so a reduction can overlap
    # the backward pass only: at most backward / reduction of it can hide.
    row["hideable"] = round(min(1.0, backward / red), 4)
    row["hideable_compute"] = round(min(1.0, row["compute_ms"] / red), 4)
    row["bound"] = _bound(row)
    return row


def _bound(row: dict) -> str:
    """What bounds a row's step, in words."""
    compute, red, step = row["compute_ms"], row["reduction_ms"], row["step_ms"]
    link = row.get("reduction_link_bound_ms")
    if row["schedule"] == "sequential":
        return "no overlap by construction: compute, then the reduction, then the apply"
    what = (f"the link ({link:.0f} ms for the bytes alone)" if link and link >= 0.75 * red
            else f"the engine ({row['reduction_cpu_ms']:.0f} ms of CPU per worker{f'; link {link:.0f} ms' if link else ''})")
    backward = row["backward_nominal_ms"]
    if backward < red:
        return (f"backward pass ({backward:.0f} ms) < reduction ({red:.0f} ms): at most {row['hideable']:.2f} of "
                f"the reduction can hide; the reduction is bound by {what}")
    tail = step - compute
    if tail <= 0.05 * compute:
        return "compute: the reduction and the update are hidden"
    return (f"{tail:.0f} ms after the compute: the last gradients' reduction and the update "
            f"(update alone {row['apply_alone_ms']:.0f} ms)")


def _targets(rows: list[dict]) -> list[dict]:
    checks = []
    for prof, net, n in sorted({(r["case"], r["network"], r["np"]) for r in rows}):
        cell = {(r["system"], r["schedule"]): r for r in rows if (r["case"], r["network"], r["np"]) == (prof, net, n)}
        ring, peer = cell.get(("ring", DEFAULT)), cell.get(("openmpi", "fused-cycle"))
        if ring is None:
            continue
        where = f"{prof} {net} N={n}"
        if ring["compute_ms"] >= ring["reduction_ms"]:
            checks.append({"what": f"{where}: ring {ring['schedule']} hidden fraction (compute >= reduction; the backward "
                                   f"pass allows {ring['hideable']})",
                           "value": ring["hidden_fraction"], "goal": f">= {TARGET_HIDDEN}",
                           "met": ring["hidden_fraction"] >= TARGET_HIDDEN})
        if peer is not None:
            checks.append({"what": f"{where}: ring {ring['schedule']} hidden fraction vs Open MPI with Horovod's schedule "
                                   f"({peer['hidden_fraction']})",
                           "value": ring["hidden_fraction"], "goal": f">= {peer['hidden_fraction']}",
                           "met": ring["hidden_fraction"] >= peer["hidden_fraction"]})
        if net == "10gbit":
            checks.append({"what": f"{where}: ring {ring['schedule']} step / compute alone", "value": ring["step_over_compute"],
                           "goal": f"<= {TARGET_STEP}", "met": ring["step_over_compute"] <= TARGET_STEP})
    return checks


def _print_table(rows: list[dict]) -> None:
    print("\nstep = slowest rank's median (ms); compute = the device pass alone; reduction = every gradient at once;"
          "\nhidden = (compute + reduction - step) / reduction; cpu = host CPU per step and worker")
    head = (f"{'model':>23} {'network':>8} {'N':>2} | {'system: schedule':<62} | {'step':>7} {'compute':>7} "
            f"{'reduce':>7} {'update':>6} | {'hidden':>6} {'hideable':>8} {'step/comp':>9} | {'cpu':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['case']:>23} {r['network']:>8} {r['np']:>2} | {r['label']:<62} | {r['step_ms']:>7.0f} "
              f"{r['compute_ms']:>7.0f} {r['reduction_ms']:>7.0f} {r['apply_alone_ms']:>6.0f} | "
              f"{r['hidden_fraction']:>6.2f} {r['hideable']:>8.2f} {r['step_over_compute']:>9.3f} | "
              f"{r['cpu_ms_per_step']:>6.0f}")


def _plot(path: Path, rows: list[dict], cores: int) -> None:
    plt = report.pyplot()
    cells = sorted({(r["case"], r["network"]) for r in rows})
    cols = min(3, len(cells))
    nrow = -(-len(cells) // cols)
    fig, axes = plt.subplots(nrow, cols, figsize=(6.0 * cols, 5.0 * nrow), squeeze=False)
    for ax in axes.flat[len(cells):]:
        ax.set_visible(False)
    for ax, (prof, net) in zip(axes.flat, cells):
        mine = [r for r in rows if (r["case"], r["network"]) == (prof, net)]
        nps = sorted({r["np"] for r in mine})
        series = sorted({(r["system"], r["schedule"]) for r in mine}, key=lambda k: (list(SYSTEMS).index(k[0]), k[1]))
        width = 0.8 / (len(series) + 1)
        for j, key in enumerate(series):
            got = [next((r for r in mine if r["np"] == n and (r["system"], r["schedule"]) == key), None) for n in nps]
            bars = ax.bar([i + j * width for i in range(len(nps))], [r["step_ms"] if r else float("nan") for r in got],
                          width, label=f"{SYSTEMS[key[0]][1]}: {SCHEDULE_LABELS[key[1]]}")
            for b, r in zip(bars, got):
                if r is not None and key[1] != "sequential":
                    ax.annotate(f"{r['hidden_fraction']:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                                ha="center", va="bottom", fontsize=7)
        for i, n in enumerate(nps):
            ring = next((r for r in mine if r["np"] == n and r["system"] == "ring"), None)
            if ring is not None:
                ax.hlines(ring["compute_ms"], i - 0.1, i + 0.7, colors="black", linestyles="--",
                          label="compute alone" if i == 0 else None)
                ax.hlines(ring["reduction_ms"], i - 0.1, i + 0.7, colors="black", linestyles=":",
                          label="reduction alone (ring)" if i == 0 else None)
        ax.set_xticks([i + 0.4 - width for i in range(len(nps))])
        ax.set_xticklabels([f"N = {n}" for n in nps])
        ax.set_title(f"{prof}, {NC.parse_rate(net) / 1e9:g} Gbit/s" if net != "loopback" else f"{prof}, loopback")
        ax.set_ylabel("ms per step (numbers: hidden fraction)")
        ax.grid(True, axis="y", alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(f"Device-like compute on the host layers alone ({cores} cores): step per system "
                 "against compute and reduction alone (lower is better)")
    report.save_figure(fig, path, rect=(0, 0.06 / nrow, 1, 0.97))


def _plot_timeline(path: Path, row: dict) -> None:
    """The traced streamed step of the ring: per rank, each gradient's ready -> reduced
    -> updated times."""
    plt = report.pyplot()
    traces = row["trace"]
    fig, axes = plt.subplots(len(traces), 1, figsize=(11, 1.6 + 1.4 * len(traces)), squeeze=False, sharex=True)
    for ax, (rank, tr) in zip(axes[:, 0], sorted(traces.items(), key=lambda kv: int(kv[0]))):
        order = sorted(range(len(tr["ready_ms"])), key=lambda i: tr["ready_ms"][i])
        for y, i in enumerate(order):
            ax.plot([tr["ready_ms"][i], tr["reduced_ms"][i]], [y, y], color="tab:blue", lw=1)
            ax.plot([tr["reduced_ms"][i], tr["applied_ms"][i]], [y, y], color="tab:orange", lw=1)
            if "completed_ms" in tr:
                ax.plot([tr["completed_ms"][i]], [y], marker="|", color="black", ms=3)
        ax.axvline(row["compute_ms"], color="black", ls="--", lw=1)
        ax.axvline(tr["backward_end_ms"], color="grey", ls=":", lw=1)
        ax.set_ylabel(f"rank {rank}\ngradients")
    when = "beside the backward pass" if row["schedule"] == "overlapped" else "after the backward pass"
    axes[-1, 0].set_xlabel("ms from the step's start. Blue: gradient ready -> its wait returned (the host waits "
                           f"{when},\nin submission order); orange: -> updated; black ticks (where "
                           "recorded): the reduction's end; dashed: compute alone; dotted: backward end", fontsize=8)
    fig.suptitle(f"{row['case']}, {row['network']}, N = {row['np']}: one step of the ring, {SCHEDULE_LABELS[row['schedule']]} "
                 f"(step {row['step_ms']:.0f} ms, hidden {row['hidden_fraction']:.2f})")
    report.save_figure(fig, path)


def _slug(row: dict) -> str:
    return row["case"].replace(", batch ", "-b")


def _close(rep: report.Report, rows: list[dict], no_plot: bool, measured_here: bool = True) -> None:
    """Targets, tables and pictures of ``rows``; writes the JSON."""
    rep.result["measurements"] = rows
    rep.result["targets"] = _targets(rows)

    def plot(path: Path) -> None:
        _plot(path, rows, rep.result["environment"].get("cpu_count") or report.cores())
        for r in rows:
            if r["system"] == "ring" and r["schedule"] in (DEFAULT, "overlapped") and r["trace"]:
                suffix = "" if r["schedule"] == DEFAULT else f"-{r['schedule']}"
                _plot_timeline(rep.out_dir / f"overlap.engine.timeline.{_slug(r)}-{r['network']}-np{r['np']}{suffix}.png", r)

    def show() -> None:
        _print_table(rows)
        report.print_targets(rep.result["targets"])

    rep.close(plot=plot if rows else None, no_plot=no_plot, show=show, measured_here=measured_here)


def _merge(paths: list[str], out: str, no_plot: bool) -> int:
    """One result of several runs' JSON files (a machine lent for a limited time runs
    the cells in parts): their rows, a later file's row replacing an earlier one of the
    same case, network, N, system and schedule (each row names its part); each part's
    command, date and loads are kept under ``environment.parts``."""
    parts = [json.loads(Path(pth).read_text()) for pth in paths]
    rows: dict[tuple, dict] = {}
    runs: dict = {}
    for pth, part in zip(paths, parts):
        batches = {name: info["batch"] for name, info in part["settings"]["profiles"].items()}
        for row in part["measurements"]:
            row = _finish_row(dict(row), row.get("batch") or batches[row["profile"]])
            row["label"] = f"{SYSTEMS[row['system']][1]}: {SCHEDULE_LABELS[row['schedule']]}"
            row["part"] = str(pth)  # which run measured it (environment.parts)
            rows[(row["case"], row["network"], row["np"], row["system"], row["schedule"])] = row
        for prof, by_net in part["runs"].items():
            stem = load_profile(prof)["stem"]
            case = stem if batches[prof] == load_profile(prof)["batch"] else f"{stem}, batch {batches[prof]}"
            for net, by_n in by_net.items():
                for n, by_sys in by_n.items():
                    runs.setdefault(case, {}).setdefault(net, {}).setdefault(n, {}).update(by_sys)
    first = parts[0]
    rep = report.Report(out, "overlap.engine", first["benchmark"], first["description"],
                        settings={**first["settings"], "profiles": {f"{k}@{v['batch']}": v for part in parts
                                                                   for k, v in part["settings"]["profiles"].items()},
                                  "cells": [c for part in parts for c in part["settings"]["cells"]]},
                        runs=runs, measurements=[], targets=[])
    env = dict(first["environment"])
    env["parts"] = [{"file": str(pth), "command_line": part["environment"].get("command_line"),
                     "date": part["environment"].get("date"), "wall_s": part["environment"].get("wall_s"),
                     "loadavg_at_start": part["environment"].get("loadavg_at_start"),
                     "loadavg_at_end": part["environment"].get("loadavg_at_end"),
                     "hostname": part["environment"].get("hostname"), "cpu_count": part["environment"].get("cpu_count")}
                    for pth, part in zip(paths, parts)]
    env["merged_at"] = rep.result["environment"]["date"]
    for key in ("wall_s", "loadavg_at_start", "loadavg_at_end"):  # each part's are under "parts"
        env.pop(key, None)
    rep.result["environment"] = env
    order = {s: i for i, s in enumerate(SYSTEMS)}
    _close(rep, sorted(rows.values(), key=lambda r: (r["case"], r["network"], r["np"], order[r["system"]],
                                                     r["schedule"])), no_plot, measured_here=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profiles", default=None, help="comma-separated (default resnet50,bert_base; --quick: resnet50)")
    p.add_argument("--np", default=None, help="comma-separated world sizes (default 2,4; --quick: 2)")
    p.add_argument("--networks", default=None, help="link rates (default 1gbit,10gbit; --quick: 1gbit)")
    p.add_argument("--systems", default=None, help=f"comma-separated of {list(SYSTEMS)} (default all)")
    p.add_argument("--batch", type=int, default=None, help="examples per worker (default: the profile's)")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds of the schedules (default 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per schedule and round (default 3)")
    p.add_argument("--cells", default=None,
                   help="instead of the product of the above: semicolon-separated PROFILE:NETWORK:N, e.g. "
                        "'resnet50:1gbit:2;bert_base:10gbit:4'")
    p.add_argument("--quick", action="store_true", help="smoke run (< 60 s)")
    p.add_argument("--merge", default=None, metavar="JSON,JSON,...",
                   help="write one result of these runs' overlap.engine.json files (no run)")
    p.add_argument("--job-timeout", type=float, default=600.0, help="wall-clock limit of one job (s)")
    cli.add_run_options(p)
    args = p.parse_args(argv)
    if args.worker:
        return jobs.run_worker(args, _measure)
    if args.merge:
        return _merge(args.merge.split(","), args.out, args.no_plot)

    systems = cli.parse_choices(p, "--systems", args.systems or ",".join(SYSTEMS), list(SYSTEMS))
    if args.cells:
        cells = []
        for part in args.cells.split(";"):
            try:
                prof, net, n = part.split(":")
                cells.append((prof, net, int(n)))
            except ValueError:
                p.error(f"--cells must be PROFILE:NETWORK:N;... Received: {part!r}")
    else:
        profiles = (args.profiles or ("resnet50" if args.quick else "resnet50,bert_base")).split(",")
        nps = cli.parse_np(p, args.np, [2] if args.quick else [2, 4])
        nets = cli.parse_networks(p, args.networks, ["1gbit"] if args.quick else ["1gbit", "10gbit"])
        cells = [(pr, net, n) for pr in profiles for net in nets for n in nps]
    for pr in sorted({c[0] for c in cells}):
        try:
            load_profile(pr)
        except ValueError as exc:
            p.error(str(exc))
    networks, usable, why = placement.usable_networks(sorted({c[1] for c in cells}))
    cells = [c for c in cells if c[1] in networks]
    quiet = report.wait_for_quiet(args.max_load, args.max_wait_s)
    cores = report.cores()
    plan = {"warmup_steps": 1, "rounds": args.rounds or (1 if args.quick else 2),
            "steps_per_round": args.steps or (2 if args.quick else 3), "reduce_reps": 3 if args.quick else 4,
            "rate_check_s": 0.3 if args.quick else 1.0, "worker_timeout_s": args.job_timeout + 30.0}
    prof_info = {}
    for pr in sorted({c[0] for c in cells}):
        prof = load_profile(pr)
        batch = args.batch or prof["batch"]
        prof_info[pr] = {"model": prof["model"], "source": prof["source"], "batch": batch,
                         "batch_unit": prof["batch_unit"], "device": prof["device"], "parameters": prof["parameters"],
                         "gradient_tensors": prof["gradient_tensors"], "compute_nominal_ms": round(compute_ms(prof, batch), 3),
                         "device_update_ms": round(update_ms(prof), 3)}
    rep = report.Report(
        args.out, "overlap.engine", "overlap (device-like compute, host layers alone)",
        "Each layer's backward pass ends when the profile says, on a timer that holds no core; its gradients go "
        "through hostreduce's hand-off exchange to the ring (gRPC on the shaped links) or the MPI engine, and the "
        "host updates each tensor (numpy Adam, per gradient) after the backward pass as its reduction ends; Open "
        "MPI with Horovod's cycle and fusion (update on the device) as the peer; no TensorFlow",
        packages=("numpy", "grpcio", "mpi4py"),
        environment_extra={"load_wait": quiet, "namespaces_usable": usable, "namespaces_reason": why,
                           "mpirun": {"mpi": placement.mpirun_version("mpi")}},
        settings={"cells": [list(c) for c in cells], "systems": systems, "plan": plan, "profiles": prof_info,
                  "apply_threads": {str(n): max(1, cores // n) for n in sorted({c[2] for c in cells})},
                  "horovod_schedule": {"cycle_ms": CYCLE_S * 1e3, "fusion_bytes": FUSION_BYTES},
                  "adam": ADAM,
                  "definitions": {
                      "step_ms": "slowest rank's median of timed steps",
                      "compute_ms": "slowest rank's median of the device pass alone (the timer; no reduction)",
                      "reduction_ms": "median over repetitions of the slowest rank's all-reduce of every gradient at "
                                      "once, no compute",
                      "apply_alone_ms": "the host update of every tensor alone (Open MPI row: the device's update "
                                        "time)",
                      "hidden_fraction": "(compute + reduction - step) / reduction",
                      "hideable": "min(1, backward / reduction): no gradient exists before the backward pass, so "
                                  "at most this much of the reduction can hide",
                      "hideable_compute": "min(1, compute / reduction)",
                      "cpu_ms_per_step": "host CPU per step of one worker (all threads), mean over workers"},
                  "targets": {"hidden_fraction": f">= {TARGET_HIDDEN} where compute >= reduction, and >= the peer's",
                              "step_over_compute_10gbit": f"<= {TARGET_STEP}"}},
        runs={}, measurements=[], targets=[])
    result = rep.result
    rep.announce(f"overlap benchmark, host layers alone: cells={cells} systems={systems} cores={cores}")
    rows: list[dict] = []
    with jobs.workroot("hostreduce-bench-overlap-engine-", args.keep_workdir) as workroot:
        for net in networks:
            for n in sorted({c[2] for c in cells if c[1] == net}):
                profs = [c[0] for c in cells if c[1:] == (net, n)]
                with placement.network(net, n) as where:
                    tcp = where.measure_rate(plan["rate_check_s"])
                    for pr in profs:
                        for system in systems:
                            peer, _, schedules = SYSTEMS[system]
                            plan_c = {**plan, "profile": pr, "batch": prof_info[pr]["batch"], "system": system,
                                      "schedules": schedules, "apply_threads": max(1, cores // n)}
                            tag = f"{pr}-{net}-np{n}-{system}"
                            plan_path = jobs.write_plan(workroot / f"plan-{tag}.json", plan_c)
                            workdir = workroot / tag
                            argv = lambda rank, _wd=workdir, _pp=plan_path: jobs.worker_argv(  # noqa: E731
                                __file__, plan=_pp, workdir=_wd, rank=rank)
                            run = peers.run(peer, where, n, argv, workdir, args.job_timeout,
                                            info={"tcp_check": tcp} if tcp else None)
                            got = (_rows(pr, prof_info[pr]["batch"], net, n, system, where.rate_bps, run.records())
                                   if run.ok else [])
                            if run.ok and not got:
                                run.fail("workers exited without writing every record")
                            result["runs"].setdefault(pr, {}).setdefault(net, {}).setdefault(str(n), {})[system] = run.info
                            run.say(f"{pr} {net:>7} N={n} {system:>8}", f"{run.seconds:.1f} s",
                                    f"load {run.info['loadavg_after'][0]}")
                            rows += got
                            result["measurements"] = rows
                            rep.save()
    _close(rep, rows, args.no_plot)
    return report.exit_status(result["runs"])


if __name__ == "__main__":
    sys.exit(main())
