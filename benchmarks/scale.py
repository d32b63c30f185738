#!/usr/bin/env python
"""How the ring's bus bandwidth scales with the number of workers on a simulated
cluster of shaped links, against the bound a ring can reach on those links.

    python benchmarks/scale.py                        # N = 2..8, 16 and 64 MiB, 1 and 10 Gbit/s + loopback (root)
    python benchmarks/scale.py --quick                # smoke run: N = 2, 1 MiB, 1 Gbit/s + loopback (< 60 s)
    python benchmarks/scale.py --rates 1gbit --np 2,4,8 --sizes 64M
    python benchmarks/scale.py --max-load 2.5         # wait (up to 10 min) for a quiet machine first

Every worker runs in its own network namespace behind a bridge (see ``netcluster.py``);
its link is shaped to the rate B in both directions. For each rate and N the workers
all-reduce (sum) a float32 buffer of S bytes with hostreduce's ``ring`` reducer on
its data path between hosts, ``tcp`` (``--transport grpc``: the data over gRPC; the
namespaces share one hostname, and "auto" would take shared memory). An optimal ring moves 2(N-1)/N * S bytes through each link in each
direction, so no all-reduce can take less than ``bound = 2(N-1)/N * S / B``; the script
reports ``bound / time`` (equal to bus bandwidth / B), which should stay flat as N
grows. The same workers on plain loopback (no shaping, shared CPU only) run beside it:
their bus bandwidth is what this machine's CPUs allow, the ceiling of any shaped run.

Results go to ``<out>/scale.json`` and ``<out>/scale.png``. Needs root for the
namespaces; without it only the loopback part runs (and says so).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import netcluster as NC  # noqa: E402
from benchmarks.harness import cli, jobs, peers, placement, report  # noqa: E402
from benchmarks.harness.measure import (MiB, bus_bandwidth_factor, choose_reps, format_size,  # noqa: E402
                                        link_bound_ms, time_op)

DEFAULT_NP = [2, 3, 4, 5, 6, 7, 8]
DEFAULT_SIZES = [16 * MiB, 64 * MiB]
DEFAULT_RATES = ["1gbit", "10gbit"]
QUICK_SIZES = [1 * MiB]
TARGET_RATIO = 0.85  # bound / time at the largest N, on the 1 Gbit/s links
TARGET_FLAT = 0.9    # ratio at the largest N over the ratio at N = 2


# =========================================================================== worker


def _measure(plan: dict, workdir: Path) -> None:
    from benchmarks.impls.collectives import Ring

    ring = Ring(plan["transport"])
    rank, size = ring.rank, ring.size
    with open(workdir / f"rank{rank}.jsonl", "a") as out:
        out.write(json.dumps({"kind": "hello", "rank": rank, "size": size, "connect_s": round(ring.connect_s, 3)})
                  + "\n")
        out.flush()
        for nbytes in plan["sizes"]:
            nelem = nbytes // 4
            cell = ring.prepare(nelem)
            correct = cell.verify(rank, size, nelem)
            warm = time_op(cell.run, plan["warmup"])
            # Every rank runs the same number of repetitions: agree on the slowest estimate.
            estimate = ring.max_over_ranks(min(warm))
            reps = plan["reps"] or choose_reps(estimate, plan["target_s"], plan["min_reps"], plan["max_reps"])
            times = []
            for _ in range(reps):
                ring.barrier()  # each repetition starts together: time one all-reduce, not a pipeline
                t = time.perf_counter()
                cell.run()
                times.append(time.perf_counter() - t)
            out.write(json.dumps({"kind": "cell", "rank": rank, "bytes": nbytes, "correct": correct, "reps": reps,
                                  "warmup_ms": [round(x * 1e3, 3) for x in warm],
                                  "times_ms": [round(x * 1e3, 3) for x in times]}) + "\n")
            out.flush()
            del cell
    ring.barrier()
    ring.close()


# =========================================================================== coordinator


def _summarize(network: str, n: int, rate_bps: float | None, goodput_bps: float | None,
               records: list[dict]) -> list[dict]:
    cells: dict[int, dict[int, dict]] = {}
    connect = {}
    for rec in records:
        if rec.get("kind") == "cell":
            cells.setdefault(rec["bytes"], {})[rec["rank"]] = rec
        elif rec.get("kind") == "hello":
            connect[rec["rank"]] = rec["connect_s"]
    rows = []
    for nbytes in sorted(cells):
        per_rank = cells[nbytes]
        if len(per_rank) != n:
            continue
        medians = {r: statistics.median(c["times_ms"]) for r, c in sorted(per_rank.items())}
        t_ms = max(medians.values())
        busbw = nbytes / (t_ms * 1e-3) * bus_bandwidth_factor(n)
        row: dict[str, Any] = {
            "network": network, "np": n, "bytes": nbytes, "size": format_size(nbytes),
            "correct": all(c["correct"] for c in per_rank.values()), "reps": per_rank[0]["reps"],
            "time_ms": round(t_ms, 3),
            "min_ms": round(min(min(c["times_ms"]) for c in per_rank.values()), 3),
            "busbw_GBps": round(busbw / 1e9, 4),
            "rank_median_ms": {str(r): round(m, 3) for r, m in medians.items()},
            "rank_times_ms": {str(r): c["times_ms"] for r, c in sorted(per_rank.items())},
            "connect_s": connect,
        }
        if rate_bps:
            bound_ms = link_bound_ms(n, nbytes, rate_bps)
            row.update(link_rate_bps=rate_bps, bound_ms=round(bound_ms, 3),
                       ratio_to_bound=round(bound_ms / t_ms, 4))
            if goodput_bps:
                # Against what one TCP stream achieved on these links (headers cost ~4-5 %).
                row["ratio_to_tcp_goodput"] = round(busbw * 8 / goodput_bps, 4)
        rows.append(row)
    return rows


def _job_timeout(sizes: list[int], n: int, rate_bps: float | None, plan: dict) -> float:
    # The slowest case (shaped links) bounds each size's repetitions; CPUs add start-up.
    per_op = [bus_bandwidth_factor(n) * s / ((rate_bps or 4e9) / 8) for s in sizes]
    reps = plan["reps"] or plan["max_reps"]
    return 60.0 + sum(3.0 * t * (reps + plan["warmup"] + 2) for t in per_op)


def _run_cell(where: Any, n: int, plan: dict, plan_path: Path, workroot: Path, result: dict) -> list[dict]:
    info: dict[str, Any] = {}
    goodput = None
    if where.cluster is not None:
        info["tcp_check"] = where.measure_rate(plan["rate_check_s"])
        goodput = info["tcp_check"]["achieved_bps"]
    workdir = workroot / f"{where.name}-np{n}"
    argv = lambda rank: jobs.worker_argv(__file__, plan=plan_path, workdir=workdir, rank=rank)  # noqa: E731
    timeout_s = _job_timeout(plan["sizes"], n, where.rate_bps, plan)
    run = peers.run(peers.HOSTREDUCE_RING, where, n, argv, workdir, timeout_s, info=info)
    info = run.info
    rows = _summarize(where.name, n, where.rate_bps, goodput, run.records())
    for r in rows:
        r["loadavg_before"], r["loadavg_after"] = info["loadavg_before"], info["loadavg_after"]
    result["runs"].setdefault(where.name, {})[str(n)] = info
    run.say(f"{where.name:>9} N={n}", f"{len(rows)}/{len(plan['sizes'])} sizes", f"{run.seconds:.1f} s"
            + (f" (TCP check {info['tcp_check']['achieved_gbps']:.3f} Gbit/s)" if "tcp_check" in info else ""))
    return rows


def _targets(rows: list[dict], nps: list[int]) -> list[dict]:
    checks = []
    top = max(nps)
    for network in sorted({r["network"] for r in rows if "ratio_to_bound" in r}):
        for nbytes in sorted({r["bytes"] for r in rows if r["network"] == network}):
            by_n = {r["np"]: r for r in rows if r["network"] == network and r["bytes"] == nbytes}
            if top not in by_n:
                continue
            ratio = by_n[top]["ratio_to_bound"]
            check = {"what": f"{network}, {format_size(nbytes)}, N={top}: bound / time",
                     "value": ratio, "goal": f">= {TARGET_RATIO}", "met": ratio >= TARGET_RATIO,
                     "binding": network == "1gbit"}
            # Unshaped loopback shows what the CPUs allow: below the link rate, the
            # machine (all N workers share it), not the link, bounds the shaped run.
            lo = next((r for r in rows if r["network"] == "loopback" and r["np"] == top
                       and r["bytes"] == nbytes), None)
            if lo is not None:
                link_GBps = by_n[top]["link_rate_bps"] / 8 / 1e9
                check["loopback_busbw_over_link_rate"] = round(lo["busbw_GBps"] / link_GBps, 3)
                check["cpu_bound"] = lo["busbw_GBps"] < link_GBps
            checks.append(check)
            if min(by_n) < top:
                flat = round(ratio / by_n[min(by_n)]["ratio_to_bound"], 4)
                checks.append({"what": f"{network}, {format_size(nbytes)}: ratio at N={top} / ratio at "
                                       f"N={min(by_n)} (flatness)", "value": flat, "goal": f">= {TARGET_FLAT}",
                               "met": flat >= TARGET_FLAT, "binding": network == "1gbit"})
    return checks


def _print_tables(rows: list[dict], networks: list[str], nps: list[int], sizes: list[int]) -> None:
    index = {(r["network"], r["np"], r["bytes"]): r for r in rows}
    for nbytes in sizes:
        print(f"\nS = {format_size(nbytes)}  (time: slowest rank's median, ms; busbw = S/t*2(N-1)/N, GB/s; "
              "ratio = bound/time, bound = 2(N-1)/N*S/B)")
        head = f"{'N':>3} " + "".join(
            f"| {nw + ' time':>13} {'busbw':>7} {'bound':>9} {'ratio':>6} " if nw != "loopback"
            else f"| {nw + ' time':>13} {'busbw':>7} " for nw in networks)
        print(head)
        print("-" * len(head))
        for n in nps:
            line = f"{n:>3} "
            for nw in networks:
                r = index.get((nw, n, nbytes))
                width = 39 if nw != "loopback" else 22
                if r is None:
                    line += f"| {'-':>{width - 2}} "
                    continue
                flag = " " if r["correct"] else "!"
                line += f"| {r['time_ms']:>13.1f} {r['busbw_GBps']:>7.3f}{flag}"
                if nw != "loopback":
                    line += f"{r['bound_ms']:>9.1f} {r['ratio_to_bound']:>6.3f} "
            print(line)


def _plot(path: Path, rows: list[dict], networks: list[str], sizes: list[int], cpu_count: int | None) -> None:
    plt = report.pyplot()
    fig, (ax_bw, ax_ratio) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = {nw: f"C{k}" for k, nw in enumerate(networks)}  # one colour per network, one style per size
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D"]
    for nw in networks:
        for k, nbytes in enumerate(sizes):
            pts = sorted((r["np"], r["busbw_GBps"], r.get("ratio_to_bound")) for r in rows
                         if r["network"] == nw and r["bytes"] == nbytes)
            if not pts:
                continue
            label = f"{nw}, {format_size(nbytes)}"
            style = dict(color=colors[nw], ls=styles[k % 4], marker=markers[k % 4], markersize=5, label=label)
            ax_bw.plot([p[0] for p in pts], [p[1] for p in pts], **style)
            if nw != "loopback":
                ax_ratio.plot([p[0] for p in pts], [p[2] for p in pts], **style)
    for nw in networks:
        if nw != "loopback":
            ax_bw.axhline(NC.parse_rate(nw) / 8 / 1e9, ls="--", lw=0.8, color=colors[nw], alpha=0.6)
    ax_bw.set_yscale("log")
    ax_bw.set_title("ring bus bandwidth (gRPC); thin dashed: link rate B")
    ax_bw.set_ylabel("bus bandwidth (GB/s)")
    ax_ratio.axhline(TARGET_RATIO, ls="--", lw=0.8, color="red", label=f"target {TARGET_RATIO}")
    ax_ratio.set_ylim(0, 1.05)
    ax_ratio.set_title("achieved / bound, bound = 2(N-1)/N * S / B")
    ax_ratio.set_ylabel("bound / time")
    for ax in (ax_bw, ax_ratio):
        ax.set_xlabel("workers N")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"All-reduce scaling on a simulated cluster: N workers on one {cpu_count}-core machine "
                 "(higher is better)")
    report.save_figure(fig, path)



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", default=None, help="comma-separated world sizes, 2..8 (default 2..8; --quick: 2)")
    p.add_argument("--sizes", default=None, help="comma-separated buffer sizes (default 16M,64M; --quick: 1M)")
    p.add_argument("--rates", default=None, help="comma-separated link rates (default 1gbit,10gbit; --quick: 1gbit)")
    p.add_argument("--no-loopback", action="store_true", help="skip the unshaped loopback runs")
    p.add_argument("--transport", choices=("tcp", "grpc"), default="tcp",
                   help="the ring's data path (default tcp, its path between hosts)")
    p.add_argument("--quick", action="store_true", help="smoke run: N=2, 1 MiB, 1 Gbit/s + loopback (< 60 s)")
    p.add_argument("--reps", type=int, default=None, help="fixed timed repetitions per cell")
    p.add_argument("--target-s", type=float, default=2.0, help="timed seconds per cell when adapting reps")
    p.add_argument("--min-reps", type=int, default=3)
    p.add_argument("--max-reps", type=int, default=30)
    cli.add_run_options(p)
    args = p.parse_args(argv)
    if args.worker:
        return jobs.run_worker(args, _measure)

    nps = cli.parse_np(p, args.np, [2] if args.quick else DEFAULT_NP)
    sizes = cli.parse_sizes(p, args.sizes, QUICK_SIZES if args.quick else DEFAULT_SIZES)
    rates = cli.parse_networks(p, args.rates, ["1gbit"] if args.quick else DEFAULT_RATES)
    networks, usable, why = placement.usable_networks(([] if args.no_loopback else ["loopback"]) + rates)
    quiet = report.wait_for_quiet(args.max_load, args.max_wait_s)
    plan = {"sizes": sizes, "reps": args.reps if args.reps is not None else (2 if args.quick else None),
            "warmup": 1, "target_s": args.target_s, "min_reps": args.min_reps, "max_reps": args.max_reps,
            "rate_check_s": 0.3 if args.quick else 1.0, "worker_timeout_s": 550.0, "transport": args.transport}
    rep = report.Report(
        args.out, "scale", "scale",
        f"float32 all-reduce (sum, in place) with hostreduce's ring ({args.transport} data path), one worker per "
        "network namespace, links shaped to B per direction; time = slowest rank's median",
        packages=("grpcio",), environment_extra={"load_wait": quiet, "namespaces_usable": usable,
                                                 "namespaces_reason": why},
        settings={"np": nps, "sizes": sizes, "rates": rates, "networks": networks, "quick": args.quick,
                  "plan": plan, "transport": args.transport, "bound": "2(N-1)/N * S / B",
                  "target": {"ratio_to_bound_at_max_np": TARGET_RATIO, "flatness": TARGET_FLAT},
                  "netcluster": {"subnet": NC.DEFAULT_SUBNET, "shaping": "tbf on both ends of every link, "
                                 "burst 256kb per Gbit/s, latency 50ms", "mtu": 1500}},
        runs={}, measurements=[], targets=[])
    result = rep.result
    rep.announce(f"scale benchmark: networks={networks} np={nps} sizes={[format_size(s) for s in sizes]}")
    rows: list[dict] = []
    with jobs.workroot("hostreduce-bench-scale-", args.keep_workdir) as workroot:
        plan_path = jobs.write_plan(workroot / "plan.json", plan)
        for n in nps:
            for network in networks:
                with placement.network(network, n) as where:
                    if where.cluster is not None:
                        result["settings"]["netcluster"].setdefault("burst", {})[network] = where.cluster.burst
                    rows += _run_cell(where, n, plan, plan_path, workroot, result)
                result["measurements"] = rows
                rep.save()
    result["targets"] = _targets(rows, nps)

    def show() -> None:
        _print_tables(rows, networks, nps, sizes)
        report.print_targets(result["targets"], note=lambda t: (
            "" if "cpu_bound" not in t else f"; loopback busbw / B = {t['loopback_busbw_over_link_rate']}"
            + (": this machine's CPUs, not the link, bound it" if t["cpu_bound"] else "")))

    rep.close(plot=(lambda path: _plot(path, rows, networks, sizes, result["environment"]["cpu_count"]))
              if rows else None, no_plot=args.no_plot, show=show)
    return report.exit_status(result["runs"])


if __name__ == "__main__":
    sys.exit(main())
