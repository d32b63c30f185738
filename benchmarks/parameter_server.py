#!/usr/bin/env python
"""Parameter-server training of the recommender example: hostreduce's ps (sync and async)
against TensorFlow's ParameterServerStrategy and against dense all-reduce, same model.

    python benchmarks/parameter_server.py                    # table 1M x 64, batch 512 (~5 min on 2 cores)
    python benchmarks/parameter_server.py --vocab 4000000    # the example's default table (4M x 64, 1 GB)
    python benchmarks/parameter_server.py --quick            # smoke run: tiny tables, few steps (< 60 s)

The model is ``examples/recommender/wide_deep.py``: a deep embedding table of
``vocab x dim`` float32 and a wide one of ``vocab x 1``, looked up by 8 fields per
example, an MLP 256-128-1 over the deep rows and 13 numeric features, Adam
(learning rate 1e-3). Every worker trains ``--batch`` examples per step from the
example's synthetic click stream (same generator everywhere). The modes:

| mode | what runs |
|---|---|
| ``sync`` | hostreduce ``ParameterServerStrategy(sync=True, sparse="lazy")``: 2 ps + 2 training tasks (the chief is worker 0), the example's ``model_fn`` under hostreduce's Estimator; each step pulls the batch's rows and the dense variables, pushes the gradients, and the ps average the two workers' gradients and apply once |
| ``async`` | the same with ``sync=False``: each push applied on arrival |
| ``tf`` | TensorFlow's ``tf.distribute.experimental.ParameterServerStrategy`` + ``ClusterCoordinator``: 2 ps + 2 worker tasks running ``tf.distribute.Server`` and a coordinator process; the same model in plain TF (``tf.Variable``, ``tf.nn.embedding_lookup``), variables of 4 MiB and more split over both ps by ``MinSizePartitioner`` (hostreduce's placement rule); Adam applied on the ps (``tf.device`` of each variable) to the batch's distinct rows only, duplicates summed on the worker first: the arithmetic of hostreduce's ``sparse="lazy"`` Adam. Asynchronous by design (each worker's step applies its own gradients) |
| ``allreduce`` | dense data parallelism: hostreduce's ring ``MultiWorkerStrategy`` (gRPC data path, so its bytes are visible on sockets), 2 workers, each holding the whole model; the tables' gradients are all-reduced densely and Keras's Adam updates every row on each worker's host. Run at ``--allreduce-vocab`` (a table that two workers can hold and reduce each step) |
| ``sync@A`` | ``sync`` again at ``--allreduce-vocab``, the like-for-like peer of ``allreduce`` |

Figures:

* ``examples/s``: examples trained per second over the timed window, after
  ``--warmup`` steps per worker: for hostreduce, the sum over workers of
  ``steps x batch / window``; for TF, ``steps x workers x batch / window`` measured by
  the coordinator (it schedules as many batches as the two hostreduce workers train).
* ``bytes/step``: what one worker sends plus receives per step of ``--batch``
  examples, over every TCP socket of the worker process, read from the kernel
  (``ss -tinp``: bytes acknowledged + bytes received) before and after the window,
  summed over workers and divided by the steps they trained: the same measure for
  both systems, protocol framing included. For hostreduce the ps client's own byte
  counters (the packed messages, without gRPC framing) are reported too, and the
  part of them that carries the tables' rows (``PullRows`` and the rows in ``Push``)
  is compared with the table's size.
* memory: the peak VmRSS of every process of each job, sampled every 0.5 s.

All processes share this machine's cores (2 here, for 4-5 processes): every figure is
bounded by CPU time, not by the network; the JSON records the load average around
each job. Results: ``<out>/parameter_server.json`` and ``.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import cli, jobs, peers, placement, report  # noqa: E402

MODES = ("sync", "async", "tf", "allreduce", "sync@A")
DETAILS = {
    "sync": "hostreduce ParameterServerStrategy(sync=True, sparse='lazy'), 2 ps + 2 workers, Estimator",
    "async": "hostreduce ParameterServerStrategy(sync=False, sparse='lazy'), 2 ps + 2 workers, Estimator",
    "tf": "tf.distribute.experimental.ParameterServerStrategy + ClusterCoordinator, 2 ps + 2 workers + coordinator, "
          "MinSizePartitioner(4 MiB, 2 shards), lazy Adam on the ps",
    "allreduce": "hostreduce MultiWorkerStrategy (ring, gRPC data path), 2 workers, dense gradients, Keras Adam on "
                 "each worker's host",
    "sync@A": "hostreduce sync at the all-reduce table size",
}
TARGET_SPARSE_FRACTION = 0.01  # rows' bytes per step / table bytes, batch 512
TARGET_RATIO = 1.0             # sync examples/s / tf examples/s


# =========================================================================== jobs


# The chief registers a large table on the ps (tens of seconds at 4M rows on a busy machine)
# while the other worker waits in a collective: more than the default 30 s.
ENV = {"HOSTREDUCE_TRANSPORT": "grpc", "HOSTREDUCE_TIMEOUT_S": "180"}


def _layout(mode: str, ps: int, workers: int) -> tuple[peers.Peer, list[tuple[str, int]], Any]:
    """The peer of ``mode``, its tasks in start order, and each task's role (``--role``)."""
    if mode == "allreduce":
        return peers.HOSTREDUCE_RING, [], lambda rank: f"worker{rank}"
    if mode == "tf":  # the chief is the coordinator
        layout = [("ps", i) for i in range(ps)] + [("worker", i) for i in range(workers)] + [("chief", 0)]
        return peers.TF_PS, layout, lambda t: "coordinator" if t[0] == "chief" else f"{t[0]}{t[1]}"
    # hostreduce: the chief is worker 0
    layout = [("ps", i) for i in range(ps)] + [("chief", 0)] + [("worker", i) for i in range(workers - 1)]
    return peers.HOSTREDUCE_PS, layout, lambda t: f"ps{t[1]}" if t[0] == "ps" else f"worker{t[1] + (t[0] == 'worker')}"


def _measure(cell: dict, plan: dict, workdir: Path) -> dict[str, Any]:
    """examples/s and bytes/step of a finished job from its records."""
    batch = plan["batch"]
    if cell["mode"] == "tf":
        rec = json.loads((workdir / "coordinator.json").read_text())
        socket = sum(rec["socket_end"][k] - rec["socket_start"][k] for k in rec["socket_start"])
        return {"examples_per_s": round(rec["steps"] * batch / rec["seconds"], 1),
                "step_ms": round(rec["seconds"] / rec["steps"] * plan["workers"] * 1e3, 2),
                "socket_bytes_per_step": round(socket / rec["steps"]), "steps_timed": rec["steps"],
                "loss_first_last": [round(rec["first_loss"], 4), round(rec["last_loss"], 4)],
                "placement": rec["placement"]}
    recs = [json.loads(f.read_text()) for f in sorted(workdir.glob("rank*.json"))]
    if len(recs) != plan["workers"]:
        raise RuntimeError(f"{len(recs)} of {plan['workers']} workers wrote a record")
    steps = sum(r["steps"] for r in recs)
    out: dict[str, Any] = {
        "examples_per_s": round(sum(r["steps"] * batch / r["seconds"] for r in recs), 1),
        "step_ms": round(statistics.mean(r["seconds"] / r["steps"] for r in recs) * 1e3, 2),
        "socket_bytes_per_step": round(sum(r["end"]["socket"] - r["start"]["socket"] for r in recs) / steps),
        "steps_timed": steps,
        "loss_first_last": [round(statistics.mean(r["first_loss"] for r in recs), 4),
                            round(statistics.mean(r["last_loss"] for r in recs), 4)]}
    if cell["mode"] != "allreduce":
        by_method: dict[str, float] = {}
        for r in recs:
            for side in ("client_sent", "client_received"):
                for method, n in r["end"][side].items():
                    by_method[f"{method} {side[7:]}"] = by_method.get(f"{method} {side[7:]}", 0) + \
                        n - r["start"][side].get(method, 0)
        out["client_bytes_per_step"] = round(sum(by_method.values()) / steps)
        out["client_bytes_per_step_by_method"] = {k: round(v / steps) for k, v in sorted(by_method.items()) if v}
    return out


def _run(cell: dict, plan: dict, workroot: Path, result: dict, timeout_s: float) -> dict | None:
    workdir = workroot / cell["name"].replace("@", "-at-")
    plan_path = jobs.write_plan(workdir / "plan.json", {**plan, "cells": {cell["name"]: cell}})
    peer, layout, role = _layout(cell["mode"], plan["ps"], plan["workers"])
    argv = lambda slot: jobs.worker_argv(__file__, "--role", role(slot), "--cell", cell["name"],  # noqa: E731
                                         plan=plan_path, workdir=workdir)
    env = {**ENV, **({"PS_BENCH_TIMEOUT_S": str(int(timeout_s))} if cell["mode"] == "tf" else {})}
    run = peers.run(peer, placement.Loopback(), plan["workers"], argv, workdir, timeout_s, env=env, layout=layout,
                    info={"mode": cell["mode"], "vocab": cell["vocab"]}, rss=True)
    info = run.info
    row = None
    if run.ok:
        try:
            row = {"mode": cell["name"], "vocab": cell["vocab"], **_measure(cell, plan, workdir)}
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            run.fail(f"{type(exc).__name__}: {exc}")
    result["runs"][cell["name"]] = info
    run.say(f"{cell['name']:>9} (table {cell['vocab']:,} rows)", f"{run.seconds:.1f} s")
    if row is not None:
        row["peak_rss_mb"] = info["peak_rss_mb"]
    return row


# =========================================================================== report


def _table_bytes(vocab: int, dim: int) -> int:
    return vocab * (dim + 1) * 4  # the deep table and the wide one


def _rows_per_step(row: dict) -> int | None:
    """Bytes per worker step that carry the tables' rows (client counters): the
    PullRows replies and the Push requests less the dense gradients they carry."""
    m = row.get("client_bytes_per_step_by_method")
    if not m:
        return None
    return int(m.get("PullRows received", 0) + m.get("PullRows sent", 0) + m.get("Push sent", 0)
               - m.get("PullDense received", 0))  # a push carries the dense gradients too: as many bytes as pulled


def _report(rows: list[dict], plan: dict) -> tuple[list[dict], list[dict]]:
    index = {r["mode"]: r for r in rows}
    ratios, targets = [], []
    tf = index.get("tf")
    for mode in ("sync", "async"):
        if mode in index and tf:
            ratios.append({"what": f"{mode} / tf examples/s",
                           "value": round(index[mode]["examples_per_s"] / tf["examples_per_s"], 3)})
            ratios.append({"what": f"{mode} / tf bytes per step (sockets)",
                           "value": round(index[mode]["socket_bytes_per_step"] / tf["socket_bytes_per_step"], 3)})
    if "sync@A" in index and "allreduce" in index:
        ratios.append({"what": "sync / allreduce examples/s at the all-reduce table size",
                       "value": round(index["sync@A"]["examples_per_s"] / index["allreduce"]["examples_per_s"], 3)})
    if "sync" in index:
        r = index["sync"]
        sparse = _rows_per_step(r)
        table = _table_bytes(r["vocab"], plan["dim"])
        r["sparse_bytes_per_step"] = sparse
        r["table_bytes"] = table
        if sparse is not None:
            v = round(sparse / table, 6)
            targets.append({"what": f"sync: bytes per worker step carrying the tables' rows / tables' bytes, batch "
                                    f"{plan['batch']}", "value": v, "goal": f"<= {TARGET_SPARSE_FRACTION}",
                            "met": v <= TARGET_SPARSE_FRACTION, "binding": plan["batch"] == 512})
        v = round(r["socket_bytes_per_step"] / table, 6)
        targets.append({"what": "sync: all bytes per worker step on the sockets (dense variables, framing, "
                                "the ring's control messages included) / tables' bytes", "value": v,
                        "goal": f"<= {TARGET_SPARSE_FRACTION}", "met": v <= TARGET_SPARSE_FRACTION,
                        "binding": False})
        if tf:
            v = round(r["examples_per_s"] / tf["examples_per_s"], 3)
            targets.append({"what": "sync / tf (ParameterServerStrategy) examples/s", "value": v,
                            "goal": f">= {TARGET_RATIO}", "met": v >= TARGET_RATIO, "binding": True})
    return ratios, targets


def _print(rows: list[dict], ratios: list[dict], targets: list[dict], plan: dict) -> None:
    print(f"\nbatch {plan['batch']} per worker, {plan['workers']} workers, {plan['ps']} ps, dim {plan['dim']}, "
          f"{plan['steps']} timed steps per worker after {plan['warmup']}")
    head = (f"  {'mode':>9} {'table rows':>11} | {'examples/s':>10} {'step ms':>8} | {'bytes/step':>11} "
            f"{'client B/step':>13} {'rows B/step':>11} | peak RSS MB")
    print(head)
    print("  " + "-" * (len(head) - 2))
    for r in rows:
        client = r.get("client_bytes_per_step")
        sparse = _rows_per_step(r)
        print(f"  {r['mode']:>9} {r['vocab']:>11,} | {r['examples_per_s']:>10.1f} {r['step_ms']:>8.1f} | "
              f"{r['socket_bytes_per_step']:>11,} {client if client is not None else '-':>13} "
              f"{sparse if sparse is not None else '-':>11} | "
              + ", ".join(f"{k} {v:.0f}" for k, v in r["peak_rss_mb"].items()))
    for r in ratios:
        print(f"  {r['what']}: {r['value']}")
    for t in targets:
        print(f"  target {t['what']}: {t['value']} (goal {t['goal']}: {'met' if t['met'] else 'NOT met'})")


def _plot(path: Path, rows: list[dict], plan: dict) -> None:
    plt = report.pyplot()
    labels = [f"{r['mode']}\n{r['vocab'] / 1e6:g}M rows" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    axes[0].bar(labels, [r["examples_per_s"] for r in rows], color="tab:blue")
    axes[0].set_ylabel("examples/s (all workers)")
    axes[0].set_title("throughput, after warm-up")
    axes[1].bar(labels, [r["socket_bytes_per_step"] for r in rows], color="tab:orange")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("bytes per worker step (TCP, sent + received)")
    axes[1].set_title("traffic per step")
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"recommender, dim {plan['dim']}, batch {plan['batch']}/worker, {plan['ps']} ps + {plan['workers']} "
                 f"workers on {os.cpu_count()} shared cores")
    report.save_figure(fig, path)


# =========================================================================== main


def _task(role: str, cell_name: str, plan: dict, workdir: Path) -> None:
    from benchmarks.impls import ps_tasks as T

    cell = plan["cells"][cell_name]
    if cell["mode"] != "tf":
        T.hostreduce_task(plan, cell, workdir)  # a ps task ends its process with SystemExit(0) when the job ends
    elif role == "coordinator":
        try:
            T.tf_coordinator_task(plan, cell, workdir)
        finally:
            (workdir / "done").write_text("")  # the servers end once they see it
        sys.stdout.flush()
        os._exit(0)  # the coordinator's threads would keep the process alive
    else:
        T.tf_server_task(workdir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated among {','.join(MODES)}")
    p.add_argument("--vocab", type=int, default=None, help="table rows (default 1,000,000; --quick: 20,000)")
    p.add_argument("--allreduce-vocab", type=int, default=None,
                   help="table rows of the all-reduce comparison (default 100,000; --quick: 5,000)")
    p.add_argument("--dim", type=int, default=None, help="embedding width (default 64; --quick: 8)")
    p.add_argument("--batch", type=int, default=512, help="examples per worker per step")
    p.add_argument("--steps", type=int, default=None, help="timed steps per worker (default 100; --quick: 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per worker first (default 10; --quick: 3)")
    p.add_argument("--threads", type=int, default=1, help="TF intra-op threads of every process (default 1)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny tables, few steps")
    p.add_argument("--job-timeout", type=float, default=None, help="seconds per job (default 600; --quick: 150)")
    p.add_argument("--name", default="parameter_server", help="results file stem")
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--cell", help=argparse.SUPPRESS)
    cli.add_run_options(p)
    args = p.parse_args(argv)
    if args.worker:
        return jobs.run_worker(args, lambda plan, workdir: _task(args.role, args.cell, plan, workdir), label=args.role,
                               watchdog=False)
    modes = cli.parse_choices(p, "--modes", args.modes, MODES)
    q = args.quick
    vocab = args.vocab or (20_000 if q else 1_000_000)
    small = args.allreduce_vocab or (5_000 if q else 100_000)
    plan = {"ps": 2, "workers": 2, "dim": args.dim or (8 if q else 64), "batch": args.batch,
            "steps": args.steps or (5 if q else 100), "warmup": args.warmup or (3 if q else 10),
            "intra_op_threads": args.threads, "inter_op_threads": 2,
            # Variables of this size and more are split over the ps, by both systems: the
            # quick run's deep table (640 KB), not its dense layers (at most 131 KB), which a
            # worker must hold whole.
            "shard_bytes": 256 << 10 if q else 4 << 20}
    for key in ("dim", "batch", "steps", "warmup"):
        if plan[key] < 1:
            p.error(f"--{key} must be >= 1. Received: {plan[key]}")
    cells = [{"name": m, "mode": m.split("@")[0], "vocab": small if m in ("allreduce", "sync@A") else vocab}
             for m in MODES if m in modes]
    timeout_s = args.job_timeout or (150.0 if q else 600.0)
    quiet = report.wait_for_quiet(args.max_load, args.max_wait_s)
    rep = report.Report(
        args.out, args.name, "parameter_server",
        "examples/s and bytes per worker step of the recommender example (wide-and-deep, Adam) under "
        "hostreduce's parameter servers (sync, async), TensorFlow's ParameterServerStrategy and dense "
        "all-reduce; every process on this machine's shared cores (CPU-bound figures)",
        packages=("tensorflow", "keras", "grpcio"), environment_extra={"load_wait": quiet},
        settings={**plan, "vocab": vocab, "allreduce_vocab": small, "modes": {c["name"]: DETAILS[c["name"]]
                                                                           for c in cells},
                  "quick": q, "table_bytes": _table_bytes(vocab, plan["dim"]),
                  "bytes_measure": "per worker: TCP bytes acknowledged + received on the worker process's sockets "
                                   "(ss -tinp), summed over workers / steps they trained; hostreduce also: the ps "
                                   "client's packed message bytes"},
        runs={}, measurements=[])
    result = rep.result
    with jobs.workroot("ps-bench-", args.keep_workdir) as workroot:
        print(f"parameter_server: modes {', '.join(c['name'] for c in cells)}; workdir {workroot}", flush=True)
        for cell in cells:
            row = _run(cell, plan, workroot, result, timeout_s)
            if row is not None:
                result["measurements"].append(row)
    rows = result["measurements"]
    result["ratios"], result["targets"] = _report(rows, plan)
    rep.close(plot=(lambda path: _plot(path, rows, plan)) if rows else None, no_plot=args.no_plot,
              show=lambda: _print(rows, result["ratios"], result["targets"], plan), wall=False)
    return report.exit_status(result["runs"])


if __name__ == "__main__":
    sys.exit(main())
