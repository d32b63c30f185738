#!/usr/bin/env python
"""The optimizer update on the host: hostreduce's fused apply against Keras 3's own
``apply_gradients``, both on CPU variables inside ``tf.function``, and against the
memory-bandwidth floor measured in the same run.

    python benchmarks/host_apply.py                 # 25.6M parameters, SGD / momentum / Adam
    python benchmarks/host_apply.py --quick         # smoke run: ~0.4M parameters, few reps (< 60 s)
    python benchmarks/host_apply.py --optimizers adam --layouts resnet50 --reps 40

Parameters come in two layouts of the same total: ``resnet50``, the 161 trainable
tensors of ResNet-50 (53 convolution kernels, 53 batch-norm scales and offsets, the
classifier's kernel and bias: 25,557,032 float32), and ``single``, one tensor of that
size. Each implementation gets its own variables (same initial values), optimizer and
``tf.function`` (traced like hostreduce's host step: ``input_signature`` of the
gradients, under ``/CPU:0``); gradients are preallocated tensors.

The floor: a pass over the parameters costs half an ``np.copyto`` of a buffer of the
parameters' size (a copy reads and writes: two passes); SGD touches 3 passes (read p,
read g, write p), momentum 5 (+ read/write the accumulator) and Adam 7 (+ m and v).
``pfloor`` is the same copy split over TF's intra-op threads. The implementations and
the copies are timed interleaved, one step at a time in a rotating order, so that other
work on the machine hits them alike; times are medians over steps, and ratios are
medians over steps of the ratio within each step.
Results go to ``<out>/host_apply.json`` and ``<out>/host_apply.png``.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import cli, report  # noqa: E402
from benchmarks.harness.measure import numel, time_op  # noqa: E402

OPTIMIZERS = ("sgd", "momentum", "adam")
PASSES = {"sgd": 3, "momentum": 5, "adam": 7}  # arrays of parameter size read or written per step
IMPLS = {
    "hostreduce": "hostreduce.host.apply.apply_gradients (fused TF kernels)",
    "keras": "Keras 3 optimizer.apply_gradients in tf.function",
    "numpy": "overlap_engine.py's model of the update: numpy Adam in chunks over TF's intra-op thread count",
}
DEFAULT_IMPLS = ("hostreduce", "keras")
LAYOUTS = ("resnet50", "single")
TARGETS = {"adam_resnet50_max_ratio_to_floor": 1.3, "adam_resnet50_min_speedup_vs_keras": 2.5}


def resnet50_shapes(width_divisor: int = 1) -> list[tuple[int, ...]]:
    """Shapes of ResNet-50's 161 trainable tensors (conv kernels HWIO without bias, each
    followed by its batch norm's scale and offset; then the classifier). With
    ``width_divisor`` d every channel count is divided by d (same tensor count)."""
    def ch(c: int) -> int:
        return max(1, c // width_divisor)

    shapes: list[tuple[int, ...]] = []

    def conv_bn(k: int, cin: int, cout: int) -> None:
        shapes.append((k, k, ch(cin), ch(cout)))
        shapes.extend([(ch(cout),), (ch(cout),)])

    conv_bn(7, 3 * width_divisor, 64)  # the stem sees 3 input channels at any width
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            conv_bn(1, cin, width)
            conv_bn(3, width, width)
            conv_bn(1, width, 4 * width)
            if b == 0:
                conv_bn(1, cin, 4 * width)  # projection shortcut
            cin = 4 * width
    shapes.append((ch(2048), 1000 // width_divisor))
    shapes.append((1000 // width_divisor,))
    return shapes


def copy_bandwidth(nbytes: int, reps: int) -> dict[str, Any]:
    """Memory bandwidth of ``np.copyto`` on buffers of ``nbytes`` (read + write bytes / s)."""
    import numpy as np

    src = np.ones(nbytes // 4, np.float32)
    dst = np.zeros_like(src)
    np.copyto(dst, src)  # pages in, warm
    times = time_op(lambda: np.copyto(dst, src), reps)
    t = statistics.median(times)
    return {"bytes": nbytes, "reps": reps, "median_ms": round(t * 1e3, 4), "min_ms": round(min(times) * 1e3, 4),
            "bandwidth_GBps": round(2 * nbytes / t / 1e9, 3)}


class _Case:
    """One implementation's variables, optimizer and traced step."""

    def __init__(self, impl: str, opt: str, shapes: list[tuple[int, ...]], init: list[Any],
                 grads: list[Any]) -> None:
        import keras
        import tensorflow as tf

        from hostreduce.host.apply import apply_gradients, fused_apply_supported

        self.impl, self.opt, self.grads = impl, opt, grads
        with tf.device("/CPU:0"):
            self.variables = [keras.Variable(v, name=f"w{i}") for i, v in enumerate(init)]
            if opt == "sgd":
                self.optimizer = keras.optimizers.SGD(learning_rate=0.01)
            elif opt == "momentum":
                self.optimizer = keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)
            else:
                self.optimizer = keras.optimizers.Adam(learning_rate=1e-3)
            self.optimizer.build(self.variables)
        self.fused = fused_apply_supported(self.optimizer, self.variables)
        variables, optimizer = self.variables, self.optimizer
        specs = [tf.TensorSpec(s, tf.float32) for s in shapes]
        if impl == "hostreduce":
            def step(*g: Any) -> Any:
                with tf.device("/CPU:0"):
                    apply_gradients(optimizer, zip(g, variables))
                return tf.constant(0)
            self.fn = tf.function(step, input_signature=specs, autograph=False)
        else:
            def step(*g: Any) -> Any:
                with tf.device("/CPU:0"):
                    optimizer.apply_gradients(zip(g, variables))
                return tf.constant(0)
            self.fn = tf.function(step, input_signature=specs)
        t0 = time.perf_counter()
        self.fn.get_concrete_function()
        self.trace_s = time.perf_counter() - t0

    def __call__(self) -> None:
        self.fn(*self.grads)

    def weights(self) -> list[Any]:
        return [v.numpy() for v in self.variables]


class _EngineAdam:
    """``overlap_engine.py``'s host update (numpy, chunked over a thread pool), from zero
    moments; no TensorFlow. Its weights start at zero: it is timed, not compared."""

    def __init__(self, shapes: list[tuple[int, ...]], threads: int) -> None:
        import numpy as np

        from benchmarks.overlap_engine import HostAdam

        self.adam = HostAdam(shapes, threads)
        rng = np.random.default_rng(0)
        self.grads = [rng.standard_normal(s, dtype=np.float32) * 1e-3 for s in shapes]
        self.fused, self.trace_s = None, 0.0

    def __call__(self) -> None:
        self.adam.begin_step()
        for futures in [self.adam.apply(i, g) for i, g in enumerate(self.grads)]:
            for f in futures:
                f.result()


def _measure(opt: str, layout: str, shapes: list[tuple[int, ...]], impls: list[str], reps: int, rounds: int,
             warmup: int, passes: int, seed: int, threads: int) -> list[dict]:
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    init = [(rng.standard_normal(s, dtype=np.float32) * 0.05) for s in shapes]
    with tf.device("/CPU:0"):
        grads = [tf.constant(rng.standard_normal(s, dtype=np.float32) * 1e-3) for s in shapes]
    cases: dict[str, Any] = {i: _Case(i, opt, shapes, init, grads) if i != "numpy" else _EngineAdam(shapes, threads)
                             for i in impls}
    del init
    # One step from identical states: the two must agree (to float32 rounding).
    for case in cases.values():
        case()
    agree = None
    if "hostreduce" in cases and "keras" in cases:
        a, b = (cases[i].weights() for i in ("hostreduce", "keras"))
        agree = max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))
        del a, b
    for case in cases.values():
        time_op(case, warmup)
    # The floor is measured between the implementations' rounds, under the same conditions.
    nparams = sum(numel(s) for s in shapes)
    src = np.ones(nparams, np.float32)
    dst = np.zeros_like(src)
    np.copyto(dst, src)
    copy = lambda: np.copyto(dst, src)  # noqa: E731
    # TF's kernels split large tensors over its intra-op threads; on machines whose memory
    # bandwidth grows with cores, the same copy over as many threads is the tighter floor.
    pool = ThreadPoolExecutor(threads)
    step = -(-nparams // threads)
    parts = [(dst[k * step:(k + 1) * step], src[k * step:(k + 1) * step]) for k in range(threads)]
    copy_parallel = lambda: list(pool.map(lambda ds: np.copyto(*ds), parts))  # noqa: E731
    times: dict[str, list[float]] = {i: [] for i in impls}
    copy_times: list[float] = []
    copy_par_times: list[float] = []
    load_before = report.loadavg()
    # Interleaved one step at a time, in a rotating order: whatever else the machine does
    # hits every implementation and the floor alike, and each repetition gives paired ratios.
    ops: list[tuple[str, Callable[[], Any]]] = [*((i, cases[i]) for i in impls), ("copy", copy),
                                                ("copy_parallel", copy_parallel)]
    series: dict[str, list[float]] = {name: [0.0] * (reps * rounds) for name, _ in ops}
    for k in range(reps * rounds):
        shift = k % len(ops)
        for name, op in ops[shift:] + ops[:shift]:
            series[name][k] = time_op(op, 1)[0]
    times = {i: series[i] for i in impls}
    copy_times, copy_par_times = series["copy"], series["copy_parallel"]
    load_after = report.loadavg()
    pool.shutdown()
    del src, dst, parts
    # A copy reads and writes the parameters' size: two passes.
    pass_ms = statistics.median(copy_times) * 1e3 / 2
    floor_ms = passes * pass_ms
    floor_par_ms = passes * statistics.median(copy_par_times) * 1e3 / 2

    def paired(num: list[float], den: list[float], scale: float = 1.0) -> float:
        return round(statistics.median(a / (b * scale) for a, b in zip(num, den)), 3)

    rows = []
    for i in impls:
        t_ms = statistics.median(times[i]) * 1e3
        rows.append({
            "optimizer": opt, "layout": layout, "impl": i, "tensors": len(shapes),
            "parameters": sum(numel(s) for s in shapes), "fused": cases[i].fused if i == "hostreduce" else None,
            "time_ms": round(t_ms, 3), "min_ms": round(min(times[i]) * 1e3, 3),
            # Ratios: median over repetitions of the ratio within each repetition.
            "floor_ms": round(floor_ms, 3), "ratio_to_floor": paired(times[i], copy_times, passes / 2),
            "ratio_of_medians_to_floor": round(t_ms / floor_ms, 3),
            "copy_bandwidth_GBps": round(4 * nparams * 2 / (pass_ms * 2e-3) / 1e9, 3),
            "copy_times_ms": [round(t * 1e3, 3) for t in copy_times],
            "floor_parallel_ms": round(floor_par_ms, 3), "floor_parallel_threads": threads,
            "ratio_to_parallel_floor": paired(times[i], copy_par_times, passes / 2),
            "copy_parallel_times_ms": [round(t * 1e3, 3) for t in copy_par_times],
            "trace_s": round(cases[i].trace_s, 2), "reps": len(times[i]),
            "times_ms": [round(t * 1e3, 3) for t in times[i]],
            "max_abs_diff_vs_other_after_one_step": agree,
            "loadavg_before": load_before, "loadavg_after": load_after,
        })
    by = {r["impl"]: r for r in rows}
    if "keras" in by:
        for r in rows:
            r["speedup_vs_keras"] = paired(times["keras"], times[r["impl"]])
            r["speedup_vs_keras_ratio_of_medians"] = round(by["keras"]["time_ms"] / r["time_ms"], 3)
    if "hostreduce" in by:  # e.g. the numpy model's time over TensorFlow's fused kernel's
        for r in rows:
            r["time_over_hostreduce"] = paired(times[r["impl"]], times["hostreduce"])
    del cases, grads
    gc.collect()
    return rows


def _targets(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if r["impl"] == "hostreduce" and r["optimizer"] == "adam" and r["layout"] == "resnet50":
            out.append({"what": "Adam, 161 tensors: hostreduce / floor", "value": r["ratio_to_floor"],
                        "goal": f"<= {TARGETS['adam_resnet50_max_ratio_to_floor']}",
                        "met": r["ratio_to_floor"] <= TARGETS["adam_resnet50_max_ratio_to_floor"],
                        "ratio_to_parallel_floor": r["ratio_to_parallel_floor"]})
            if "speedup_vs_keras" in r:
                out.append({"what": "Adam, 161 tensors: Keras / hostreduce", "value": r["speedup_vs_keras"],
                            "goal": f">= {TARGETS['adam_resnet50_min_speedup_vs_keras']}",
                            "met": r["speedup_vs_keras"] >= TARGETS["adam_resnet50_min_speedup_vs_keras"]})
    return out


def _present(rows: list[dict]) -> list[str]:
    return [i for i in IMPLS if any(r["impl"] == i for r in rows)]


def _print_table(rows: list[dict]) -> None:
    threads = rows[0]["floor_parallel_threads"]
    impls = _present(rows)
    print(f"\nfloor: one-thread np.copyto bandwidth x passes; pfloor: the same copy over {threads} threads")
    print(f"{'optimizer':>9} {'layout':>9} {'tensors':>7} | {'floor ms':>8} {'pfloor':>7} | "
          + " | ".join(f"{i + ' ms':>14} {'/floor':>6} {'/pfloor':>7}" for i in impls) + f" | {'speed-up':>8}")
    print("-" * 118)
    keys = sorted({(r["optimizer"], r["layout"]) for r in rows},
                  key=lambda k: (OPTIMIZERS.index(k[0]), LAYOUTS.index(k[1])))
    for opt, layout in keys:
        by = {r["impl"]: r for r in rows if r["optimizer"] == opt and r["layout"] == layout}
        any_row = next(iter(by.values()))
        line = (f"{opt:>9} {layout:>9} {any_row['tensors']:>7} | {any_row['floor_ms']:>8.2f} "
                f"{any_row['floor_parallel_ms']:>7.2f} | ")
        line += " | ".join(f"{by[i]['time_ms']:>14.2f} {by[i]['ratio_to_floor']:>5.2f}x "
                           f"{by[i]['ratio_to_parallel_floor']:>6.2f}x" if i in by
                           else f"{'-':>14} {'-':>6} {'-':>7}" for i in impls)
        sp = by.get("hostreduce", {}).get("speedup_vs_keras")
        line += f" | {sp:>7.2f}x" if sp is not None else f" | {'-':>8}"
        print(line)


def _plot(path: Path, rows: list[dict]) -> None:
    plt = report.pyplot()
    keys = sorted({(r["optimizer"], r["layout"]) for r in rows},
                  key=lambda k: (OPTIMIZERS.index(k[0]), LAYOUTS.index(k[1])))
    labels = [f"{o}\n{'161 tensors' if l == 'resnet50' else '1 tensor'}" for o, l in keys]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    series = [("floor (memory bandwidth)", lambda o, l: next(r["floor_ms"] for r in rows
                                                           if r["optimizer"] == o and r["layout"] == l))]
    width = 0.8 / (len(_present(rows)) + 1)
    for impl in _present(rows):
        series.append((IMPLS[impl], (lambda i: lambda o, l: next(
            (r["time_ms"] for r in rows if r["optimizer"] == o and r["layout"] == l and r["impl"] == i),
            float("nan")))(impl)))
    for k, (label, get) in enumerate(series):
        xs = [j + (k - (len(series) - 1) / 2) * width for j in range(len(keys))]
        ax.bar(xs, [get(o, l) for o, l in keys], width, label=label)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels(labels)
    ax.set_ylabel("ms per step (lower is better)")
    params = rows[0]["parameters"]
    ax.set_title(f"Host optimizer update, {params / 1e6:.1f}M float32 parameters")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    report.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated: sgd,momentum,adam")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: resnet50 (161 tensors), single")
    p.add_argument("--impl", default=",".join(DEFAULT_IMPLS),
                   help="comma-separated: hostreduce,keras (default), numpy (Adam only: overlap_engine.py's "
                        "update, to compare with TensorFlow's fused kernel)")
    p.add_argument("--quick", action="store_true", help="smoke run: ~0.4M parameters, 3 reps x 2 rounds (< 60 s)")
    p.add_argument("--width-divisor", type=int, default=None,
                   help="divide ResNet-50's channel counts by this (default 1; --quick: 8)")
    p.add_argument("--reps", type=int, default=None, help="timed steps per round (default 10; --quick: 3)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds (default 4; --quick: 2); reps x rounds interleaved steps of each implementation")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="TF intra-op threads (default: TF's choice)")
    cli.add_run_options(p, jobs=False)
    args = p.parse_args(argv)

    opts = cli.parse_choices(p, "--optimizers", args.optimizers, OPTIMIZERS)
    layouts = cli.parse_choices(p, "--layouts", args.layouts, LAYOUTS)
    impls = [i for i in IMPLS if i in cli.parse_choices(p, "--impl", args.impl, list(IMPLS))]
    if "numpy" in impls and opts != ["adam"]:
        p.error("--impl numpy models Adam alone: use it with --optimizers adam")
    divisor = args.width_divisor or (8 if args.quick else 1)
    reps = args.reps or (3 if args.quick else 10)
    rounds = args.rounds or (2 if args.quick else 4)
    quiet = report.wait_for_quiet(args.max_load, args.max_wait_s)

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    t_start = time.monotonic()
    import tensorflow as tf

    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    # TF's intra-op pool: 0 means one thread per core.
    copy_threads = tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count() or 1
    shapes161 = resnet50_shapes(divisor)
    nparams = sum(numel(s) for s in shapes161)
    layout_shapes = {"resnet50": shapes161, "single": [(nparams,)]}
    pbytes = 4 * nparams
    bw = copy_bandwidth(pbytes, reps=20 if args.quick else 30)
    pass_ms = pbytes / (bw["bandwidth_GBps"] * 1e9) * 1e3
    rep = report.Report(
        args.out, "host_apply", "host_apply",
        "one optimizer step on CPU variables inside tf.function; the implementations and the copy "
        "floor are timed interleaved, one step at a time; time = median over steps; ratios = median "
        "over steps of the ratio within a step",
        packages=("tensorflow", "keras"), environment_extra={
            "load_wait": quiet, "tf_intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
            "tf_inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads()},
        settings={"optimizers": opts, "layouts": layouts, "impls": {i: IMPLS[i] for i in impls},
                  "quick": args.quick, "width_divisor": divisor, "reps_per_round": reps, "rounds": rounds,
                  "warmup": args.warmup, "parameters": nparams, "tensors": {k: len(v) for k, v in
                                                                          layout_shapes.items()},
                  "passes": PASSES, "targets": TARGETS,
                  "optimizer_settings": {"sgd": "SGD(lr=0.01)", "momentum": "SGD(lr=0.01, momentum=0.9)",
                                         "adam": "Adam(lr=1e-3)"}},
        copy_bandwidth={**bw, "one_pass_ms": round(pass_ms, 4),
                        "floor_ms": {o: round(PASSES[o] * pass_ms, 3) for o in OPTIMIZERS}},
        measurements=[], targets=[])
    rep.t_start = t_start
    result = rep.result
    print(f"host apply benchmark: {nparams:,} float32 parameters ({pbytes / 1e6:.1f} MB), "
          f"layouts {layouts}, optimizers {opts}; copy bandwidth {bw['bandwidth_GBps']} GB/s "
          f"(one pass {pass_ms:.2f} ms) (results -> {rep.json_path})", flush=True)
    rows: list[dict] = []
    for k, opt in enumerate(opts):
        for layout in layouts:
            t0 = time.monotonic()
            new = _measure(opt, layout, layout_shapes[layout], impls, reps, rounds, args.warmup,
                           PASSES[opt], seed=k, threads=copy_threads)
            rows += new
            print(f"  {opt:>8} {layout:>8}: " + ", ".join(f"{r['impl']} {r['time_ms']:.2f} ms" for r in new)
                  + f" ({time.monotonic() - t0:.1f} s)", flush=True)
            result["measurements"] = rows
            rep.save()
    # The copy bandwidth again at the end: how much it drifted during the run.
    result["copy_bandwidth"]["at_end"] = copy_bandwidth(pbytes, reps=20 if args.quick else 30)
    result["targets"] = _targets(rows)

    def show() -> None:
        _print_table(rows)
        report.print_targets(result["targets"], blank=False, note=lambda t: (
            f" [against the {rows[0]['floor_parallel_threads']}-thread copy floor: {t['ratio_to_parallel_floor']}]"
            if "ratio_to_parallel_floor" in t else ""))

    rep.close(plot=lambda path: _plot(path, rows), no_plot=args.no_plot, show=show)
    return 0


if __name__ == "__main__":
    sys.exit(main())
