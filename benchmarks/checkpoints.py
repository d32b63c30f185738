#!/usr/bin/env python
"""What checkpoints cost the MNIST example's training: this tree against the last
release that wrote the old checkpoint files, same run.

    python benchmarks/checkpoints.py                 # 600 timed steps, 3 rounds (~6 min on 2 cores)
    python benchmarks/checkpoints.py --quick         # smoke run: 40 steps, 1 round, no old checkout

The MNIST example's model, input and optimizer (``examples/mnist/train.py``: its
``model_fn``, ``make_input_fn`` and data, global batch 64, Adam on the host) train on 2
workers over the ring (``MultiWorkerStrategy``, ``TF_CONFIG`` on loopback ports), each
configuration a job of its own:

| row | what runs |
|---|---|
| ``none`` | this tree, no ``model_dir`` (no checkpoints) |
| ``default`` | this tree, a ``model_dir`` and the default interval (the one save at the end of ``train()``) |
| ``every2`` | this tree, ``save_checkpoints_steps=2`` |
| ``every2-buffer`` | the same with the example's earlier input, a shuffle buffer of the whole shard (``ds.shuffle(n)``), whose contents every checkpoint's input position holds |
| ``old-every2`` | the old release (``--old-commit``, extracted with ``git archive`` into the run's work directory and removed with it), ``save_checkpoints_steps=2``; its own example, same venv |
| ``old-none`` | the old release without checkpoints (whether the trees differ apart from the checkpoints) |

Two diagnostic rows show what the input positions cost a save (named with ``--rows``;
not part of the default set). Both change the tree under test inside the benchmark's
worker only, through the names ``hostreduce.estimator.checkpointing`` imports; no user
setting does this:

| row | what runs |
|---|---|
| ``every2-no-state`` | ``every2`` with the iterator's state left out (as for an input that cannot be checkpointed); the all-gather of the positions still runs |
| ``every2-no-positions`` | ``every2`` with neither the iterator's state nor its all-gather: a save is the variables alone, as in the old release |

A row's rate is steps/s from the end of its warm-up steps to the return of ``train()``
(its last save included, and, for this tree, the wait for its background write), on the
chief. Rows run in a rotating order, ``--rounds`` times; a row's figure is its median
over rounds (every round is in the JSON). Each save is timed on every rank: ``blocking``
is the time inside the Estimator's save call (the step waits for it), ``write`` the time
of the chief's file write (``CheckpointManager.save``; in the background for this tree,
inside ``blocking`` for the old release), and the bytes are those of the last
checkpoint's directory (variables, input positions, metadata).

Each rank also reports its process's CPU per timed step (every thread, user and system)
and the same by thread name; ``cpu_ms_per_save`` is what a save adds to both workers'
CPU (the CPU per step of a saving row over its row without checkpoints, times 2): on 2
cores shared by 2 workers, CPU a save costs is time the steps lose.

Ratios: ``every2 / old-every2`` (target >= 1) and ``default / none`` (target >= 0.95),
of the rows' medians; ``ratios_by_round`` gives each round's ratio (its rows ran one
after the other) and their median. Results go to ``<out>/checkpoints.json`` and ``.png``.
"""
from __future__ import annotations

import os
import sys

OLD_COMMIT = "2137bef969878a21c972902271c10c8ada9954a1"  # the last commit writing variables.npz checkpoints


# --------------------------------------------------------------------------- worker (standard library +
# the tree under test: the old release has none of the harness's imports, so the worker uses none of them)


def _worker_main(argv: list[str]) -> int:
    import argparse
    import faulthandler
    import json
    import traceback
    from pathlib import Path

    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--plan")
    p.add_argument("--workdir")
    p.add_argument("--rank", type=int)
    args = p.parse_args(argv)
    plan, workdir = json.loads(Path(args.plan).read_text()), Path(args.workdir)
    faulthandler.dump_traceback_later(plan["worker_timeout_s"], exit=True)
    (workdir / f"pid.{args.rank}").write_text(str(os.getpid()))
    try:
        _train(plan, workdir, args.rank)
    except BaseException as exc:
        (workdir / f"error.{args.rank}").write_text(f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}")
        return 3
    faulthandler.cancel_dump_traceback_later()
    return 0


def _train(plan: dict, workdir, rank: int) -> None:
    import json
    import statistics
    import threading
    import time

    tree = plan["tree"]
    sys.path[:0] = [tree, os.path.join(tree, "examples", "mnist")]
    import train as example  # the tree's own MNIST example

    (x, y), _ = example.load_data(None)
    import keras

    import hostreduce
    from hostreduce.estimator import Estimator, RunConfig
    from hostreduce.estimator import checkpoint as files

    assert os.path.dirname(os.path.dirname(os.path.abspath(hostreduce.__file__))) == os.path.abspath(tree), \
        f"hostreduce imported from {hostreduce.__file__}, not from {tree}"
    keras.utils.set_random_seed(0)
    strategy = example.make_strategy("ring", True)
    model_dir = os.path.join(workdir, "model_dir") if plan["model_dir"] else None
    config = RunConfig(train_distribute=strategy, model_dir=model_dir, save_checkpoints_steps=plan["save_steps"],
                       log_step_count_steps=None)
    est = Estimator(example.model_fn, config=config, params={"learning_rate": 2e-3})

    blocking: dict[int, float] = {}  # step -> seconds its save calls took
    writes: list[tuple[float, bool]] = []
    save = est._save

    def timed_save(*a, **k):  # the Estimator's save calls: what the step waits for
        t0 = time.perf_counter()
        try:
            return save(*a, **k)
        finally:  # (the end of train() calls it again at a step just saved)
            blocking[est.global_step] = blocking.get(est.global_step, 0.0) + time.perf_counter() - t0

    est._save = timed_save
    write = files.CheckpointManager.save

    def timed_write(self, *a, **k):  # the chief's files, on whichever thread writes them
        t0 = time.perf_counter()
        try:
            return write(self, *a, **k)
        finally:
            writes.append((time.perf_counter() - t0, threading.current_thread() is not threading.main_thread()))

    files.CheckpointManager.save = timed_write
    warmup, steps = plan["warmup"], plan["warmup"] + plan["steps"]
    marks: dict[str, float] = {}

    def hook(step: int, _loss: float) -> None:
        if step == warmup:
            marks["t0"], marks["cpu0"], marks["threads0"] = time.perf_counter(), _cpu_s(), _thread_cpu_s()

    if plan.get("positions", "all") != "all":
        _leave_out_positions(plan["positions"])
    input_fn = (_buffer_input_fn if plan["input"] == "buffer" else example.make_input_fn)(x, y, plan["batch"], True, 0)
    est.train(input_fn, max_steps=steps, hooks=[hook])
    t1, cpu1, threads1 = time.perf_counter(), _cpu_s(), _thread_cpu_s()
    timed = [seconds for step, seconds in blocking.items() if step >= warmup]
    record = {"kind": "train", "rank": rank, "row": plan["row"], "steps": plan["steps"],
              "steps_per_s": round(plan["steps"] / (t1 - marks["t0"]), 3), "saves": len(timed),
              "cpu_ms_per_step": round((cpu1 - marks["cpu0"]) / plan["steps"] * 1e3, 3),
              "cpu_ms_per_step_by_thread": _per_step(marks["threads0"], threads1, plan["steps"]),
              "blocking_ms_median": round(statistics.median(timed) * 1e3, 3) if timed else None,
              "blocking_ms_total": round(sum(timed) * 1e3, 1)}
    if writes:
        record.update(write_ms_median=round(statistics.median(w for w, _ in writes) * 1e3, 3),
                      write_in_background=all(bg for _, bg in writes))
    if model_dir and strategy.is_chief:
        latest = max(d for d in os.listdir(model_dir) if d.startswith("ckpt-"))
        sizes = {f: os.path.getsize(os.path.join(model_dir, latest, f)) for f in os.listdir(os.path.join(model_dir, latest))}
        record.update(checkpoint_bytes=sum(sizes.values()),
                      input_bytes=sum(v for f, v in sizes.items() if f.startswith("input-")),
                      checkpoint_files=sorted(sizes))
    with open(os.path.join(workdir, f"rank{rank}.jsonl"), "a") as out:
        out.write(json.dumps(record) + "\n")
    est.close()


def _leave_out_positions(what: str) -> None:
    """The diagnostic rows: a save without the iterator's state (``"no-state"``), or
    without it and its all-gather (``"none"``)."""
    from hostreduce.errors import InputNotCheckpointable
    from hostreduce.estimator import checkpointing

    def no_state(iterator):
        raise InputNotCheckpointable("left out by the benchmark's diagnostic row")

    checkpointing.save_iterator = no_state
    if what == "none":
        checkpointing.start_gather = lambda reducer, blob, name: (lambda: [None] * reducer.size)


def _cpu_s() -> float:
    """This process's CPU time so far (every thread, user and system)."""
    times = os.times()
    return times.user + times.system


def _thread_cpu_s() -> dict[str, float]:
    """CPU time so far of each live thread of this process, by name (Python's thread
    names where Python started the thread, else the kernel's; same names summed)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    found: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # (ended meanwhile)
        fields = stat[stat.rindex(")") + 2:].split()
        name = names.get(int(tid)) or stat[stat.index("(") + 1:stat.rindex(")")]
        name = name.rstrip("0123456789_-")
        found[name] = found.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return found


def _per_step(before: dict[str, float], after: dict[str, float], steps: int) -> dict[str, float]:
    """CPU ms per step of each thread name between two :func:`_thread_cpu_s` (threads that
    ended before the second are missing)."""
    out = {n: round((after[n] - before.get(n, 0.0)) / steps * 1e3, 3) for n in after}
    return dict(sorted(((n, v) for n, v in out.items() if v > 0), key=lambda kv: -kv[1]))


def _buffer_input_fn(x, y, global_batch: int, training: bool, seed: int):
    """The MNIST example's input before its index shuffle: a shuffle buffer of the shard."""
    import tensorflow as tf

    def input_fn(mode, input_context=None):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        batch = global_batch
        if input_context is not None and input_context.num_input_pipelines > 1:
            ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
            batch = input_context.get_per_replica_batch_size(global_batch)
        ds = ds.shuffle(len(x), seed=seed, reshuffle_each_iteration=True).repeat()
        return ds.batch(batch, drop_remainder=True).prefetch(2)

    return input_fn


if __name__ == "__main__" and "--worker" in sys.argv:
    sys.exit(_worker_main(sys.argv[1:]))

# --------------------------------------------------------------------------- coordinator

import argparse  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import cli, jobs, peers, report  # noqa: E402
from benchmarks.harness import placement as P  # noqa: E402
from benchmarks.harness.jobs import REPO_ROOT, workroot  # noqa: E402

ROWS = {  # tree, model_dir, save_checkpoints_steps, input[, input positions]
    "none": ("new", False, None, "example"),
    "default": ("new", True, None, "example"),
    "every2": ("new", True, 2, "example"),
    "every2-buffer": ("new", True, 2, "buffer"),
    "old-every2": ("old", True, 2, "example"),
    "old-none": ("old", False, None, "example"),
}
DIAGNOSTIC_ROWS = {  # named with --rows only
    "every2-no-state": ("new", True, 2, "example", "no-state"),
    "every2-no-positions": ("new", True, 2, "example", "none"),
}
ALL_ROWS = {**ROWS, **DIAGNOSTIC_ROWS}
TARGETS = {"every2 / old-every2": 1.0, "default / none": 0.95}


def _resolve(commit: str) -> str:
    """``commit``'s full hash (a name such as ``HEAD`` moves), or ``commit`` where git
    cannot tell."""
    found = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--verify", "-q", f"{commit}^{{commit}}"],
                           capture_output=True, text=True)
    return found.stdout.strip() or commit


def _old_tree(root: Path, commit: str) -> Path:
    """The old release's files, from this repository's history (removed with ``root``)."""
    tree = root / "old-tree"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", "--format=tar", commit],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def _run_row(rep: report.Report, row: str, rnd: int, tree: Path, plan: dict, root: Path, timeout_s: float) -> None:
    _, model_dir, save_steps, input_kind, *positions = ALL_ROWS[row]
    workdir = root / f"{row}-r{rnd}"
    plan_path = jobs.write_plan(workdir / "plan.json", {**plan, "row": row, "tree": str(tree), "model_dir": model_dir,
                                                        "save_steps": save_steps, "input": input_kind,
                                                        "positions": positions[0] if positions else "all", "worker_timeout_s": timeout_s - 10})
    argv = lambda rank: jobs.worker_argv(__file__, plan=plan_path, workdir=workdir, rank=rank)  # noqa: E731
    # The tree under test alone on the workers' path (the old release for its rows).
    run = peers.run(peers.HOSTREDUCE_RING, P.Loopback(), 2, argv, workdir, timeout_s, env={"PYTHONPATH": str(tree)},
                    cause=True)
    recs = run.records("train")
    if run.ok and len(recs) != 2:
        run.fail(f"{len(recs)} of 2 records written")
    rep["runs"][f"{row}/r{rnd}"] = run.info
    if run.ok:
        rep["measurements"].append({"row": row, "round": rnd, "ranks": sorted(recs, key=lambda r: r["rank"])})
        chief = next(r for r in recs if r["rank"] == 0)
        run.say(f"round {rnd} {row}", f"{chief['steps_per_s']:.1f} steps/s")
    else:
        run.say(f"round {rnd} {row}")
    rep.save()


def _summarize(rep: report.Report) -> None:
    by_row: dict[str, list[dict]] = {}
    for m in rep["measurements"]:
        by_row.setdefault(m["row"], []).append(m)
    rows = {}
    for row, ms in by_row.items():
        chiefs = [m["ranks"][0] for m in ms]
        others = [m["ranks"][1] for m in ms]
        out: dict[str, Any] = {"steps_per_s": round(statistics.median(c["steps_per_s"] for c in chiefs), 2),
                               "rounds": [c["steps_per_s"] for c in chiefs]}
        if all(r.get("cpu_ms_per_step") is not None for r in chiefs + others):
            out["cpu_ms_per_step"] = round(statistics.median(c["cpu_ms_per_step"] + o["cpu_ms_per_step"]
                                                             for c, o in zip(chiefs, others)), 3)
        if ALL_ROWS[row][1]:
            med = lambda rs, k: round(statistics.median(r[k] for r in rs if r.get(k) is not None), 3)  # noqa: E731
            out.update(saves=chiefs[0]["saves"], blocking_ms_chief=med(chiefs, "blocking_ms_median"),
                       blocking_ms_other=med(others, "blocking_ms_median"))
            if chiefs[0].get("write_ms_median") is not None:
                out.update(write_ms=med(chiefs, "write_ms_median"), write_in_background=chiefs[0]["write_in_background"])
            if chiefs[0].get("checkpoint_bytes"):
                out.update(checkpoint_bytes=chiefs[0]["checkpoint_bytes"], input_bytes=chiefs[0]["input_bytes"])
        rows[row] = out
    rep["rows"] = rows
    ratios = {}
    for what in TARGETS:
        a, b = (s.strip() for s in what.split("/"))
        if a in rows and b in rows:
            ratios[what] = round(rows[a]["steps_per_s"] / rows[b]["steps_per_s"], 3)
    rep["ratios"] = ratios
    # The same ratios round by round (the rows of a round run one after the other, so a
    # slow spell of the machine weighs on both sides of a round's ratio).
    by_round = {(m["row"], m["round"]): m["ranks"][0]["steps_per_s"] for m in rep["measurements"]}
    paired = {}
    for what in TARGETS:
        a, b = (s.strip() for s in what.split("/"))
        each = [by_round[(a, r)] / by_round[(b, r)] for (row, r) in by_round if row == a and (b, r) in by_round]
        if each:
            paired[what] = {"median": round(statistics.median(each), 3), "rounds": [round(x, 3) for x in each]}
    rep["ratios_by_round"] = paired
    # What the input positions cost (the diagnostic rows), against the same baseline.
    rep["diagnostic_ratios"] = {f"{a} / old-every2": {
        "value": round(rows[a]["steps_per_s"] / rows["old-every2"]["steps_per_s"], 3),
        "rounds": [round(by_round[(a, r)] / by_round[("old-every2", r)], 3)
                   for (row, r) in by_round if row == a and ("old-every2", r) in by_round]}
        for a in DIAGNOSTIC_ROWS if a in rows and "old-every2" in rows}
    # CPU one save costs: the CPU per step of both workers above the row without
    # checkpoints, times the steps per save.
    cpu = {}
    for saving, plain in (("every2", "none"), ("every2-no-state", "none"), ("every2-no-positions", "none"),
                          ("old-every2", "old-none")):
        if rows.get(saving, {}).get("cpu_ms_per_step") is not None and \
                rows.get(plain, {}).get("cpu_ms_per_step") is not None:
            cpu[saving] = round(2 * (rows[saving]["cpu_ms_per_step"] - rows[plain]["cpu_ms_per_step"]), 3)
    rep["cpu_ms_per_save"] = cpu
    rep["targets"] = [{"what": k, "target": f">= {v}", "value": ratios[k], "met": ratios[k] >= v}
                      for k, v in TARGETS.items() if k in ratios]


def _show(result: dict[str, Any]) -> None:
    print(f"\n{'row':<11} {'steps/s':>8} {'cpu ms':>7} {'rounds':<22} {'saves':>5} {'block ms':>9} {'(rank 1)':>8} "
          f"{'write ms':>9} {'bg':>3} {'bytes':>9} {'input':>8}")
    for row, r in result["rows"].items():
        rounds = ",".join(f"{v:.0f}" for v in r["rounds"])
        extra = ""
        if r.get("saves"):
            extra = (f"{r['saves']:>5} {r['blocking_ms_chief']:>9.2f} {r['blocking_ms_other']:>8.2f} "
                     f"{r.get('write_ms', float('nan')):>9.2f} {'yes' if r.get('write_in_background') else 'no':>3} "
                     f"{r.get('checkpoint_bytes', 0):>9} {r.get('input_bytes', 0):>8}")
        print(f"{row:<11} {r['steps_per_s']:>8.1f} {r.get('cpu_ms_per_step', float('nan')):>7.2f} {rounds:<22} {extra}")
    for t in result["targets"]:
        paired = result.get("ratios_by_round", {}).get(t["what"])
        each = f"; round by round: median {paired['median']} of {paired['rounds']}" if paired else ""
        print(f"{t['what']}: {t['value']} (target {t['target']}: {'met' if t['met'] else 'MISSED'}){each}")
    for what, r in result.get("diagnostic_ratios", {}).items():
        print(f"{what}: {r['value']} (diagnostic; round by round {r['rounds']})")
    for row, ms in result.get("cpu_ms_per_save", {}).items():
        print(f"CPU per save, both workers ({row} over its row without checkpoints): {ms:.2f} ms")


def _plot(result: dict[str, Any], path: Path) -> None:
    plt = report.pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = result["rows"]
    names = list(rows)
    ax.bar(names, [rows[n]["steps_per_s"] for n in names], color=["C0" if not n.startswith("old") else "C7"
                                                                 for n in names])
    for i, n in enumerate(names):
        ax.plot([i] * len(rows[n]["rounds"]), rows[n]["rounds"], "k.", ms=4)
    ax.set_ylabel("steps/s (chief; median of rounds, dots: each round)")
    ax.set_title("MNIST example, 2 workers on the ring")
    ax.grid(True, axis="y", alpha=0.3)
    saving = [n for n in names if rows[n].get("saves")]
    bx.bar([f"{n}\nblocking" for n in saving], [rows[n]["blocking_ms_chief"] for n in saving], color="C3",
           label="blocking (chief's save call)")
    bx.bar([f"{n}\nwrite" for n in saving], [rows[n].get("write_ms", 0.0) for n in saving], color="C2",
           label="file write (background where marked bg)")
    bx.set_ylabel("ms per save (median)")
    bx.set_title("one save")
    bx.tick_params(axis="x", labelsize=7)
    bx.legend(fontsize=7)
    bx.grid(True, axis="y", alpha=0.3)
    report.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", help=f"comma-separated, of {','.join(ALL_ROWS)} (default: {','.join(ROWS)}; "
                                  "--quick: none,every2)")
    p.add_argument("--steps", type=int, help="timed steps per row (default 600; --quick: 40)")
    p.add_argument("--warmup", type=int, default=20, help="steps before the timed ones (default 20)")
    p.add_argument("--rounds", type=int, help="runs of every row, in rotating order (default 3; --quick: 1)")
    p.add_argument("--old-commit", default=OLD_COMMIT, help="the old release (default: the last commit before "
                                                            "checkpoints in TensorFlow's format)")
    p.add_argument("--quick", action="store_true", help="smoke run")
    p.add_argument("--job-timeout", type=float, default=300.0, help="wall-clock limit of one run (s)")
    cli.add_run_options(p)
    args = p.parse_args(argv)
    rows = cli.parse_choices(p, "--rows", args.rows, list(ALL_ROWS)) if args.rows else \
        (["none", "every2"] if args.quick else list(ROWS))
    steps = args.steps or (40 if args.quick else 600)
    rounds = args.rounds or (1 if args.quick else 3)
    if steps < 10 or rounds < 1 or args.warmup < 2:
        p.error(f"--steps must be at least 10, --rounds at least 1 and --warmup at least 2. Received: --steps {steps} "
                f"--rounds {rounds} --warmup {args.warmup}")
    plan = {"steps": steps, "warmup": args.warmup, "batch": 64}
    rep = report.Report(args.out, "checkpoints", "checkpoints",
                        "MNIST example on 2 ring workers: steps/s without checkpoints, with the default interval and "
                        "with a checkpoint every 2 steps, against the old release's checkpoints, same run; one save's "
                        "blocking and background time and bytes",
                        packages=("numpy", "grpcio", "tensorflow", "keras"),
                        environment_extra={"load_wait": report.wait_for_quiet(args.max_load, args.max_wait_s)},
                        settings={"rows": rows, "steps": steps, "warmup": args.warmup, "rounds": rounds,
                                  "batch": plan["batch"], "old_commit": _resolve(args.old_commit), "quick": args.quick,
                                  "definitions": {
                                      "steps_per_s": "chief, timed steps / (train() return - end of warm-up)",
                                      "blocking_ms": "median time of one save call of the Estimator (the step "
                                                     "waits for it), per rank",
                                      "write_ms": "median time of the chief's CheckpointManager.save",
                                      "checkpoint_bytes": "files of the last checkpoint directory"}},
                        runs={}, measurements=[], rows={}, ratios={}, targets=[])
    rep.announce(f"checkpoints: {', '.join(rows)} x {rounds} round(s), {steps} steps")
    with workroot("checkpoints", args.keep_workdir) as root:
        trees = {"new": REPO_ROOT}
        if any(ALL_ROWS[r][0] == "old" for r in rows):
            trees["old"] = _old_tree(root, args.old_commit)
        for rnd in range(rounds):
            order = rows[rnd % len(rows):] + rows[:rnd % len(rows)]
            for row in order:
                _run_row(rep, row, rnd, trees[ALL_ROWS[row][0]], plan, root, args.job_timeout)
    _summarize(rep)
    rep.close(plot=lambda path: _plot(rep.result, path), no_plot=args.no_plot, show=lambda: _show(rep.result))
    return report.exit_status(rep["runs"])


if __name__ == "__main__":
    sys.exit(main())
