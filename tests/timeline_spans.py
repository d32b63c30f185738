"""Reading a hostreduce timeline's spans in tests."""
from __future__ import annotations

from typing import Any, Sequence


def reduction_starts(spans: Sequence[dict[str, Any]], label_suffix: str) -> list[float]:
    """Start times of the all-reduces that carried the tensor whose label ends with
    ``label_suffix``: alone (a span named after it) or in a bucket (listed in its args)."""
    return [e["ts"] for e in spans if e["name"].startswith("allreduce") and (
        e["name"].endswith(label_suffix) or any(t.endswith(label_suffix) for t in e["args"].get("tensors", ())))]
