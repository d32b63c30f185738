"""Results: what a result depends on (machine, software, date, command line, load),
the JSON file under ``benchmarks/results/`` (or ``--out``), the PNG, and the end every
benchmark's ``main()`` shares (:meth:`Report.close`: the last JSON write, the plot,
the tables, the targets, where it all went).

Standard library only; matplotlib is imported when a plot is drawn.
"""
from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from benchmarks.harness.jobs import REPO_ROOT
from benchmarks.harness.measure import format_size

__all__ = ["RESULTS_DIR", "environment", "command_output", "loadavg", "cores", "wait_for_quiet", "hostreduce_env",
           "write_json", "pyplot", "save_figure", "plot_lines", "print_targets", "exit_status", "Report"]

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


# --------------------------------------------------------------------------- the environment


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def command_output(argv: Sequence[str], timeout: float = 10.0) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=str(REPO_ROOT))
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def loadavg() -> list[float]:
    """The 1-, 5- and 15-minute load averages, rounded for the record."""
    return [round(x, 2) for x in os.getloadavg()]


def environment(packages: Sequence[str] = (), extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What a result depends on: machine, software versions, date and command line."""
    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command_line": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "memory_bytes": _memory_bytes(),
        "python": platform.python_version(),
        "versions": {p: _version(p) for p in ("numpy", *packages)},
        "hostreduce_git": command_output(["git", "describe", "--always", "--dirty", "--tags"]),
        # Other processes on the machine skew every figure; the load tells whether they did.
        "loadavg_at_start": loadavg(),
    }
    if extra:
        env.update(extra)
    return env


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def wait_for_quiet(max_load: float | None, max_wait_s: float, poll_s: float = 15.0) -> dict[str, Any] | None:
    """Wait (at most ``max_wait_s``) until the 1-minute load average is <= ``max_load``;
    return what happened, for the result's environment record (None: no waiting asked)."""
    if not max_load:
        return None
    t0 = time.monotonic()
    load = os.getloadavg()[0]
    while load > max_load and time.monotonic() - t0 < max_wait_s:
        print(f"  1-min load {load:.2f} > {max_load}: waiting ({time.monotonic() - t0:.0f} s so far)", flush=True)
        time.sleep(poll_s)
        load = os.getloadavg()[0]
    return {"max_load": max_load, "waited_s": round(time.monotonic() - t0, 1), "load_1min_at_start": round(load, 2),
            "quiet": load <= max_load}


def hostreduce_env() -> dict[str, str]:
    """The ``HOSTREDUCE_*`` settings of this environment (the secret left out): the
    workers inherit them, so a run can measure a tuning."""
    return {k: v for k, v in os.environ.items() if k.startswith("HOSTREDUCE_") and k != "HOSTREDUCE_SECRET"}


# --------------------------------------------------------------------------- files


_NUMBER_LIST = re.compile(r"\[\s*(-?[0-9][-0-9.eE+]*(?:,\s*-?[0-9][-0-9.eE+]*)*)\s*\]")


def write_json(path: Path, obj: Any) -> None:
    """Write atomically (a reader never sees half a file), indented for reading but with
    lists of numbers (raw timings) on one line each."""
    text = json.dumps(obj, indent=1)
    text = _NUMBER_LIST.sub(lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=str(path.parent), prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; results are meant to be shared
    os.replace(tmp, path)


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, rect: tuple[float, float, float, float] | None = None) -> None:
    """Lay out ``fig``, write it to ``path`` as a PNG and free it."""
    fig.tight_layout(**({"rect": rect} if rect else {}))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def plot_lines(
    path: Path,
    panels: Sequence[tuple[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]]],
    xlabel: str,
    ylabel: str,
    title: str,
    xlog: bool = True,
    ylog: bool = False,
    xtick_formatter: Callable[[float], str] | None = format_size,
) -> None:
    """One panel per ``(panel_title, {line_label: (xs, ys)})``, side by side, to a PNG."""
    from matplotlib.ticker import FuncFormatter

    fig, axes = pyplot().subplots(1, max(1, len(panels)), figsize=(6.5 * max(1, len(panels)), 4.8),
                                  squeeze=False, sharey=True)
    for ax, (panel_title, lines) in zip(axes[0], panels):
        for label, (xs, ys) in lines.items():
            if xs:
                ax.plot(xs, ys, marker="o", markersize=3.5, label=label)
        if xlog:
            ax.set_xscale("log", base=4)
        if ylog:
            ax.set_yscale("log")
        xs_all = [x for xs, _ys in lines.values() for x in xs]
        if xlog and xs_all:
            lo, hi = math.floor(math.log(min(xs_all), 4)), math.ceil(math.log(max(xs_all), 4))
            ax.set_xticks([4.0 ** k for k in range(lo, hi + 1)])
        if xtick_formatter is not None:
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: xtick_formatter(int(round(v))) if v >= 1 else ""))
            for tick in ax.get_xticklabels():
                tick.set_rotation(45)
        ax.set_title(panel_title)
        ax.set_xlabel(xlabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel(ylabel)
    fig.suptitle(title)
    save_figure(fig, path)


# --------------------------------------------------------------------------- the end of main()


def print_targets(targets: Iterable[dict], unit: str = "", note: Callable[[dict], str] | None = None,
                  blank: bool = True) -> None:
    """``met`` / ``MISSED`` and each target's value and goal, one line each."""
    targets = list(targets)
    if targets and blank:
        print()
    for t in targets:
        print(f"{'met   ' if t['met'] else 'MISSED'} {t['what']}: {t['value']}{unit} (goal {t['goal']})"
              + (note(t) if note else ""))


def exit_status(runs: Any) -> int:
    """1 if any run record (a dict with a ``status``) under ``runs`` is not ``ok``, else 0."""
    if isinstance(runs, dict):
        if "status" in runs:
            return int(runs["status"] != "ok")
        return max((exit_status(v) for v in runs.values()), default=0)
    return 0


class Report:
    """One benchmark's result: ``<out>/<stem>.json`` (and ``.png``), opened with the
    environment record, saved as the run goes (:meth:`save`), finished by :meth:`close`."""

    def __init__(self, out: str | Path, stem: str, benchmark: str, description: str, *,
                 packages: Sequence[str] = (), environment_extra: Mapping[str, Any] | None = None,
                 **sections: Any) -> None:
        self.out_dir = Path(out)
        self.json_path, self.png_path = self.out_dir / f"{stem}.json", self.out_dir / f"{stem}.png"
        self.result: dict[str, Any] = {"benchmark": benchmark, "description": description,
                                       "environment": environment(packages, environment_extra), **sections}
        self.t_start = time.monotonic()

    def __getitem__(self, key: str) -> Any:
        return self.result[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.result[key] = value

    def announce(self, what: str) -> None:
        """The first line of a run: what it measures, and where the results go."""
        print(f"{what} (results -> {self.json_path})", flush=True)

    def save(self) -> None:
        write_json(self.json_path, self.result)

    def close(self, *, plot: Callable[[Path], None] | None = None, no_plot: bool = False,
              show: Callable[[], None] | None = None, wall: bool = True, measured_here: bool = True) -> None:
        """The end of a run: the wall time and the load at the end into the environment
        record (``measured_here=False``: neither, for a result made of other runs' files),
        the JSON, the PNG (``plot(png_path)``, unless ``no_plot``), the tables and targets
        (``show()``), and where the files went."""
        env = self.result["environment"]
        wall = wall and measured_here
        if wall:
            env["wall_s"] = round(time.monotonic() - self.t_start, 1)
        if measured_here:
            env["loadavg_at_end"] = loadavg()
        self.save()
        if plot is not None and not no_plot:
            plot(self.png_path)
        if show is not None:
            show()
        print(f"\nwrote {self.json_path}" + ("" if no_plot else f" and {self.png_path}")
              + (f" in {env['wall_s']} s" if wall else ""), flush=True)
