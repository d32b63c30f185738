#!/usr/bin/env python
"""What a parameter server's checks of a push cost, against the apply they guard.

    python benchmarks/ps_checks.py                  # the recommender at 4M x 64, batch 512
    python benchmarks/ps_checks.py --quick          # smoke run: 20K-row tables, few reps

A ps checks every push whole before any of it applies (names, shapes and dtypes of every
gradient, row ids 1-D integers in range, and with ``nonfinite="refuse"`` no NaN or Inf).
This times that check on one ps's part of one worker's push of the recommender model that
``benchmarks/parameter_server.py`` trains (deep table ``vocab x dim`` and wide table
``vocab x 1``, split over 2 ps by rows; the MLP 256-128-1 over 8 x ``dim`` looked-up
features and 13 numeric ones; 8 lookups per example), against the Adam apply of the same
push (``sparse="lazy"``, duplicate rows summed first), in one process, interleaved step by
step. A sync step checks each worker's push (2 here) and applies their sum once.
Results go to ``<out>/ps_checks.json`` and ``<out>/ps_checks.png``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks.harness import report  # noqa: E402
from hostreduce.ps.placement import VarSpec, locate, place  # noqa: E402
from hostreduce.ps.store import ShardStore  # noqa: E402

FIELDS, NUMERIC, HIDDEN = 8, 13, (256, 128)


def model_specs(vocab: int, dim: int) -> list[VarSpec]:
    specs = [VarSpec("deep_embedding", (vocab, dim)), VarSpec("wide_embedding", (vocab, 1))]
    width = FIELDS * dim + NUMERIC
    for i, units in enumerate((*HIDDEN, 1)):
        name = f"hidden{i}" if i < len(HIDDEN) else "logit"
        specs += [VarSpec(f"{name}/kernel", (width, units)), VarSpec(f"{name}/bias", (units,))]
        width = units
    return specs


def push_for(store: ShardStore, specs: list[VarSpec], batch: int, rng: np.random.Generator) -> tuple[dict, dict]:
    """This ps's part of one worker's push: the dense gradients it holds, and the rows of
    its share of the tables looked up by ``batch`` examples (ids drawn Zipf-like, so with
    duplicates, as a click stream has)."""
    placement = store.placement
    dense, rows = {}, {}
    for s in specs:
        p = placement[s.name]
        if p.ps is not None and p.ps != store.index:
            continue  # held whole by the other ps
        if s.name.endswith("_embedding"):
            ids = (rng.zipf(1.2, size=batch * FIELDS) - 1) % s.shape[0]
            owners, local = locate(placement, s.name, ids)
            mine = local[owners == store.index]
            rows[s.name] = (mine, rng.normal(size=(len(mine),) + s.shape[1:]).astype(np.float32))
        else:
            dense[s.name] = rng.normal(size=s.shape).astype(np.float32)
    return dense, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, help="table rows (default 4,000,000; --quick: 20,000)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=512, help="examples per worker per step")
    parser.add_argument("--reps", type=int, help="timed steps (default 200; --quick: 10)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--name", default="ps_checks")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    vocab = args.vocab or (20_000 if args.quick else 4_000_000)
    reps = args.reps or (10 if args.quick else 200)
    specs = model_specs(vocab, args.dim)
    placement = place(specs, 2)
    rng = np.random.default_rng(0)
    results: dict[str, Any] = {}
    for ps in range(2):
        store = ShardStore(ps)
        values = {n: np.zeros(placement[n].local_shape(ps), np.float32) for n in placement.on(ps)}
        store.register(placement, {"name": "adam", "learning_rate": 1e-3, "sparse": "lazy"}, values)
        del values
        pushes = [push_for(store, specs, args.batch, rng) for _ in range(8)]
        times: dict[str, list[float]] = {"check": [], "check_finite": [], "apply": []}
        for i in range(reps + 3):
            dense, rows = pushes[i % len(pushes)]
            t0 = time.perf_counter()
            part = store.check_push(dense, rows)
            t1 = time.perf_counter()
            store.check_push(dense, rows, finite=True)
            t2 = time.perf_counter()
            store.apply(part)
            t3 = time.perf_counter()
            if i >= 3:  # the first applies touch fresh slot pages
                times["check"].append(t1 - t0)
                times["check_finite"].append(t2 - t1)
                times["apply"].append(t3 - t2)
        dense, rows = pushes[0]
        ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        results[f"ps{ps}"] = {
            "dense_variables": len(dense), "dense_floats": int(sum(g.size for g in dense.values())),
            "rows": {n: int(len(ids)) for n, (ids, _) in rows.items()},
            "median_ms": {k: round(v, 4) for k, v in ms.items()},
            "check / apply": round(ms["check"] / ms["apply"], 4),
            "check_finite / apply": round(ms["check_finite"] / ms["apply"], 4),
        }
        print(f"ps {ps}: {len(dense)} dense gradients ({results[f'ps{ps}']['dense_floats']:,} floats), rows "
              f"{results[f'ps{ps}']['rows']}: check {ms['check']:.3f} ms, with the finite check "
              f"{ms['check_finite']:.3f} ms, Adam apply {ms['apply']:.3f} ms; check / apply "
              f"{ms['check'] / ms['apply']:.3f} ({ms['check_finite'] / ms['apply']:.3f} refusing non-finite)")
        del store
    per_step = {k: round(2 * max(r["median_ms"][k] for r in results.values()), 4) for k in ("check", "check_finite")}
    print(f"per sync step of 2 workers, on the busier ps: checks {per_step['check']:.3f} ms "
          f"({per_step['check_finite']:.3f} ms refusing non-finite gradients)")
    out = {"benchmark": "ps_checks", "vocab": vocab, "dim": args.dim, "batch": args.batch, "reps": reps,
           "environment": report.environment(["numpy"]), "per_ps": results, "per_sync_step_ms": per_step}
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    report.write_json(path / f"{args.name}.json", out)
    if not args.no_plot:
        plt = report.pyplot()
        fig, ax = plt.subplots(figsize=(6, 3.2))
        kinds = ("check", "check_finite", "apply")
        for j, ps in enumerate(results):
            ax.bar([k + 0.38 * j for k in range(3)], [results[ps]["median_ms"][k] for k in kinds], 0.38, label=ps)
        ax.set_xticks([k + 0.19 for k in range(3)], ["check", "check + finite", "Adam apply"])
        ax.set_ylabel("ms per push (median)")
        ax.set_title(f"ps push checks vs apply, {vocab:,} x {args.dim}, batch {args.batch}")
        ax.legend()
        report.save_figure(fig, path / f"{args.name}.png")
    print(f"wrote {path / (args.name + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
