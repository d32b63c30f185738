"""Sizes, timing and repetition counts, for the coordinators and the worker processes
alike (standard library only)."""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Iterable

__all__ = ["KiB", "MiB", "GiB", "format_size", "parse_size", "parse_list", "choose_reps", "time_op",
           "bus_bandwidth_factor", "link_bound_ms", "median", "numel"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def format_size(nbytes: int) -> str:
    """``1024 -> '1 KiB'``, ``100 << 20 -> '100 MiB'``; exact multiples only get a unit."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def parse_size(text: str) -> int:
    """Parse ``'1K'``, ``'16MiB'``, ``'100m'``, ``'4096'`` into a byte count."""
    raw = text.strip().lower().replace(" ", "")
    for suffix, scale in (("gib", GiB), ("mib", MiB), ("kib", KiB), ("gb", GiB), ("mb", MiB),
                          ("kb", KiB), ("g", GiB), ("m", MiB), ("k", KiB), ("b", 1)):
        if raw.endswith(suffix):
            number = raw[: -len(suffix)]
            break
    else:
        number, scale = raw, 1
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError(f"`size` must look like 1K, 16MiB or 4096. Received: size={text!r}") from None
    if value <= 0 or value != int(value):
        raise ValueError(f"`size` must be a positive whole number of bytes. Received: size={text!r}")
    return int(value)


def parse_list(text: str, conv: Any) -> list[Any]:
    """``"a, b,c"`` -> ``[conv("a"), conv("b"), conv("c")]`` (empty items dropped)."""
    return [conv(t.strip()) for t in text.split(",") if t.strip()]


def choose_reps(op_seconds: float, target_s: float, min_reps: int, max_reps: int) -> int:
    """How many timed repetitions fill about ``target_s`` seconds, within bounds."""
    if not op_seconds > 0 or math.isinf(op_seconds):
        return min_reps
    return int(max(min_reps, min(max_reps, math.ceil(target_s / op_seconds))))


def time_op(fn: Callable[[], Any], reps: int) -> list[float]:
    """Run ``fn`` ``reps`` times; return each call's wall time in seconds."""
    clock = time.perf_counter
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return times


def bus_bandwidth_factor(nranks: int) -> float:
    """All-reduce bus bandwidth = algorithm bandwidth * 2(N-1)/N (nccl-tests convention):
    the traffic each rank's link carries in an optimal ring, so that the figure is
    comparable across world sizes and with the hardware's link speed."""
    return 2.0 * (nranks - 1) / nranks if nranks > 1 else 0.0


def link_bound_ms(nranks: int, nbytes: float, rate_bps: float) -> float:
    """The least time of an all-reduce of ``nbytes`` over links of ``rate_bps`` per
    direction: an optimal ring moves 2(N-1)/N * S through each link."""
    return bus_bandwidth_factor(nranks) * nbytes / (rate_bps / 8) * 1e3


def median(xs: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None when there are none."""
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def numel(shape: Iterable[int]) -> int:
    """The number of elements of an array of ``shape``."""
    n = 1
    for d in shape:
        n *= d
    return n
