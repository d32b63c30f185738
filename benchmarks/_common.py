"""Shared helpers of the hostreduce benchmarks: timing and repetition counts,
statistics, free ports, spawning worker processes that can never hang the run,
the environment record, and JSON/PNG result writing.

Everything here is standard library (plus matplotlib, imported only when a plot is
written) so that a benchmark's coordinating process stays light: TensorFlow, mpi4py
and hostreduce are imported by the worker processes only.
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
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

__all__ = [
    "REPO_ROOT",
    "KiB",
    "MiB",
    "GiB",
    "format_size",
    "parse_size",
    "choose_reps",
    "time_op",
    "bus_bandwidth_factor",
    "free_ports",
    "tf_config",
    "WorkerJob",
    "JobResult",
    "run_job",
    "read_jsonl",
    "environment",
    "command_output",
    "write_json",
    "plot_lines",
    "loadavg",
    "wait_for_quiet",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


# --------------------------------------------------------------------------- sizes


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


# --------------------------------------------------------------------------- timing


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


# --------------------------------------------------------------------------- processes


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ports that were free a moment ago (all held open at once, so they are distinct)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tf_config(addresses: Sequence[str], index: int, task_type: str = "worker") -> str:
    """The ``TF_CONFIG`` value of worker ``index`` in a cluster of ``addresses``."""
    return json.dumps({"cluster": {task_type: list(addresses)}, "task": {"type": task_type, "index": index}})


@dataclass
class WorkerJob:
    """One multi-process run: either one command per rank (``argvs``), each with its own
    extra environment, or a single launcher command (``argvs`` of length 1, e.g. mpirun)
    that starts the ranks itself.

    Every rank writes its pid to ``<workdir>/pid.<rank>`` first thing, so that ranks
    started by a launcher can be killed even when the launcher is stuck.
    """

    name: str
    argvs: list[list[str]]
    envs: list[dict[str, str]]
    workdir: Path
    timeout_s: float


@dataclass
class JobResult:
    name: str
    ok: bool
    seconds: float
    returncodes: list[int | None]
    error: str | None = None
    logs: dict[str, str] = field(default_factory=dict)


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode("utf-8", "replace")


def _kill_tree(procs: Iterable[subprocess.Popen], workdir: Path) -> None:
    """Terminate every process of a job: the process groups we started, then any rank
    pid the workers recorded (a launcher's children may live in other groups)."""
    pids: set[int] = set()
    for pidfile in workdir.glob("pid.*"):
        try:
            pids.add(int(pidfile.read_text().strip()))
        except (OSError, ValueError):
            pass
    procs = list(procs)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
        if sig == signal.SIGTERM and all(p.poll() is not None for p in procs) and not any(
            _alive(pid) for pid in pids
        ):
            break
    for p in procs:
        try:
            p.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours still answers; reaped ones do not.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return False


def run_job(job: WorkerJob, poll_s: float = 0.05) -> JobResult:
    """Start every process of ``job``, wait for all of them, and never hang.

    The job fails as soon as one process exits non-zero or the wall-clock timeout
    passes; the rest are then killed. stdout/stderr go to files in the workdir, whose
    tails are returned for the error report.
    """
    job.workdir.mkdir(parents=True, exist_ok=True)
    base_env = dict(os.environ)
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    start = time.monotonic()
    error = None
    try:
        for i, (argv, extra) in enumerate(zip(job.argvs, job.envs)):
            log = job.workdir / f"log.{i}"
            logs.append(log)
            env = {**base_env, **extra}
            with open(log, "wb") as fh:
                procs.append(subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True,
                                              cwd=str(REPO_ROOT)))
        while True:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                i, c = bad[0]
                error = f"process {i} exited with code {c}"
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() - start > job.timeout_s:
                error = f"timed out after {job.timeout_s:.0f} s"
                break
            time.sleep(poll_s)
    except BaseException as exc:  # KeyboardInterrupt included: never leave workers behind
        error = f"{type(exc).__name__}: {exc}"
        _kill_tree(procs, job.workdir)
        raise
    finally:
        if error is not None:
            _kill_tree(procs, job.workdir)
    seconds = time.monotonic() - start
    return JobResult(
        name=job.name,
        ok=error is None,
        seconds=seconds,
        returncodes=[p.poll() for p in procs],
        error=error,
        logs={log.name: _tail(log) for log in logs},
    )


def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSON-lines file; a torn last line (writer killed) is skipped."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass
    except FileNotFoundError:
        pass
    return out


# --------------------------------------------------------------------------- records


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
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    if extra:
        env.update(extra)
    return env


def loadavg() -> list[float]:
    """The 1-, 5- and 15-minute load averages, rounded for the record."""
    return [round(x, 2) for x in os.getloadavg()]


def wait_for_quiet(max_load: float, max_wait_s: float, poll_s: float = 15.0) -> dict[str, Any]:
    """Wait (at most ``max_wait_s``) until the 1-minute load average is <= ``max_load``;
    return what happened, for the result's environment record."""
    t0 = time.monotonic()
    load = os.getloadavg()[0]
    while load > max_load and time.monotonic() - t0 < max_wait_s:
        print(f"  1-min load {load:.2f} > {max_load}: waiting ({time.monotonic() - t0:.0f} s so far)", flush=True)
        time.sleep(poll_s)
        load = os.getloadavg()[0]
    return {"max_load": max_load, "waited_s": round(time.monotonic() - t0, 1), "load_1min_at_start": round(load, 2),
            "quiet": load <= max_load}


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(6.5 * max(1, len(panels)), 4.8),
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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_list(text: str, conv: Any) -> list[Any]:
    """``"a, b,c"`` -> ``[conv("a"), conv("b"), conv("c")]`` (empty items dropped)."""
    return [conv(t.strip()) for t in text.split(",") if t.strip()]


def add_run_options(p: Any, results_dir: str) -> None:
    """Options every multi-worker benchmark shares: quiet-machine wait, output, and the
    hidden options its own worker processes are started with."""
    import argparse

    p.add_argument("--max-load", type=float, default=None,
                   help="wait until the 1-minute load average is at most this (up to --max-wait-s)")
    p.add_argument("--max-wait-s", type=float, default=600.0)
    p.add_argument("--out", default=results_dir)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--keep-workdir", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
