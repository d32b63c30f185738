#!/usr/bin/env python
"""Where a small model's ``fit`` step goes: hostreduce against Horovod, same run.

    python benchmarks/step_profile.py                # MNIST model, N = 2 and 4, 1500 steps
    python benchmarks/step_profile.py --quick        # smoke run

Two parts:

* ``jobs``: Keras ``model.fit`` of ``end_to_end.py``'s MNIST model (its ``keras-ring``
  and ``keras-horovod`` rows, the same function), with many steps. Each rank records,
  over its timed steps, the CPU time of every thread, summed by kind (the Keras loop's
  main thread, TensorFlow's pools, the engine's threads, the peer's unnamed threads:
  Horovod's background loop and MPI), and its voluntary and involuntary context
  switches, per step.
* ``idle``: what an idle core costs here. Two processes at once (one per core, as N = 2
  runs) train the same model in a ``tf.function`` step that waits for ``--wait-ms``
  between the backward pass and the update, in a ``tf.numpy_function``: by sleeping, by
  polling the clock, or not at all. A wait that sleeps lets the core go idle, as a
  blocked wait for a collective does; one that polls keeps it busy, as an MPI progress
  loop does. The difference of their step times, at equal CPU, is what waking up from
  idle costs on this machine beyond the wait itself.

Results go to ``<out>/step_profile.json`` and ``.png``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import end_to_end as E2E  # noqa: E402
from benchmarks.harness import cli, jobs, peers, report  # noqa: E402
from benchmarks.harness import placement as P  # noqa: E402
from benchmarks.harness.jobs import workroot  # noqa: E402
from benchmarks.impls.training import tf_threads  # noqa: E402

IMPLS = {"hostreduce": peers.HOSTREDUCE_RING, "horovod": peers.HOROVOD.with_env(TF_USE_LEGACY_KERAS="1")}
LABELS = {"hostreduce": "hostreduce.horovod.keras, ring (Keras 3)",
          "horovod": "horovod.tensorflow.keras (tf_keras), Horovod's mpirun"}
WAITS = ("none", "sleep", "poll")
KINDS = ("Keras loop (main thread)", "TensorFlow pools", "engine threads", "peer's unnamed threads", "other")


# --------------------------------------------------------------------------- threads


def _thread_times() -> dict[int, tuple[str, float, int, int]]:
    """Every thread of this process: (kind, CPU seconds, voluntary, involuntary switches)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except FileNotFoundError:  # the thread ended
            continue
        comm = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        cpu = (int(fields[11]) + int(fields[12])) / tick
        out[int(tid)] = (_kind(names.get(int(tid)), comm), cpu, int(status["voluntary_ctxt_switches"]),
                         int(status["nonvoluntary_ctxt_switches"]))
    return out


def _kind(python_name: str | None, comm: str) -> str:
    if python_name == "MainThread":
        return KINDS[0]
    if comm.startswith("tf_"):
        return KINDS[1]
    if python_name is not None:  # hostreduce's threads, and gRPC's Python threads under it
        return KINDS[2]
    if comm == "python":  # threads started from C/C++ without a name: Horovod's loop, Open MPI's
        return KINDS[3]
    return KINDS[4]


def _per_step(before: dict, after: dict, steps: int) -> dict[str, Any]:
    cpu: dict[str, float] = collections.Counter()
    switches = collections.Counter()
    for tid, (kind, t1, v1, n1) in after.items():
        _, t0, v0, n0 = before.get(tid, (kind, 0.0, 0, 0))
        cpu[kind] += t1 - t0
        switches["voluntary"] += v1 - v0
        switches["involuntary"] += n1 - n0
    return {"cpu_ms_by_kind": {k: round(cpu.get(k, 0.0) * 1e3 / steps, 3) for k in KINDS},
            "switches_per_step": {k: round(v / steps, 1) for k, v in switches.items()}}


# --------------------------------------------------------------------------- workers


def _fit_worker(impl: str, plan: dict, workdir: Path) -> None:
    tf_threads(plan)
    if impl == "hostreduce":
        import hostreduce.horovod.keras as hvd
    else:
        import horovod.tensorflow.keras as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    warmup, steps = plan["warmup"]["mnist"], plan["steps"]["mnist"]
    marks: dict[str, Any] = {}

    def on_batch_end(batch: int) -> None:
        if batch == warmup - 1:
            marks["before"], marks["t0"] = _thread_times(), time.perf_counter()
        elif batch == warmup + steps - 1:
            marks["after"], marks["t1"] = _thread_times(), time.perf_counter()

    step_s, facts = E2E.fit_steps(impl, "mnist", plan["batch"], plan, rank, size, hvd=hvd,
                                  legacy=impl == "horovod", on_host=impl == "hostreduce", on_batch_end=on_batch_end)
    record = {"kind": "profile", "impl": impl, "rank": rank, "size": size,
              "step_ms": round(statistics.median(step_s) * 1e3, 3),
              "cpu_ms": round(statistics.median(facts["cpu_ms"]), 3), "keras": facts["keras"],
              **_per_step(marks["before"], marks["after"], steps)}
    with open(workdir / f"rank{rank}.jsonl", "a") as out:
        out.write(json.dumps(record) + "\n")
    hvd.shutdown()


def _idle_worker(plan: dict, rank: int, workdir: Path) -> None:
    """One of the two processes of the ``idle`` part: each wait kind in turn."""
    import numpy as np

    tf_threads(plan)
    import keras
    import tensorflow as tf

    rng = np.random.default_rng(rank)
    x = rng.normal(size=(plan["batch"] * 8,) + E2E.INPUT_SHAPE["mnist"]).astype(np.float32)
    y = rng.integers(0, 10, size=plan["batch"] * 8).astype(np.int32)
    net = keras.Sequential([keras.Input(E2E.INPUT_SHAPE["mnist"]), keras.layers.Dense(256, activation="relu"),
                            keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
    optimizer = keras.optimizers.Adam(E2E.LEARNING_RATE)
    optimizer.build(net.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    wait_s = plan["wait_ms"] / 1e3
    records = []
    for kind in plan["waits"]:
        def hold(*grads: np.ndarray, kind: str = kind) -> list[np.ndarray]:
            if kind == "sleep":
                time.sleep(wait_s)
            elif kind == "poll":
                end = time.perf_counter() + wait_s
                while time.perf_counter() < end:
                    pass
            return list(grads)

        @tf.function
        def step(xb: Any, yb: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, net(xb, training=True))
            grads = tape.gradient(loss, net.trainable_variables)
            if kind != "none":
                held = tf.numpy_function(hold, grads, [g.dtype for g in grads], stateful=True)
                grads = [tf.reshape(h, g.shape) for h, g in zip(held, grads)]
            optimizer.apply(grads, net.trainable_variables)
            return loss

        jobs.file_barrier(workdir, f"idle-{kind}", rank, 2)
        batches = [(x[i:i + plan["batch"]], y[i:i + plan["batch"]]) for i in range(0, len(x), plan["batch"])]
        times, cpus = [], []
        for i in range(plan["warmup"]["mnist"] + plan["steps"]["mnist"]):
            xb, yb = batches[i % len(batches)]
            t0, c0 = time.perf_counter(), time.process_time()
            float(step(xb, yb))
            if i >= plan["warmup"]["mnist"]:
                times.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
        records.append({"kind": "idle", "wait": kind, "rank": rank, "step_ms": round(statistics.median(times) * 1e3, 3),
                        "cpu_ms": round(statistics.median(cpus) * 1e3, 3)})
    with open(workdir / f"idle{rank}.jsonl", "a") as out:
        out.writelines(json.dumps(r) + "\n" for r in records)


# --------------------------------------------------------------------------- coordinator


def _run_jobs(rep: report.Report, plan: dict, impls: list[str], nps: list[int], root: Path, timeout_s: float) -> None:
    available, why = P.horovod_mpirun()
    for n in nps:
        for impl in impls:
            if impl == "horovod" and not available:
                rep["skipped"][f"{impl}/{n}"] = why
                print(f"  N={n} {impl}: skipped -- {why}", flush=True)
                continue
            workdir = root / f"{impl}-np{n}"
            plan_path = jobs.write_plan(workdir / "plan.json", {**plan, "intra_op_threads": max(1, plan["cores"] // n),
                                                                "worker_timeout_s": timeout_s - 10.0})
            argv = lambda rank, impl=impl: jobs.worker_argv(__file__, impl, plan=plan_path,  # noqa: E731
                                                            workdir=workdir, rank=rank)
            run = peers.run(IMPLS[impl], P.Loopback(), n, argv, workdir, timeout_s, cause=True)
            recs = run.records("profile")
            if run.ok and len(recs) != n:
                run.fail(f"{len(recs)} of {n} records written")
            rep["runs"][f"{impl}/{n}"] = run.info
            if run.ok:
                rep["jobs"].append(_summary(impl, n, recs))
            run.say(f"N={n} {impl}", f"{run.seconds:.1f} s" if run.job is not None else None)
            rep.save()


def _summary(impl: str, n: int, recs: list[dict]) -> dict[str, Any]:
    """One row: means over the ranks."""
    mean = lambda values: round(statistics.fmean(values), 3)  # noqa: E731
    return {"impl": impl, "np": n, "keras": recs[0]["keras"],
            "step_ms": round(max(r["step_ms"] for r in recs), 3),
            "cpu_ms_per_rank": mean([r["cpu_ms"] for r in recs]),
            "cpu_ms_by_kind": {k: mean([r["cpu_ms_by_kind"][k] for r in recs]) for k in KINDS},
            "switches_per_step": {k: mean([r["switches_per_step"].get(k, 0.0) for r in recs])
                                  for k in ("voluntary", "involuntary")},
            "cpu_bound_ms": round(mean([r["cpu_ms"] for r in recs]) * max(1.0, n / report.cores()), 3)}


def _run_idle(rep: report.Report, plan: dict, root: Path, timeout_s: float) -> None:
    workdir = root / "idle"
    plan_path = jobs.write_plan(workdir / "plan.json", {**plan, "intra_op_threads": 1,
                                                        "worker_timeout_s": timeout_s - 10.0})
    argv = lambda rank: jobs.worker_argv(__file__, "idle", plan=plan_path, workdir=workdir, rank=rank)  # noqa: E731
    run = peers.run(peers.INDEPENDENT, P.Loopback(), 2, argv, workdir, timeout_s, cause=True)
    rep["runs"]["idle"] = run.info
    recs = [r for path in sorted(workdir.glob("idle*.jsonl")) for r in jobs.read_jsonl(path)]
    if run.ok and len(recs) != 2 * len(plan["waits"]):
        run.fail(f"{len(recs)} of {2 * len(plan['waits'])} records written")
    if run.ok:
        for wait in plan["waits"]:
            mine = [r for r in recs if r["wait"] == wait]
            rep["idle"].append({"wait": wait, "wait_ms": 0.0 if wait == "none" else plan["wait_ms"],
                                "step_ms": round(statistics.fmean(r["step_ms"] for r in mine), 3),
                                "cpu_ms": round(statistics.fmean(r["cpu_ms"] for r in mine), 3)})
    run.say("idle: none / sleep / poll", f"{run.seconds:.1f} s" if run.job is not None else None)
    rep.save()


def _findings(rep: report.Report) -> None:
    rows = {(j["impl"], j["np"]): j for j in rep["jobs"]}
    for (impl, n), row in sorted(rows.items()):
        peer = rows.get(("horovod", n))
        if impl == "hostreduce" and peer:
            rep["ratios"].append({"np": n, "what": "hostreduce / horovod, examples/s (step time ratio inverted)",
                                  "value": round(peer["step_ms"] / row["step_ms"], 3)})
            rep["ratios"].append({"np": n, "what": "hostreduce / horovod, CPU per rank per step",
                                  "value": round(row["cpu_ms_per_rank"] / peer["cpu_ms_per_rank"], 3)})
    idle = {r["wait"]: r for r in rep["idle"]}
    if "sleep" in idle and "poll" in idle:
        rep["idle_cost_ms"] = round(idle["sleep"]["step_ms"] - idle["poll"]["step_ms"], 3)


def _show(result: dict[str, Any]) -> None:
    if result["jobs"]:
        print(f"\n{'impl':<11} {'N':>2} {'step ms':>8} {'CPU ms':>7}  " + "  ".join(k.split(" (")[0] for k in KINDS)
              + "  switches vol/invol")
        for j in result["jobs"]:
            kinds = "  ".join(f"{j['cpu_ms_by_kind'][k]:.2f}" for k in KINDS)
            sw = j["switches_per_step"]
            print(f"{j['impl']:<11} {j['np']:>2} {j['step_ms']:>8.2f} {j['cpu_ms_per_rank']:>7.2f}  {kinds}  "
                  f"{sw['voluntary']:.1f}/{sw['involuntary']:.1f}")
    for r in result["ratios"]:
        print(f"N={r['np']}: {r['what']} = {r['value']}")
    if result["idle"]:
        print("\nwait in the step   step ms   CPU ms")
        for r in result["idle"]:
            print(f"{r['wait']:<6} {r['wait_ms']:>5.1f} ms  {r['step_ms']:>8.3f} {r['cpu_ms']:>8.3f}")
        if "idle_cost_ms" in result:
            print(f"a sleeping wait costs {result['idle_cost_ms']} ms per step more than a polling one")


def _plot(result: dict[str, Any], path: Path) -> None:
    plt = report.pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2, 1]})
    rows = result["jobs"]
    labels = [f"{j['impl']}\nN={j['np']}" for j in rows]
    bottom = [0.0] * len(rows)
    for kind in KINDS:
        values = [j["cpu_ms_by_kind"][kind] for j in rows]
        ax.bar(labels, values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.plot(labels, [j["step_ms"] for j in rows], "kD", label="step time (ms)")
    ax.set_ylabel("CPU ms per rank per step")
    ax.set_title("fit, MNIST model: where each rank's CPU goes")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    idle = result["idle"]
    if idle:
        xs = [f"{r['wait']}\n{r['wait_ms']:g} ms" for r in idle]
        bx.bar(xs, [r["step_ms"] for r in idle], label="step time")
        bx.plot(xs, [r["cpu_ms"] for r in idle], "kD", label="CPU per step")
        bx.set_ylabel("ms")
        bx.set_title("a wait inside the step: sleep vs poll")
        bx.legend(fontsize=7)
        bx.grid(True, axis="y", alpha=0.3)
    report.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="jobs,idle", help="comma-separated, of jobs,idle")
    p.add_argument("--impl", default=",".join(IMPLS), help=f"comma-separated, of {','.join(IMPLS)}")
    p.add_argument("--np", help="comma-separated world sizes (default 2,4; --quick: 2)")
    p.add_argument("--steps", type=int, help="timed steps (default 1500; --quick: 60)")
    p.add_argument("--wait-ms", type=float, default=1.0, help="the idle part's wait (default 1 ms)")
    p.add_argument("--quick", action="store_true", help="smoke run")
    p.add_argument("--job-timeout", type=float, default=300.0, help="wall-clock limit of one run (s)")
    cli.add_run_options(p, workers=("hostreduce", "horovod", "idle"))
    args = p.parse_args(argv)
    if args.worker:
        if args.worker == "idle":
            return jobs.run_worker(args, lambda plan, workdir: _idle_worker(plan, args.rank, workdir))
        return jobs.run_worker(args, lambda plan, workdir: _fit_worker(args.worker, plan, workdir))

    parts = cli.parse_choices(p, "--parts", args.parts, ["jobs", "idle"])
    impls = cli.parse_choices(p, "--impl", args.impl, list(IMPLS))
    nps = cli.parse_np(p, args.np, [2] if args.quick else [2, 4], netcluster=False)
    steps = args.steps or (60 if args.quick else 1500)
    if steps < 2 or args.wait_ms <= 0:
        p.error(f"--steps must be at least 2 and --wait-ms positive. Received: --steps {steps} "
                f"--wait-ms {args.wait_ms}")
    plan = {"cores": report.cores(), "inter_op_threads": 2, "large_hidden": 1792, "batch": 64,
            "warmup": {"mnist": 5}, "steps": {"mnist": steps}, "wait_ms": args.wait_ms, "waits": list(WAITS)}
    rep = report.Report(args.out, "step_profile", "step_profile",
                        "fit of a small model (MNIST): per-thread CPU and context switches per step, hostreduce vs "
                        "Horovod, same run; and what a sleeping wait inside a step costs against a polling one",
                        packages=("numpy", "grpcio", "tensorflow", "keras", "tf_keras", "horovod"),
                        environment_extra={"load_wait": report.wait_for_quiet(args.max_load, args.max_wait_s)},
                        settings={"parts": parts, "impls": {k: LABELS[k] for k in impls}, "np": nps, "steps": steps,
                                  "batch": plan["batch"], "wait_ms": args.wait_ms, "quick": args.quick,
                                  "kinds": list(KINDS),
                                  "definitions": {
                                      "step_ms": "median step of the slowest rank (end_to_end.py's step timer)",
                                      "cpu_ms_by_kind": "CPU of each kind of thread over the timed steps, per step, "
                                                        "mean over ranks (from /proc/self/task)",
                                      "cpu_bound_ms": "cpu_ms_per_rank * max(1, N / cores): the shortest step the "
                                                      "cores allow",
                                      "idle_cost_ms": "step_ms with a sleeping wait - step_ms with a polling wait "
                                                      "of the same length, two processes at once"}},
                        runs={}, skipped={}, jobs=[], ratios=[], idle=[])
    rep.announce(f"step_profile: {', '.join(parts)}")
    with workroot("step_profile", args.keep_workdir) as root:
        if "jobs" in parts:
            _run_jobs(rep, plan, impls, nps, root, args.job_timeout)
        if "idle" in parts:
            _run_idle(rep, plan, root, args.job_timeout)
    _findings(rep)
    rep.close(plot=lambda path: _plot(rep.result, path), no_plot=args.no_plot, show=lambda: _show(rep.result))
    return report.exit_status(rep["runs"])


if __name__ == "__main__":
    sys.exit(main())
