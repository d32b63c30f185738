#!/usr/bin/env python
"""How much of the gradient all-reduce hostreduce hides behind the backward pass.

    python benchmarks/overlap.py                    # N = 2, 4; loopback, 1 and 10 Gbit/s links (~7 min)
    python benchmarks/overlap.py --quick            # smoke run: N = 2, loopback + 1 Gbit/s, small batch (< 90 s)
    python benchmarks/overlap.py --np 4 --networks 1gbit --max-load 2.5

One model (an MLP of 9 dense layers, 4.5M parameters, 17.3 MiB of float32 gradients in
18 tensors), the same synthetic data and global batch, trained by the Estimator with
hostreduce's ring in three schedules, in the same worker processes, alternating:

* sequential: ``RunConfig(stream_gradients=False, host_apply="once")``: the whole
  backward pass, then the all-reduce of every gradient at once (fused by the ring),
  then the host apply;
* apply-once: ``RunConfig(host_apply="once")``: each gradient is handed to the reducer
  as the backward pass produces it, so the reductions of the last layers overlap the
  backward pass of the first ones; the host applies every update after the last
  reduction;
* streamed: hostreduce's default: streamed hand-off as in apply-once, and each
  variable's update runs on the host as soon as its own reduction is done
  (``host_apply="per_gradient"``), overlapping the reductions still on the wire.

For each N and network the workers also time the all-reduce of the full gradient set
alone (no compute): ``T_reduction``. With ``T_compute`` = the sequential step minus its
reduction phase (forward + backward + hand-off + apply):

* hidden fraction = (T_sequential - T_streamed) / T_reduction (1: fully hidden);
* T_streamed / max(T_compute, T_reduction) (1: perfect overlap);
* the reduction's CPU time (one worker, all threads, user + system) and the hidden
  fraction it leaves possible when the compute already fills every core:
  1 - cpu * max(1, N / cores) / T_reduction.

Networks: ``loopback`` (all workers on this host, the ring's default data path: shared
memory) and simulated clusters (``netcluster.py``: one network namespace per worker,
links shaped to the rate in both directions; gRPC data path). Every rank writes a
timeline (``RunConfig(timeline_dir=...)``); the script draws one step of each schedule
per rank on a time axis (``overlap.timeline.<network>-np<N>.png``; the 1 Gbit/s one is
also ``overlap.timeline.png``) and the step times against the link rate
(``overlap.png``). Results: ``<out>/overlap.json``.

On a machine with few cores, N workers share them: the ring's host-side work (socket
I/O, summing) competes with the backward pass for CPU, which bounds the overlap; the
JSON records the load average around every run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import netcluster as NC  # noqa: E402
from benchmarks.harness import cli, jobs, peers, placement, report  # noqa: E402
from benchmarks.harness.measure import link_bound_ms, median, numel  # noqa: E402
from benchmarks.impls.device import (build_wait_kernel, compute_ms, device_model, device_model_fn,  # noqa: E402
                                     load_profile, tensor_shapes, update_ms, wait_kernel)
from benchmarks.impls.training import host_adam_model_fn, tf_threads  # noqa: E402

MODES = ("sequential", "apply-once", "streamed")
DEFAULT_NP = [2, 4]
DEFAULT_NETWORKS = ["loopback", "1gbit", "10gbit"]
INPUT_DIM, HIDDEN, LAYERS, CLASSES = 512, 768, 8, 10
TARGET_HIDDEN = 0.8      # at 1 Gbit/s, N = 2 and 4
TARGET_RATIO = 1.15      # T_streamed / max(T_compute, T_reduction)


# =========================================================================== worker


def _model(params: dict) -> Any:
    import keras

    layers = [keras.layers.Dense(params["hidden"], activation="relu", name=f"dense{i}")
              for i in range(params["layers"])]
    return keras.Sequential(layers + [keras.layers.Dense(params["classes"], name="logits")])


_model_fn = host_adam_model_fn(_model, lambda params: 1e-4)


def _input_fn(plan: dict) -> Any:
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    batches = 4
    x = rng.standard_normal((plan["global_batch"] * batches, INPUT_DIM), dtype=np.float32)
    y = rng.integers(0, CLASSES, plan["global_batch"] * batches).astype(np.int32)

    def input_fn(mode: str, input_context: Any = None) -> Any:
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        batch = plan["global_batch"]
        if input_context is not None and input_context.num_input_pipelines > 1:
            ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
            batch = input_context.get_per_replica_batch_size(batch)
        return ds.repeat().batch(batch, drop_remainder=True).prefetch(2)

    return input_fn


def _step_breakdown(path: Path) -> list[dict]:
    """Per step, from one rank's timeline: the durations (ms) of its spans."""
    events = json.loads(path.read_text())["traceEvents"]
    steps: list[dict] = []
    for e in sorted((e for e in events if e.get("ph") == "X" and e.get("tid") == 0), key=lambda e: e["ts"]):
        name = e["name"]
        if name == "forward":
            steps.append({"start_us": e["ts"]})
        if not steps:
            continue
        key = {"forward": "forward_ms", "backward": "backward_ms", "wait for reductions": "reduce_wait_ms",
               "host apply": "apply_ms", "wait and apply (per gradient)": "reduce_wait_ms"}.get(name)
        if key:
            steps[-1][key] = round(e["dur"] / 1e3, 3)
            steps[-1]["end_us"] = e["ts"] + e["dur"]
    return steps


def _reduce_alone(reducer: Any, shapes: list[tuple[int, ...]], reps: int) -> tuple[list[float], list[float]]:
    """Time the all-reduce of the full gradient set, every tensor submitted at once.
    Returns wall seconds and this process's CPU seconds (all threads, user + system)
    of each repetition."""
    import numpy as np

    bufs = [np.ones(s, np.float32) for s in shapes]
    names = [f"overlap.alone/{i}" for i in range(len(bufs))]

    def once() -> tuple[float, float]:
        reducer.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        handles = [reducer.allreduce_async(names[i], bufs[i], op="mean", out=bufs[i])
                   for i in range(len(bufs) - 1, -1, -1)]
        for h in handles:
            h.wait()
        return time.perf_counter() - t0, time.process_time() - c0

    once()  # warm-up: buffers, fusion, connections
    runs = [once() for _ in range(reps)]
    return [w for w, _ in runs], [c for _, c in runs]


def _device_input_fn(mode: str, input_context: Any = None) -> Any:
    """The device-like model's input: one token of activation per step (its layers'
    times are the profile's, whatever the tensor)."""
    import tensorflow as tf

    return tf.data.Dataset.from_tensors((tf.zeros((1, 1)), tf.zeros((1,), tf.int32))).repeat()


def _compute_alone(model: Any, reps: int, update_ms: float = 0.0) -> list[float]:
    """Wall ms of the model's forward and backward pass (and a device-side update of
    ``update_ms``) in a traced step, no reduction."""
    import tensorflow as tf

    x = tf.zeros((1, 1))
    model(x)  # built: its variables exist
    variables = model.trainable_variables
    wait, _ = wait_kernel()

    @tf.function
    def step() -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        return wait([loss, *tape.gradient(loss, variables)], update_ms)[0]

    step()
    out = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        step()
        out.append(round((time.perf_counter() - t0) * 1e3, 3))
    return out[1:]


def _measure(plan: dict, workdir: Path) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    tf_threads(plan)
    if plan.get("system") == "horovod":
        return _measure_horovod(plan, workdir)
    import keras

    from hostreduce.estimator import Estimator, RunConfig
    from hostreduce.strategies import HorovodStrategy, MultiWorkerStrategy

    if plan.get("system") == "mpi":  # under mpirun: the MPI engine
        strategy = HorovodStrategy(variables_on_host=True, reducer="mpi")
    else:
        strategy = MultiWorkerStrategy(variables_on_host=True)
    rank, size = strategy.rank, strategy.size
    device = plan.get("device")
    modes = plan.get("modes", MODES)
    if device:
        profile = load_profile(device["profile"])
        model_fn, params, input_fn = device_model_fn, {"profile": profile, "batch": device["batch"]}, _device_input_fn
        shapes = tensor_shapes(profile)
    else:
        model_fn, params, input_fn = _model_fn, {"hidden": HIDDEN, "layers": LAYERS, "classes": CLASSES}, _input_fn(plan)
        dims = [INPUT_DIM] + [HIDDEN] * LAYERS + [CLASSES]
        shapes = [s for a, b in zip(dims, dims[1:]) for s in ((a, b), (b,))]  # kernel, bias per layer
    estimators = {}
    for mode in modes:
        keras.utils.set_random_seed(1)
        config = RunConfig(train_distribute=strategy, log_step_count_steps=None,
                           timeline_dir=str(workdir / f"timeline-{mode}"),
                           stream_gradients=(mode != "sequential"),
                           host_apply="per_gradient" if mode == "streamed" else "once")
        estimators[mode] = Estimator(model_fn, config=config, params=params)
    out = open(workdir / f"rank{rank}.jsonl", "a")
    out.write(json.dumps({"kind": "hello", "rank": rank, "size": size,
                          "transport": getattr(strategy.reducer, "transport", None),
                          "engine": type(strategy.reducer).__name__,
                          "device_kernel": wait_kernel()[1] if device else None}) + "\n")
    out.flush()

    stamps: list[tuple[float, float]] = []
    hook = lambda _step, _loss: stamps.append((time.perf_counter(), time.process_time()))  # noqa: E731
    step_ms: dict[str, list[float]] = {m: [] for m in modes}
    cpu_ms: dict[str, list[float]] = {m: [] for m in modes}
    timed_index: dict[str, list[int]] = {m: [] for m in modes}
    done: dict[str, int] = {m: 0 for m in modes}
    for mode in modes:  # warm-up: tracing, buffers, connections
        estimators[mode].train(input_fn, steps=plan["warmup_steps"], hooks=[hook])
        done[mode] += plan["warmup_steps"]
    for rnd in range(plan["rounds"]):
        order = modes if rnd % 2 == 0 else modes[::-1]
        for mode in order:
            stamps.clear()
            strategy.reducer.barrier()
            estimators[mode].train(input_fn, steps=plan["steps_per_round"] + 1, hooks=[hook])
            # The first step of a train() call also builds the input iterator: dropped.
            step_ms[mode] += [round((b[0] - a[0]) * 1e3, 3) for a, b in zip(stamps, stamps[1:])]
            cpu_ms[mode] += [round((b[1] - a[1]) * 1e3, 3) for a, b in zip(stamps, stamps[1:])]
            timed_index[mode] += list(range(done[mode] + 1, done[mode] + plan["steps_per_round"] + 1))
            done[mode] += plan["steps_per_round"] + 1
    profile_rec = None
    if plan.get("profile"):
        # One more streamed round (every rank runs it), sampled by py-spy on rank 0.
        spy = None
        raw = workdir / f"pyspy-rank{rank}.txt"
        if rank == 0:
            spy = _start_pyspy(raw)
        strategy.reducer.barrier()
        estimators["streamed"].train(input_fn, steps=plan["steps_per_round"] + 1, hooks=[hook])
        if spy is not None:
            profile_rec = _stop_pyspy(spy, raw)
    alone, alone_cpu = _reduce_alone(strategy.reducer, shapes, plan["reduce_reps"])
    if device:
        compute = _compute_alone(device_model(profile, device["batch"]), plan["reduce_reps"])
        out.write(json.dumps({"kind": "compute", "rank": rank, "compute_ms": compute,
                              "nominal_ms": round(compute_ms(profile, device["batch"]), 3)}) + "\n")
    for mode in modes:
        steps = _step_breakdown(workdir / f"timeline-{mode}" / f"timeline-rank{rank}.json")
        timed = [steps[i] for i in timed_index[mode] if i < len(steps)]
        out.write(json.dumps({"kind": "mode", "rank": rank, "mode": mode, "step_ms": step_ms[mode],
                              "cpu_ms": cpu_ms[mode], "timed_steps": timed_index[mode], "breakdown": timed}) + "\n")
    if profile_rec is not None:
        out.write(json.dumps({"kind": "profile", "rank": rank, **profile_rec}) + "\n")
    out.write(json.dumps({"kind": "alone", "rank": rank, "bytes": int(sum(4 * numel(s) for s in shapes)),
                          "tensors": len(shapes), "reduce_ms": [round(t * 1e3, 3) for t in alone],
                          "reduce_cpu_ms": [round(t * 1e3, 3) for t in alone_cpu]}) + "\n")
    out.close()
    strategy.reducer.barrier()
    strategy.close()


def _measure_horovod(plan: dict, workdir: Path) -> None:
    """Horovod's own streaming: the device-like step traced with its
    ``DistributedGradientTape``, whose all-reduce ops start as their gradients appear;
    the optimizer's update on the device (its time from the profile)."""
    import horovod
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    device = plan["device"]
    profile = load_profile(device["profile"])
    model = device_model(profile, device["batch"])
    x = tf.zeros((1, 1))
    model(x)
    variables = [getattr(v, "value", v) for v in model.trainable_variables]  # Horovod wants tf.Variables
    wait, _ = wait_kernel()

    @tf.function
    def train() -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        tape = hvd.DistributedGradientTape(tape)
        return wait([loss, *tape.gradient(loss, variables)], update_ms(profile))[0]

    shapes = tensor_shapes(profile)
    consts = [tf.constant(np.full(s, 1e-3, np.float32)) for s in shapes]

    @tf.function
    def reduce_all() -> Any:
        return [hvd.allreduce(c, op=hvd.Average, name=f"overlap.alone.{i}") for i, c in enumerate(consts)]

    barrier = lambda: hvd.allreduce(tf.constant(0.0), name="overlap.barrier")  # noqa: E731
    out = open(workdir / f"rank{rank}.jsonl", "a")
    out.write(json.dumps({"kind": "hello", "rank": rank, "size": size, "transport": "mpi",
                          "engine": f"horovod {horovod.__version__}", "device_kernel": wait_kernel()[1]}) + "\n")
    for _ in range(plan["warmup_steps"]):
        train()
    step_ms, cpu_ms = [], []
    for _ in range(plan["rounds"]):
        barrier()
        for _ in range(plan["steps_per_round"]):
            t0, c0 = time.perf_counter(), time.process_time()
            train()
            step_ms.append(round((time.perf_counter() - t0) * 1e3, 3))
            cpu_ms.append(round((time.process_time() - c0) * 1e3, 3))
    reduce_all()
    alone, alone_cpu = [], []
    for _ in range(plan["reduce_reps"]):
        barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        reduce_all()
        alone.append(round((time.perf_counter() - t0) * 1e3, 3))
        alone_cpu.append(round((time.process_time() - c0) * 1e3, 3))
    compute = _compute_alone(model, plan["reduce_reps"], update_ms(profile))
    out.write(json.dumps({"kind": "compute", "rank": rank, "compute_ms": compute,
                          "nominal_ms": round(compute_ms(profile, device["batch"]) + update_ms(profile), 3)}) + "\n")
    out.write(json.dumps({"kind": "mode", "rank": rank, "mode": "horovod", "step_ms": step_ms, "cpu_ms": cpu_ms,
                          "timed_steps": [], "breakdown": []}) + "\n")
    out.write(json.dumps({"kind": "alone", "rank": rank, "bytes": int(sum(4 * numel(s) for s in shapes)),
                          "tensors": len(shapes), "reduce_ms": alone, "reduce_cpu_ms": alone_cpu}) + "\n")
    out.close()
    barrier()


def _start_pyspy(raw: Path) -> Any:
    import subprocess

    spy_bin = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy_bin is None:
        return None
    proc = subprocess.Popen([spy_bin, "record", "--pid", str(os.getpid()), "--rate", "250", "--format", "raw",
                             "--threads", "--nonblocking", "--output", str(raw)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # attached before the round starts
    return proc


def _stop_pyspy(proc: Any, raw: Path) -> dict:
    import signal
    import subprocess

    proc.send_signal(signal.SIGINT)  # py-spy writes its samples on SIGINT
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    try:
        return _profile_summary(raw)
    except OSError as exc:
        return {"error": f"py-spy wrote no samples: {exc}"}


_KINDS = (  # first match along a stack, outermost first
    ("hand-off callback (copy + submit)", ("handoff.py",)),
    ("ring: shared-memory data path", ("ring/shm.py", "ring/_cma.py")),
    ("ring: gRPC data path", ("grpc_mesh.py", "grpc/")),
    ("ring: algorithm, negotiation", ("hostreduce/reducers/ring/",)),
    ("host apply", ("host/apply.py",)),
    ("timeline markers", ("programs.py:mark", "timeline.py")),
)


def _profile_summary(raw: Path) -> dict:
    """Where rank 0's Python threads spent the round, from py-spy's raw samples:
    by activity (the hostreduce module on the stack) and by leaf function."""
    from collections import Counter

    by_kind: Counter = Counter()
    by_leaf: Counter = Counter()
    by_thread: Counter = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        by_thread[frames[0]] += n
        by_leaf[frames[-1]] += n
        kind = "other (TensorFlow step, Python glue)"
        for label, keys in _KINDS:
            if any(k in f for f in frames for k in keys):
                kind = label
                break
        by_kind[kind] += n
    pct = lambda c: [{"what": k, "samples": v, "share": round(v / max(total, 1), 4)} for k, v in c.most_common(15)]  # noqa: E731
    return {"samples": total, "rate_hz": 250, "by_activity": pct(by_kind), "by_leaf_function": pct(by_leaf),
            "by_thread": pct(by_thread), "raw_file_lines": len(raw.read_text().splitlines())}


# =========================================================================== coordinator


def _summarize(network: str, n: int, rate_bps: float | None, records: list[dict]) -> dict | None:
    modes: dict[str, dict[int, dict]] = {m: {} for m in MODES}
    alone: dict[int, dict] = {}
    transport = None
    profile = None
    for rec in records:
        if rec.get("kind") == "mode":
            modes[rec["mode"]][rec["rank"]] = rec
        elif rec.get("kind") == "alone":
            alone[rec["rank"]] = rec
        elif rec.get("kind") == "hello":
            transport = rec.get("transport")
        elif rec.get("kind") == "profile":
            profile = rec
    if len(alone) != n or any(len(modes[m]) != n for m in MODES):
        return None
    row: dict[str, Any] = {"network": network, "np": n, "transport": transport, "link_rate_bps": rate_bps}
    for mode in MODES:
        per_rank = modes[mode]
        # Steps are synchronous across ranks: the slowest rank's median is the step time.
        step = max(statistics.median(r["step_ms"]) for r in per_rank.values())
        parts = {}
        for key in ("forward_ms", "backward_ms", "reduce_wait_ms", "apply_ms"):
            parts[key] = round(statistics.mean(median([s.get(key) for s in r["breakdown"]]) or 0.0
                                               for r in per_rank.values()), 3)
        row[mode] = {"step_ms": round(step, 3), **parts,
                     "rank_step_ms": {str(k): v["step_ms"] for k, v in sorted(per_rank.items())}}
    reps = min(len(a["reduce_ms"]) for a in alone.values())
    slowest = [max(alone[r]["reduce_ms"][i] for r in alone) for i in range(reps)]
    t_red = statistics.median(slowest)
    t_seq, t_str, t_once = row["sequential"]["step_ms"], row["streamed"]["step_ms"], row["apply-once"]["step_ms"]
    t_compute = t_seq - row["sequential"]["reduce_wait_ms"]
    nbytes = next(iter(alone.values()))["bytes"]
    row.update(
        gradient_bytes=nbytes, gradient_tensors=next(iter(alone.values()))["tensors"],
        reduction_ms=round(t_red, 3), reduction_rep_ms=slowest,
        compute_ms=round(t_compute, 3),
        hidden_fraction=round((t_seq - t_str) / t_red, 4),
        streamed_over_bound=round(t_str / max(t_compute, t_red), 4),
        sequential_over_streamed=round(t_seq / t_str, 4),
        apply_once_over_streamed=round(t_once / t_str, 4),
        backward_slowdown_streamed=round(row["streamed"]["backward_ms"] / max(row["sequential"]["backward_ms"], 1e-9), 4),
    )
    cpu = [statistics.median(a.get("reduce_cpu_ms") or [0.0]) for a in alone.values()]
    if all(cpu):
        # On a machine whose cores the compute already fills, the reduction's CPU time is
        # taken from the backward pass: with N workers on C cores each has C/N of a core,
        # so it costs cpu * max(1, N/C) of wall time, and at most the rest can be hidden.
        cores = os.cpu_count() or 1
        t_cpu = statistics.mean(cpu)
        row["reduction_cpu_ms"] = round(t_cpu, 3)
        row["hidden_fraction_cpu_bound"] = round(1.0 - t_cpu * max(1.0, n / cores) / t_red, 4)
    if profile is not None:
        row["pyspy_rank0_streamed"] = profile
    if rate_bps:
        row["reduction_bound_ms"] = round(link_bound_ms(n, nbytes, rate_bps), 3)
    return row


def _run_cell(where: Any, n: int, plan: dict, plan_path: Path, workroot: Path, result: dict,
              timeout_s: float) -> dict | None:
    info: dict[str, Any] = {}
    if where.cluster is not None:
        info["tcp_check"] = where.measure_rate(plan["rate_check_s"])
    workdir = workroot / f"{where.name}-np{n}"
    argv = lambda rank: jobs.worker_argv(__file__, plan=plan_path, workdir=workdir, rank=rank)  # noqa: E731
    run = peers.run(peers.HOSTREDUCE_RING, where, n, argv, workdir, timeout_s, info=info)
    info = run.info
    records = run.records()
    row = _summarize(where.name, n, where.rate_bps, records) if run.ok else None
    if run.ok and row is None:
        run.fail("workers exited without writing every record")
    if row is not None:
        row["loadavg_before"], row["loadavg_after"] = info["loadavg_before"], info["loadavg_after"]
        info["timeline"] = _timeline_step(workdir, n, records)
    result["runs"].setdefault(where.name, {})[str(n)] = info
    run.say(f"{where.name:>9} N={n}", f"{run.seconds:.1f} s", f"load {info['loadavg_after'][0]}"
            + (f" (TCP check {info['tcp_check']['achieved_gbps']:.3f} Gbit/s)" if "tcp_check" in info else ""))
    return row


def _timeline_step(workdir: Path, n: int, records: list[dict]) -> dict:
    """One timed step of each schedule, every rank's spans relative to its start (ms):
    the step whose duration on rank 0 is the median of the last round's."""
    out: dict[str, Any] = {}
    for mode in MODES:
        recs = {rec["rank"]: rec for rec in records if rec.get("kind") == "mode" and rec["mode"] == mode}
        timed = recs[0]["timed_steps"]
        spans0 = recs[0]["breakdown"]
        durations = [(s.get("end_us", s["start_us"]) - s["start_us"], i) for i, s in zip(timed, spans0)]
        durations.sort()
        step = durations[len(durations) // 2][1]
        ranks = {}
        t0 = None
        for r in range(n):
            events = json.loads((workdir / f"timeline-{mode}" / f"timeline-rank{r}.json").read_text())["traceEvents"]
            fwd = sorted(e["ts"] for e in events if e.get("ph") == "X" and e.get("name") == "forward")
            if step >= len(fwd):
                continue
            start = fwd[step]
            end = fwd[step + 1] if step + 1 < len(fwd) else float("inf")
            spans = [{"name": e["name"], "cat": e.get("cat"), "tid": e.get("tid"), "ts": e["ts"], "dur": e["dur"]}
                     for e in events if e.get("ph") == "X" and start <= e["ts"] < end]
            # Reductions started in this step may finish after the next forward began: keep them.
            ranks[r] = spans
            t0 = start if t0 is None else min(t0, start)
        out[mode] = {"step_index": step, "ranks": {
            str(r): [{"name": s["name"], "cat": s["cat"], "row": _row_of(s),
                      "start_ms": round((s["ts"] - t0) / 1e3, 3), "dur_ms": round(s["dur"] / 1e3, 3)}
                     for s in spans] for r, spans in ranks.items()}}
    return out


def _row_of(span: dict) -> str:
    cat = span.get("cat")
    if cat == "compute":
        return "compute"
    if cat == "handoff":
        return "hand-off"
    if cat == "reduce" and span.get("tid", 0) >= 100:
        return "reduce"
    if cat == "apply":
        return "apply"
    return "wait"


# --------------------------------------------------------------------------- output


def _print_tables(rows: list[dict]) -> None:
    print("\nstep = slowest rank's median step (ms); fwd/bwd/wait/apply: median spans from the timeline (ms);"
          "\nT_red = full gradient set all-reduced alone; T_comp = sequential step minus its reduction phase;"
          "\nT_once = streamed hand-off, host apply after the last reduction; T_str = streamed hand-off and per-gradient"
          " apply (the default), whose 'wait' also holds the applies;"
          "\nhidden = (T_seq - T_str) / T_red; ratio = T_str / max(T_comp, T_red);"
          "\ncpu = CPU time of one worker's reduction alone; bound = 1 - cpu * max(1, N/cores) / T_red, the hidden"
          "\nfraction possible when the compute already fills every core")
    head = (f"{'network':>9} {'N':>2} | {'T_seq':>7} {'fwd':>6} {'bwd':>6} {'wait':>6} {'apply':>5} | "
            f"{'T_once':>7} {'apply':>5} | {'T_str':>7} {'fwd':>6} {'bwd':>6} {'wait':>6} | {'once/str':>8} | {'T_red':>7} {'T_comp':>7} | {'hidden':>6} {'ratio':>6}"
            f" | {'cpu':>6} {'bound':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        s, o, t = r["sequential"], r["apply-once"], r["streamed"]
        print(f"{r['network']:>9} {r['np']:>2} | {s['step_ms']:>7.1f} {s['forward_ms']:>6.1f} {s['backward_ms']:>6.1f} "
              f"{s['reduce_wait_ms']:>6.1f} {s['apply_ms']:>5.1f} | {o['step_ms']:>7.1f} {o['apply_ms']:>5.1f} | "
              f"{t['step_ms']:>7.1f} {t['forward_ms']:>6.1f} "
              f"{t['backward_ms']:>6.1f} {t['reduce_wait_ms']:>6.1f} | {r['apply_once_over_streamed']:>8.3f} | "
              f"{r['reduction_ms']:>7.1f} "
              f"{r['compute_ms']:>7.1f} | {r['hidden_fraction']:>6.3f} {r['streamed_over_bound']:>6.3f}"
              f" | {r.get('reduction_cpu_ms', float('nan')):>6.1f} {r.get('hidden_fraction_cpu_bound', float('nan')):>6.3f}")


def _targets(rows: list[dict]) -> list[dict]:
    checks = []
    for r in rows:
        if r["network"] != "1gbit":
            continue
        checks.append({"what": f"1gbit N={r['np']}: hidden fraction", "value": r["hidden_fraction"],
                       "goal": f">= {TARGET_HIDDEN}", "met": r["hidden_fraction"] >= TARGET_HIDDEN})
        checks.append({"what": f"1gbit N={r['np']}: T_streamed / max(T_compute, T_reduction)",
                       "value": r["streamed_over_bound"], "goal": f"<= {TARGET_RATIO}",
                       "met": r["streamed_over_bound"] <= TARGET_RATIO})
    return checks


def _plot_rates(path: Path, rows: list[dict]) -> None:
    plt = report.pyplot()
    networks = sorted({r["network"] for r in rows}, key=lambda nw: (nw == "loopback", NC.parse_rate(nw)
                                                                     if nw != "loopback" else 0))
    labels = [("loopback\n(shared memory)" if nw == "loopback" else f"{NC.parse_rate(nw) / 1e9:g} Gbit/s\n(gRPC)")
              for nw in networks]
    nps = sorted({r["np"] for r in rows})
    fig, axes = plt.subplots(1, len(nps), figsize=(6.5 * len(nps), 4.8), squeeze=False)
    for ax, n in zip(axes[0], nps):
        by = {r["network"]: r for r in rows if r["np"] == n}
        xs = [i for i, nw in enumerate(networks) if nw in by]

        def ys(fn: Any) -> list[float]:
            return [fn(by[networks[i]]) for i in xs]

        ax.plot(xs, ys(lambda r: r["sequential"]["step_ms"]), marker="o", label="sequential step")
        ax.plot(xs, ys(lambda r: r["apply-once"]["step_ms"]), marker="o", label="streamed, apply once")
        ax.plot(xs, ys(lambda r: r["streamed"]["step_ms"]), marker="o",
                label="streamed, per-gradient apply (hostreduce default)")
        ax.plot(xs, ys(lambda r: r["compute_ms"]), ls="--", marker=".", color="gray", label="T_compute")
        ax.plot(xs, ys(lambda r: r["reduction_ms"]), ls=":", marker=".", color="black",
                label="T_reduction (alone)")
        for i in xs:
            r = by[networks[i]]
            ax.annotate(f"hidden {r['hidden_fraction']:.2f}", (i, r["streamed"]["step_ms"]),
                        textcoords="offset points", xytext=(4, -12), fontsize=8)
        ax.set_xticks(range(len(networks)))
        ax.set_xticklabels(labels)
        ax.set_ylim(bottom=0)
        ax.set_title(f"N = {n}")
        ax.set_xlabel("link")
        ax.set_ylabel("ms per step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Step time against link rate: sequential, streamed with one apply, streamed with per-gradient apply "
                 "(lower is better)")
    report.save_figure(fig, path)


_COLORS = {"forward": "#4c72b0", "backward": "#55a868", "hand-off": "#8172b2", "reduce": "#dd8452",
           "apply": "#c44e52", "wait": "#bbbbbb"}


def _plot_timeline(path: Path, row: dict, timeline: dict, title: str | None = None) -> None:
    from matplotlib.patches import Patch

    plt = report.pyplot()
    n = row["np"]
    sub_rows = ["compute", "hand-off", "reduce", "apply"]
    fig, axes = plt.subplots(len(MODES), 1, figsize=(13, 1.2 + 0.9 * n * len(MODES)), sharex=True)
    xmax = 0.0
    for ax, mode in zip(axes, MODES):
        info = timeline[mode]
        yticks, ylabels = [], []
        for r in range(n):
            spans = info["ranks"].get(str(r), [])
            for j, sub in enumerate(sub_rows):
                y = (n - 1 - r) * (len(sub_rows) + 1) + (len(sub_rows) - 1 - j)
                yticks.append(y)
                ylabels.append(f"rank {r} {sub}")
                for s in spans:
                    kind = s["row"]
                    if kind == "wait":
                        kind_row = "compute"
                    else:
                        kind_row = kind
                    if kind_row != sub:
                        continue
                    if kind == "compute":
                        color = _COLORS["forward"] if s["name"] == "forward" else _COLORS["backward"]
                    else:
                        color = _COLORS[kind]
                    height = 0.8 if kind != "reduce" else 0.6
                    alpha = 0.5 if kind == "reduce" else 0.9
                    ax.broken_barh([(s["start_ms"], max(s["dur_ms"], 0.15))], (y - height / 2, height),
                                   facecolors=color, alpha=alpha, edgecolor="none")
                    xmax = max(xmax, s["start_ms"] + s["dur_ms"])
        ax.set_yticks(yticks)
        ax.set_yticklabels(ylabels, fontsize=7)
        step = row[mode]["step_ms"]
        ax.set_title(f"{mode}: median step {step:.0f} ms (one step, step #{info['step_index']})", fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1].set_xlim(0, xmax * 1.02)
    axes[-1].set_xlabel("ms since the step's first forward pass began")
    handles = [Patch(color=_COLORS[k], label=k) for k in ("forward", "backward", "hand-off", "reduce", "apply", "wait")]
    fig.legend(handles=handles, loc="lower center", ncol=6, fontsize=8)
    net = row["network"]
    net_title = ("loopback (shared memory)" if net == "loopback"
                 else f"simulated {NC.parse_rate(net) / 1e9:g} Gbit/s links (gRPC)")
    if title is not None:
        net_title = f"{title}, {net_title}"
    fig.suptitle(f"One training step per rank, N = {n}, {net_title}; reduce bars overlap per tensor "
                 f"(T_reduction alone {row['reduction_ms']:.0f} ms)", fontsize=10, x=0.01, ha="left")
    report.save_figure(fig, path, rect=(0, 0.04, 1, 0.95))



# --------------------------------------------------------------------------- device-like compute

SYSTEMS = {
    "ring": (peers.HOSTREDUCE_RING, "hostreduce ring"),
    "mpi": (peers.HOSTREDUCE_MPI.with_env(HOSTREDUCE_REDUCER="mpi"), "hostreduce MPI engine"),
    "horovod": (peers.HOROVOD.with_env(TF_USE_LEGACY_KERAS="1"), "Horovod DistributedGradientTape"),
}
SCHEDULE_LABELS = {"sequential": "sequential", "apply-once": "streamed, apply once",
                   "streamed": "streamed, per-gradient apply", "horovod": "streamed (Horovod's)"}
TARGET_DEVICE_HIDDEN = 0.9      # 1 Gbit/s, wherever compute >= reduction
TARGET_DEVICE_STEP = 1.05       # 10 Gbit/s: step / compute alone


def _device_rows(profile: str, network: str, n: int, system: str, rate_bps: float | None,
                 records: list[dict]) -> list[dict]:
    """One row per schedule of one job: step, compute alone, reduction alone (ms), the
    hidden fraction (compute + reduction - step) / reduction, and the host CPU."""
    by_kind: dict[str, dict[int, list[dict]]] = {}
    for rec in records:
        by_kind.setdefault(rec.get("kind", ""), {}).setdefault(rec["rank"], []).append(rec)
    ranks = set(by_kind.get("alone", {}))
    if len(ranks) != n or len(by_kind.get("compute", {})) != n:
        return []
    compute = max(statistics.median(recs[0]["compute_ms"]) for recs in by_kind["compute"].values())
    nominal = next(iter(by_kind["compute"].values()))[0]["nominal_ms"]
    alone = {r: recs[0] for r, recs in by_kind["alone"].items()}
    reps = min(len(a["reduce_ms"]) for a in alone.values())
    reduction = statistics.median(max(alone[r]["reduce_ms"][i] for r in alone) for i in range(reps))
    reduction_cpu = statistics.mean(statistics.median(a["reduce_cpu_ms"]) for a in alone.values())
    hello = next(iter(by_kind.get("hello", {}).values()), [{}])[0]
    rows = []
    modes: dict[str, dict[int, dict]] = {}
    for r, recs in by_kind.get("mode", {}).items():
        for rec in recs:
            modes.setdefault(rec["mode"], {})[r] = rec
    for mode, per_rank in modes.items():
        if len(per_rank) != n:
            continue
        step = max(statistics.median(rec["step_ms"]) for rec in per_rank.values())
        cpu = statistics.mean(statistics.median(rec["cpu_ms"]) for rec in per_rank.values())
        row = {"profile": profile, "network": network, "np": n, "system": system, "schedule": mode,
               "label": f"{SYSTEMS[system][1]}: {SCHEDULE_LABELS[mode]}", "transport": hello.get("transport"),
               "engine": hello.get("engine"), "device_kernel": hello.get("device_kernel"), "link_rate_bps": rate_bps,
               "step_ms": round(step, 3), "compute_ms": round(compute, 3), "compute_nominal_ms": nominal,
               "reduction_ms": round(reduction, 3), "reduction_cpu_ms": round(reduction_cpu, 3),
               "gradient_bytes": next(iter(alone.values()))["bytes"],
               "gradient_tensors": next(iter(alone.values()))["tensors"],
               "hidden_fraction": round((compute + reduction - step) / reduction, 4),
               "hideable": round(min(1.0, compute / reduction), 4),
               "step_over_compute": round(step / compute, 4),
               "cpu_ms_per_step": round(cpu, 3),
               "rank_step_ms": {str(k): v["step_ms"] for k, v in sorted(per_rank.items())}}
        parts = [rec["breakdown"] for rec in per_rank.values() if rec["breakdown"]]
        for key in ("backward_ms", "reduce_wait_ms", "apply_ms"):
            vals = [median([st.get(key) for st in b]) for b in parts]
            if vals and all(v is not None for v in vals):
                row[key] = round(statistics.mean(vals), 3)
        if rate_bps:
            row["reduction_link_bound_ms"] = round(link_bound_ms(n, row["gradient_bytes"], rate_bps), 3)
        row["bound"] = _device_bound(row)
        rows.append(row)
    return rows


def _device_bound(row: dict) -> str:
    """What bounds a row's step, in words."""
    compute, red, step = row["compute_ms"], row["reduction_ms"], row["step_ms"]
    link = row.get("reduction_link_bound_ms")
    cores_each = min(1.0, report.cores() / row["np"])
    cpu_wall = row["cpu_ms_per_step"] / cores_each   # the step's host CPU on this worker's share of the cores
    cpu = (f"the host's CPU: {row['cpu_ms_per_step']:.0f} ms per worker and step on {cores_each:g} core each "
           f"({row['np']} workers, {report.cores()} cores)")
    if row["schedule"] == "sequential":
        return "no overlap by construction: compute, then the reduction, then the apply"
    if cpu_wall >= 0.8 * step and cpu_wall > compute:
        return cpu
    if compute < red:
        if link and link >= 0.6 * red:
            what = f"the link ({link:.0f} ms for the bytes alone)"
        elif row["reduction_cpu_ms"] / cores_each >= 0.8 * red:
            what = f"its CPU ({row['reduction_cpu_ms']:.0f} ms per worker)"
        else:
            what = "neither the link nor the CPU alone (the engine's pipeline)"
        return (f"compute ({compute:.0f} ms) < reduction ({red:.0f} ms): at most {row['hideable']:.2f} of the "
                f"reduction can hide; the reduction is bound by {what}")
    tail = step - compute
    if tail <= 0.05 * compute:
        return "compute: the reduction and apply are hidden"
    return (f"{tail:.0f} ms after the compute: the reduction of the last gradients and their apply "
            f"(host CPU per step {row['cpu_ms_per_step']:.0f} ms)")


def _device_targets(rows: list[dict]) -> list[dict]:
    checks = []
    cells = sorted({(r["profile"], r["network"], r["np"]) for r in rows})
    for prof, net, n in cells:
        cell = {(r["system"], r["schedule"]): r for r in rows if (r["profile"], r["network"], r["np"]) == (prof, net, n)}
        ring = cell.get(("ring", "streamed"))
        hvd = cell.get(("horovod", "horovod"))
        if ring is None:
            continue
        where = f"{prof} {net} N={n}"
        if net == "1gbit":
            if ring["compute_ms"] >= ring["reduction_ms"]:
                checks.append({"what": f"{where}: ring streamed hidden fraction (compute >= reduction)",
                               "value": ring["hidden_fraction"], "goal": f">= {TARGET_DEVICE_HIDDEN}",
                               "met": ring["hidden_fraction"] >= TARGET_DEVICE_HIDDEN})
            if hvd is not None:
                checks.append({"what": f"{where}: ring streamed hidden fraction vs Horovod's ({hvd['hidden_fraction']})",
                               "value": ring["hidden_fraction"], "goal": f">= {hvd['hidden_fraction']}",
                               "met": ring["hidden_fraction"] >= hvd["hidden_fraction"]})
        if net == "10gbit":
            checks.append({"what": f"{where}: ring streamed step / compute alone", "value": ring["step_over_compute"],
                           "goal": f"<= {TARGET_DEVICE_STEP}", "met": ring["step_over_compute"] <= TARGET_DEVICE_STEP})
    return checks


def _print_device_tables(rows: list[dict]) -> None:
    print("\ndevice-like compute (layer times from the profile, no host CPU): step = slowest rank's median (ms);"
          "\ncompute = forward + backward alone (+ the device's update for Horovod); reduction = every gradient"
          "\nall-reduced alone; hidden = (compute + reduction - step) / reduction; hideable = min(1, compute /"
          " reduction);\ncpu = host CPU per step and worker (reduction, hand-off, apply, TensorFlow)")
    head = (f"{'model':>9} {'network':>8} {'N':>2} | {'system: schedule':<46} | {'step':>7} {'compute':>7} "
            f"{'reduce':>7} | {'hidden':>6} {'hideable':>8} {'step/comp':>9} | {'cpu':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['profile']:>9} {r['network']:>8} {r['np']:>2} | {r['label']:<46} | {r['step_ms']:>7.0f} "
              f"{r['compute_ms']:>7.0f} {r['reduction_ms']:>7.0f} | {r['hidden_fraction']:>6.2f} {r['hideable']:>8.2f} "
              f"{r['step_over_compute']:>9.3f} | {r['cpu_ms_per_step']:>6.0f}")


def _plot_device(path: Path, rows: list[dict]) -> None:
    plt = report.pyplot()
    cells = sorted({(r["profile"], r["np"]) for r in rows})
    fig, axes = plt.subplots(1, len(cells), figsize=(6.2 * len(cells), 5.0), squeeze=False)
    for ax, (prof, n) in zip(axes[0], cells):
        mine = [r for r in rows if r["profile"] == prof and r["np"] == n]
        networks = sorted({r["network"] for r in mine}, key=lambda nw: NC.parse_rate(nw) if nw != "loopback" else 1e15)
        series = sorted({(r["system"], r["schedule"]) for r in mine}, key=lambda k: (list(SYSTEMS).index(k[0]), k[1]))
        width = 0.8 / (len(series) + 2)
        for j, key in enumerate(series):
            ys = [next((r["step_ms"] for r in mine if r["network"] == nw and (r["system"], r["schedule"]) == key),
                       float("nan")) for nw in networks]
            label = f"{SYSTEMS[key[0]][1]}: {SCHEDULE_LABELS[key[1]]}"
            bars = ax.bar([i + j * width for i in range(len(networks))], ys, width, label=label)
            if key[1] in ("sequential", "apply-once"):
                continue  # the hidden fraction is written over the streamed schedules only
            for b, nw in zip(bars, networks):
                r = next((r for r in mine if r["network"] == nw and (r["system"], r["schedule"]) == key), None)
                if r is not None:
                    ax.annotate(f"{r['hidden_fraction']:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                                ha="center", va="bottom", fontsize=7)
        for k, (what, style) in enumerate((("compute_ms", "--"), ("reduction_ms", ":"))):
            for i, nw in enumerate(networks):
                vals = [r[what] for r in mine if r["network"] == nw and r["system"] == "ring"]
                if vals:
                    ax.hlines(vals[0], i - 0.1, i + 0.9 - 0.1, colors="black", linestyles=style,
                              label=("compute alone" if what == "compute_ms" else "reduction alone (ring)") if i == 0 else None)
        ax.set_xticks([i + 0.4 - width for i in range(len(networks))])
        ax.set_xticklabels([("loopback" if nw == "loopback" else f"{NC.parse_rate(nw) / 1e9:g} Gbit/s") for nw in networks])
        ax.set_title(f"{prof}, N = {n}")
        ax.set_ylabel("ms per step (numbers: hidden fraction)")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Device-like compute: step time per system and schedule against compute and reduction alone "
                 "(lower is better)")
    report.save_figure(fig, path)


def _device_main(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    profiles = [pr.strip() for pr in (args.profiles or ("resnet50" if args.quick else "resnet50,bert_base")).split(",")]
    for pr in profiles:
        try:
            load_profile(pr)
        except ValueError as exc:
            p.error(str(exc))
    systems = cli.parse_choices(p, "--systems", args.systems or ("ring,horovod" if args.quick else "ring,mpi,horovod"),
                                list(SYSTEMS))
    nps = cli.parse_np(p, args.np, [2] if args.quick else DEFAULT_NP)
    wanted = cli.parse_networks(p, args.networks, ["1gbit"] if args.quick else ["1gbit", "10gbit"])
    networks, usable, why = placement.usable_networks(wanted)
    if "horovod" in systems:
        ok, reason = placement.horovod_mpirun()
        if not ok:
            print(f"Horovod rows left out: {reason}", flush=True)
            systems = [s for s in systems if s != "horovod"]
    kernel_path, kernel_how = build_wait_kernel()  # before the workers start: they load it
    if kernel_path is None:
        print(f"DeviceWait kernel not built ({kernel_how}): the device ops are Python sleeps", flush=True)
    quiet = report.wait_for_quiet(args.max_load, args.max_wait_s)
    cores = report.cores()
    plan = {"warmup_steps": 2, "rounds": args.rounds or (1 if args.quick else 2),
            "steps_per_round": args.steps or (2 if args.quick else 4), "reduce_reps": 3 if args.quick else 5,
            "rate_check_s": 0.3 if args.quick else 1.0, "inter_op_threads": args.inter_op_threads,
            "worker_timeout_s": 1500.0, "hostreduce_env": report.hostreduce_env()}
    prof_info = {}
    for pr in profiles:
        prof = load_profile(pr)
        batch = args.batch or prof["batch"]
        prof_info[pr] = {"name": prof["stem"], "model": prof["model"], "source": prof["source"], "batch": batch,
                         "batch_unit": prof["batch_unit"], "device": prof["device"],
                         "parameters": prof["parameters"], "gradient_tensors": prof["gradient_tensors"],
                         "compute_nominal_ms": round(compute_ms(prof, batch), 3),
                         "device_update_ms": round(update_ms(prof), 3)}
    rep = report.Report(
        args.out, "overlap.device", "overlap (device-like compute)",
        "Each layer's forward and backward pass is an op that takes the time the profile gives it on an "
        "accelerator, without host CPU, and yields the layer's gradients as it ends; the same step under "
        "hostreduce (Estimator, ring over gRPC on the shaped links, MPI engine) and Horovod's own "
        "DistributedGradientTape; compute and reduction also timed alone in the same workers",
        packages=("grpcio", "tensorflow", "keras", "horovod", "mpi4py"),
        environment_extra={"load_wait": quiet, "namespaces_usable": usable, "namespaces_reason": why,
                           "device_kernel": {"path": str(kernel_path) if kernel_path else None, "how": kernel_how},
                           "mpirun": {"mpi": placement.mpirun_version("mpi"),
                                      "horovod": placement.mpirun_version("horovod")}},
        settings={"profiles": {info["name"]: info for info in prof_info.values()}, "np": nps, "networks": networks, "systems": systems, "plan": plan,
                  "schedules": {"ring": list(MODES), "mpi": ["streamed"], "horovod": ["horovod"]},
                  "intra_op_threads": {str(n): max(1, cores // n) for n in nps},
                  "definitions": {
                      "step_ms": "slowest rank's median of timed steps",
                      "compute_ms": "slowest rank's median of the same step's forward and backward pass alone in a "
                                    "traced step (for Horovod with its device-side update), no reduction",
                      "reduction_ms": "median over repetitions of the slowest rank's all-reduce of every gradient "
                                      "tensor at once, no compute",
                      "hidden_fraction": "(compute + reduction - step) / reduction",
                      "hideable": "min(1, compute / reduction): the most that can hide behind the compute",
                      "cpu_ms_per_step": "host CPU time per step of one worker (all threads), mean over workers",
                      "reduction_cpu_ms": "host CPU time of one worker during the reduction alone"},
                  "targets": {"hidden_fraction_1gbit": f">= {TARGET_DEVICE_HIDDEN} where compute >= reduction, and "
                                                       ">= Horovod's", "step_over_compute_10gbit": f"<= {TARGET_DEVICE_STEP}"}},
        runs={}, measurements=[], targets=[])
    result = rep.result
    rep.announce(f"overlap benchmark, device-like compute: profiles={profiles} networks={networks} np={nps} "
                 f"systems={systems}")
    rows: list[dict] = []
    timelines: dict[tuple[str, str, int], dict] = {}
    with jobs.workroot("hostreduce-bench-overlap-device-", args.keep_workdir) as workroot:
        for pr in profiles:
            for n in nps:
                for network in networks:
                    with placement.network(network, n) as where:
                        for system in systems:
                            peer = SYSTEMS[system][0]
                            modes = list(MODES) if system == "ring" else ["streamed"] if system == "mpi" else ["horovod"]
                            plan_n = {**plan, "intra_op_threads": max(1, cores // n), "system": system, "modes": modes,
                                      "device": {"profile": pr, "batch": prof_info[pr]["batch"]}}
                            tag = f"{prof_info[pr]['name']}-{network}-np{n}-{system}"
                            plan_path = jobs.write_plan(workroot / f"plan-{tag}.json", plan_n)
                            workdir = workroot / tag
                            info: dict[str, Any] = {}
                            if where.cluster is not None and system == systems[0]:
                                info["tcp_check"] = where.measure_rate(plan["rate_check_s"])
                            argv = lambda rank, _wd=workdir, _pp=plan_path: jobs.worker_argv(  # noqa: E731
                                __file__, plan=_pp, workdir=_wd, rank=rank)
                            run = peers.run(peer, where, n, argv, workdir, args.job_timeout or 1200.0, info=info)
                            name = prof_info[pr]["name"]
                            got = _device_rows(name, network, n, system, where.rate_bps, run.records()) if run.ok else []
                            if run.ok and not got:
                                run.fail("workers exited without writing every record")
                            if system == "ring" and got:
                                try:
                                    timelines[(name, network, n)] = _timeline_step(workdir, n, run.records())
                                except (OSError, KeyError, IndexError, ValueError) as exc:
                                    run.info["timeline_error"] = f"{type(exc).__name__}: {exc}"
                            result["runs"].setdefault(name, {}).setdefault(network, {}).setdefault(str(n), {})[system] = run.info
                            run.say(f"{name} {network:>7} N={n} {system:>8}", f"{run.seconds:.1f} s",
                                    f"load {run.info['loadavg_after'][0]}")
                            rows += got
                            result["measurements"] = rows
                            rep.save()
    result["targets"] = _device_targets(rows)

    def plot(path: Path) -> None:
        _plot_device(path, rows)
        models = {info["name"]: info["model"] for info in prof_info.values()}
        for (name, net, n), tl in timelines.items():
            ring = {r["schedule"]: r for r in rows if (r["profile"], r["network"], r["np"], r["system"]) == (name, net, n, "ring")}
            if set(MODES) <= set(ring):
                row = {"np": n, "network": net, "reduction_ms": ring["streamed"]["reduction_ms"],
                       **{m: {"step_ms": ring[m]["step_ms"]} for m in MODES}}
                _plot_timeline(rep.out_dir / f"overlap.device.timeline.{name}-{net}-np{n}.png", row, tl,
                               title=f"{models[name]}, device-like compute")

    def show() -> None:
        _print_device_tables(rows)
        report.print_targets(result["targets"])

    rep.close(plot=plot if rows else None, no_plot=args.no_plot, show=show)
    return report.exit_status(result["runs"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", default=None, help="comma-separated world sizes (default 2,4; --quick: 2)")
    p.add_argument("--networks", default=None,
                   help="comma-separated: loopback and link rates (default loopback,1gbit,10gbit; --quick: loopback,1gbit)")
    p.add_argument("--global-batch", type=int, default=None, help="examples per step over all workers (default 3072)")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds of both schedules (default 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per schedule and round (default 5)")
    p.add_argument("--inter-op-threads", type=int, default=2, help="TensorFlow inter-op threads per worker (default 2)")
    p.add_argument("--quick", action="store_true", help="smoke run (< 90 s)")
    p.add_argument("--profile", default=None, metavar="NETWORK:N",
                   help="sample rank 0 with py-spy during one extra streamed round of this cell, e.g. 1gbit:4 "
                        "(summary in the JSON under pyspy_rank0_streamed)")
    p.add_argument("--job-timeout", type=float, default=None, help="wall-clock limit of one run (s)")
    p.add_argument("--compute", choices=("cpu", "device"), default="cpu",
                   help="cpu: the MLP's passes run on this host's cores (default); device: every layer takes the "
                        "time a device profile gives it, without host CPU (results: overlap.device.json)")
    p.add_argument("--profiles", default=None,
                   help="--compute device: comma-separated profiles of benchmarks/profiles (default resnet50,bert_base;"
                        " --quick: resnet50)")
    p.add_argument("--systems", default=None,
                   help="--compute device: comma-separated of ring, mpi, horovod (default all; --quick: ring,horovod)")
    p.add_argument("--batch", type=int, default=None, help="--compute device: examples per worker (default: the profile's)")
    cli.add_run_options(p)
    args = p.parse_args(argv)
    if args.worker:
        return jobs.run_worker(args, _measure)
    if args.compute == "device":
        return _device_main(args, p)

    nps = cli.parse_np(p, args.np, [2] if args.quick else DEFAULT_NP)
    wanted = cli.parse_networks(p, args.networks, ["loopback", "1gbit"] if args.quick else DEFAULT_NETWORKS)
    global_batch = args.global_batch or (256 if args.quick else 3072)
    if any(global_batch % n for n in nps):
        p.error(f"--global-batch must be divisible by every N. Received: --global-batch {global_batch}, N {nps}")
    networks, usable, why = placement.usable_networks(wanted)
    quiet = report.wait_for_quiet(args.max_load, args.max_wait_s)
    cores = report.cores()
    plan = {"global_batch": global_batch, "warmup_steps": 2 if args.quick else 3,
            "rounds": args.rounds or (1 if args.quick else 2), "steps_per_round": args.steps or (3 if args.quick else 5),
            "reduce_reps": 3 if args.quick else 7, "rate_check_s": 0.3 if args.quick else 1.0,
            "inter_op_threads": args.inter_op_threads, "worker_timeout_s": 560.0,
            "hostreduce_env": report.hostreduce_env()}
    rep = report.Report(
        args.out, "overlap", "overlap",
        "MLP 512-768x8-10 (4.5M float32 parameters, 18 gradient tensors), Adam on the host; "
        "Estimator + hostreduce ring; sequential (stream_gradients=False), streamed with the host "
        "apply after the last reduction (host_apply='once') and streamed with per-gradient apply, "
        "alternating in the same workers; full gradient set all-reduced alone for T_reduction",
        packages=("grpcio", "tensorflow", "keras"),
        environment_extra={"load_wait": quiet, "namespaces_usable": usable, "namespaces_reason": why},
        settings={"np": nps, "networks": networks, "quick": args.quick, "plan": plan,
                  "model": {"input": INPUT_DIM, "hidden": HIDDEN, "hidden_layers": LAYERS, "classes": CLASSES,
                            "dense_layers": LAYERS + 1},
                  "data": "synthetic: 4 global batches of standard-normal features, uniform labels, repeated",
                  "intra_op_threads": {str(n): max(1, cores // n) for n in nps},
                  "definitions": {
                      "step_ms": "slowest rank's median of timed steps (first step of each train() call dropped)",
                      "compute_ms": "sequential step - its reduction phase (submit + wait)",
                      "apply_once_over_streamed": "T_apply_once / T_streamed: what applying each gradient as "
                                                  "its reduction completes saves over one apply per step",
                      "reduction_ms": "median over repetitions of the slowest rank's all-reduce of every "
                                      "gradient tensor, all submitted at once, no compute",
                      "hidden_fraction": "(T_sequential - T_streamed) / T_reduction",
                      "streamed_over_bound": "T_streamed / max(T_compute, T_reduction)",
                      "reduction_cpu_ms": "mean over ranks of the median CPU time (user + system, all threads) "
                                          "of one worker during the reduction alone",
                      "hidden_fraction_cpu_bound": "1 - reduction_cpu_ms * max(1, N / cores) / T_reduction: the "
                                                   "most that can be hidden when the compute fills every core"},
                  "targets": {"hidden_fraction_1gbit": f">= {TARGET_HIDDEN}",
                              "streamed_over_bound_1gbit": f"<= {TARGET_RATIO}"}},
        runs={}, measurements=[], targets=[])
    result = rep.result
    rep.announce(f"overlap benchmark: networks={networks} np={nps} global batch {global_batch}")
    rows: list[dict] = []
    timelines: dict[tuple[str, int], dict] = {}
    with jobs.workroot("hostreduce-bench-overlap-", args.keep_workdir) as workroot:
        for n in nps:
            for network in networks:
                plan_n = {**plan, "intra_op_threads": max(1, cores // n), "profile": args.profile == f"{network}:{n}"}
                plan_path = jobs.write_plan(workroot / f"plan-{network}-np{n}.json", plan_n)
                timeout = args.job_timeout or (150.0 if args.quick else 240.0)
                with placement.network(network, n) as where:
                    row = _run_cell(where, n, plan_n, plan_path, workroot, result, timeout)
                if row is not None:
                    rows.append(row)
                    timelines[(network, n)] = result["runs"][network][str(n)].get("timeline")
                result["measurements"] = rows
                rep.save()
    result["targets"] = _targets(rows)

    def plot(path: Path) -> None:
        _plot_rates(path, rows)
        for row in rows:
            tl = timelines.get((row["network"], row["np"]))
            if tl:
                _plot_timeline(rep.out_dir / f"overlap.timeline.{row['network']}-np{row['np']}.png", row, tl)
        main_tl = next((r for r in rows if r["network"] == "1gbit" and r["np"] == max(nps)), rows[-1])
        if timelines.get((main_tl["network"], main_tl["np"])):
            _plot_timeline(rep.out_dir / "overlap.timeline.png", main_tl,
                           timelines[(main_tl["network"], main_tl["np"])])

    def show() -> None:
        _print_tables(rows)
        report.print_targets(result["targets"])

    rep.close(plot=plot if rows else None, no_plot=args.no_plot, show=show)
    return report.exit_status(result["runs"])


if __name__ == "__main__":
    sys.exit(main())
