"""Command-line options the benchmarks share, and the checks of their values."""
from __future__ import annotations

import argparse
from typing import Sequence

from benchmarks import netcluster as NC
from benchmarks.harness.measure import parse_list, parse_size
from benchmarks.harness.report import RESULTS_DIR

__all__ = ["add_run_options", "parse_choices", "parse_np", "parse_networks", "parse_sizes"]


def add_run_options(p: argparse.ArgumentParser, *, jobs: bool = True, workers: Sequence[str] | None = None,
                    out_help: str | None = None) -> None:
    """Options every benchmark shares: quiet-machine wait and output; with ``jobs``, the
    work directory and the hidden options its own worker processes are started with
    (``--worker``, or ``--worker NAME`` among ``workers``)."""
    p.add_argument("--max-load", type=float, default=None,
                   help="wait until the 1-minute load average is at most this (up to --max-wait-s)")
    p.add_argument("--max-wait-s", type=float, default=600.0)
    p.add_argument("--out", default=str(RESULTS_DIR), help=out_help)
    p.add_argument("--no-plot", action="store_true")
    if not jobs:
        return
    p.add_argument("--keep-workdir", action="store_true", help="keep worker logs and raw files")
    if workers is None:
        p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    else:
        p.add_argument("--worker", choices=list(workers), help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)


def parse_choices(p: argparse.ArgumentParser, option: str, text: str, valid: Sequence[str]) -> list[str]:
    """A comma-separated list of names among ``valid`` (at least one)."""
    values = parse_list(text, str)
    bad = [v for v in values if v not in valid]
    if bad or not values:
        p.error(f"{option} must be among {list(valid)}. Received: {bad or values}")
    return values


def parse_np(p: argparse.ArgumentParser, text: str | None, default: list[int], netcluster: bool = True) -> list[int]:
    """World sizes: at least 2, and with ``netcluster`` at most what a simulated cluster holds."""
    nps = parse_list(text, int) if text else default
    lo, hi = (NC.MIN_WORKERS, NC.MAX_WORKERS) if netcluster else (2, None)
    if any(n < lo or (hi is not None and n > hi) for n in nps):
        p.error(f"--np values must be from {lo} to {hi}. Received: {nps}" if hi
                else f"--np values must be >= {lo}. Received: {nps}")
    return nps


def parse_networks(p: argparse.ArgumentParser, text: str | None, default: list[str]) -> list[str]:
    """``loopback`` and link rates such as ``1gbit``."""
    networks = parse_list(text, str) if text else default
    try:
        for nw in networks:
            if nw != "loopback":
                NC.parse_rate(nw)
    except NC.NetClusterError as exc:
        p.error(str(exc))
    return networks


def parse_sizes(p: argparse.ArgumentParser, text: str | None, default: list[int]) -> list[int]:
    """Buffer sizes in bytes (``1K,16MiB,4096``), float32 multiples, sorted."""
    try:
        sizes = sorted(set(parse_list(text, parse_size))) if text else default
    except ValueError as exc:
        p.error(str(exc))
    bad = [s for s in sizes if s % 4]
    if bad:
        p.error(f"--sizes must be multiples of 4 bytes (float32). Received: {bad}")
    return sizes
