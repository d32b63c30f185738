"""Chrome-trace timelines of training steps, one JSON file per rank.

Opt-in with ``RunConfig(timeline_dir=...)`` or ``HOSTREDUCE_TIMELINE=DIR``. Each rank
writes ``DIR/timeline-rank{r}.json`` (open it in ``chrome://tracing`` or Perfetto) with
spans for the forward pass, the backward pass, each gradient's hand-off to the host,
each reduction (submit to completion) and the host apply.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Any, Iterator

__all__ = ["Timeline", "timeline_dir_from_env", "ENV_VAR"]

ENV_VAR = "HOSTREDUCE_TIMELINE"

# Rows of the trace; reductions get one row per tensor so their spans may overlap.
STEP_ROW = 0
HANDOFF_ROW = 1
REDUCE_ROW_BASE = 100


def timeline_dir_from_env() -> str | None:
    return os.environ.get(ENV_VAR) or None


def now_us() -> float:
    return time.perf_counter_ns() / 1000.0


class Timeline:
    """Collects trace events in memory; :meth:`flush` writes them atomically.

    A timeline built with ``directory=None`` records nothing and costs nothing.
    """

    def __init__(self, directory: str | os.PathLike[str] | None, rank: int = 0) -> None:
        self.directory = os.fspath(directory) if directory else None
        self.rank = rank
        self._file: str | None = None
        self._events: list[dict[str, Any]] = []
        self._rows: dict[str, int] = {}
        self._lock = threading.Lock()
        if self.enabled:
            self._meta(STEP_ROW, "step")
            self._meta(HANDOFF_ROW, "device->host hand-off")

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    @property
    def path(self) -> str | None:
        if self.directory is None:
            return None
        if self._file is not None:
            return self._file
        return os.path.join(self.directory, f"timeline-rank{self.rank}.json")

    def start(self, file_path: str) -> None:
        """Record from now on into ``file_path`` (``hvd.start_timeline``)."""
        with self._lock:
            self._file = file_path
            self.directory = os.path.dirname(file_path) or "."
            self._events, self._rows = [], {}
        self._meta(STEP_ROW, "step")
        self._meta(HANDOFF_ROW, "device->host hand-off")

    def stop(self) -> None:
        """Write what was recorded and stop recording (``hvd.stop_timeline``)."""
        self.flush()
        with self._lock:
            self.directory, self._file = None, None
            self._events, self._rows = [], {}

    def _meta(self, tid: int, name: str) -> None:
        self._events.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": name}})

    def reduce_row(self, tensor: str) -> int:
        with self._lock:
            row = self._rows.get(tensor)
            if row is None:
                row = self._rows[tensor] = REDUCE_ROW_BASE + len(self._rows)
                self._meta(row, f"reduce {tensor}")
            return row

    def span(self, name: str, start_us: float, end_us: float, cat: str, tid: int = STEP_ROW,
             args: dict[str, Any] | None = None) -> None:
        if not self.enabled:
            return
        event = {"name": name, "cat": cat, "ph": "X", "ts": start_us, "dur": max(end_us - start_us, 0.0),
                 "pid": self.rank, "tid": tid}
        if args:
            event["args"] = args
        with self._lock:
            self._events.append(event)

    @contextlib.contextmanager
    def scope(self, name: str, cat: str, tid: int = STEP_ROW, args: dict[str, Any] | None = None) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = now_us()
        try:
            yield
        finally:
            self.span(name, start, now_us(), cat, tid, args)

    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events)

    def flush(self) -> None:
        """Write every event so far to :attr:`path` (temp file, then rename)."""
        if not self.enabled:
            return
        os.makedirs(self.directory, exist_ok=True)  # type: ignore[arg-type]
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": self.events(), "displayTimeUnit": "ms"}, f)
        os.replace(tmp, self.path)  # type: ignore[arg-type]
