"""Coordinated checkpoints of every ps shard: all of step S, or the previous one.

Layout under ``directory``::

    ps-<step>/shard-<m>-of-<M>.npz   each ps's arrays: values, slots, apply counts
    ps-checkpoint.json               the index: the step, M, the placement, the optimizer

Each ps writes its shard to a temporary name, fsyncs it and renames it (a reader never
sees half a shard); the chief publishes the index the same way, and only once every ps
has answered that its shard of step S is written. A crash before that leaves the index
naming the previous step, whose shards are untouched, so no restore mixes two steps.
Restoring reads the index; a ps whose placement differs (another number of ps) picks its
rows out of the old shards through both placements (``placement.locate``).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Mapping, Sequence

import numpy as np

from .._files import fsync_path, replace_atomically
from ..errors import ConfigError
from .placement import Placement, locate
from .store import ITERATIONS

__all__ = ["INDEX", "shard_path", "write_shard", "publish_index", "read_index", "load_part", "load_tables", "prune"]

INDEX = "ps-checkpoint.json"


def _step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"ps-{step}")


def shard_path(directory: str, step: int, m: int, num_ps: int) -> str:
    return os.path.join(_step_dir(directory, step), f"shard-{m}-of-{num_ps}.npz")


def write_shard(directory: str, step: int, m: int, num_ps: int, arrays: Mapping[str, np.ndarray]) -> str:
    """Write ps ``m``'s arrays for ``step`` atomically; returns the file's path."""
    os.makedirs(_step_dir(directory, step), exist_ok=True)
    fsync_path(directory)  # the new step directory's entry
    path = shard_path(directory, step, m, num_ps)
    replace_atomically(path, lambda f: np.savez(f, **arrays))
    return path


def publish_index(directory: str, step: int, placement: Placement, optimizer_config: dict) -> None:
    """Name ``step`` as the checkpoint to restore (after every shard of it is written)."""
    missing = [m for m in range(placement.num_ps)
               if not os.path.exists(shard_path(directory, step, m, placement.num_ps))]
    if missing:
        raise ConfigError(f"cannot publish ps checkpoint step {step}: shards of ps {missing} are not written")
    body = json.dumps({"step": step, "placement": placement.to_json(), "optimizer": optimizer_config}).encode()
    replace_atomically(os.path.join(directory, INDEX), body)


def read_index(directory: str) -> dict[str, Any] | None:
    """The published index (``step``, ``placement``, ``optimizer``), or None if there is none."""
    try:
        with open(os.path.join(directory, INDEX), "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


def prune(directory: str, keep: int) -> None:
    """Remove all but the newest ``keep`` steps' shards, never the published one."""
    index = read_index(directory)
    steps = sorted(int(d[3:]) for d in os.listdir(directory) if d.startswith("ps-") and d[3:].isdigit())
    published = index["step"] if index else None
    for step in steps[:max(0, len(steps) - keep)]:
        if step != published:
            shutil.rmtree(_step_dir(directory, step), ignore_errors=True)


def load_part(directory: str, index: Mapping[str, Any], placement: Placement, m: int,
              slot_names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Ps ``m``'s arrays under ``placement`` from the checkpoint ``index`` names, re-sharded
    from the index's placement when they differ."""
    old = Placement.from_json(index["placement"])
    if sorted(s.to_json() for s in old.specs) != sorted(s.to_json() for s in placement.specs):
        raise ConfigError(f"the ps checkpoint in {directory!r} holds other variables than the ones registered")
    step = int(index["step"])
    files = [np.load(shard_path(directory, step, k, old.num_ps)) for k in range(old.num_ps)]
    try:
        out: dict[str, np.ndarray] = {}
        for name in placement.on(m):
            rows = placement[name].global_rows(m)
            owners, local = locate(old, name, rows)
            for key in [name] + [f"{name}/{s}" for s in slot_names]:
                first = files[int(owners[0])][key] if len(rows) else None
                part = np.empty((len(rows),) + placement[name].spec.shape[1:], dtype=first.dtype)
                for k in np.unique(owners):
                    sel = owners == k
                    part[sel] = files[int(k)][key].reshape((-1,) + placement[name].spec.shape[1:])[local[sel]]
                out[key] = part.reshape(placement[name].local_shape(m))
            out[f"{name}/{ITERATIONS}"] = np.array(max(int(files[int(k)][f"{name}/{ITERATIONS}"])
                                                       for k in np.unique(owners)), dtype=np.int64)
        return out
    finally:
        for f in files:
            f.close()


def load_tables(directory: str, step: int, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The whole values at ``step`` of those of ``names`` that the ps shard by rows (the
    tables a chief's checkpoint leaves to the ps shards); {} without shards of ``step``.
    Reads the shards of ``step`` even after the index moved on to a later step (an
    evaluator reading an older checkpoint), through the index's placement."""
    index = read_index(directory)
    if index is None:
        return {}
    placement = Placement.from_json(index["placement"])
    names = [n for n in names if n in placement and placement[n].sharded]
    paths = [shard_path(directory, step, m, placement.num_ps) for m in range(placement.num_ps)]
    if not names or not all(os.path.exists(p) for p in paths):
        return {}
    files = [np.load(p) for p in paths]
    try:
        return {n: placement[n].merge([f[n].reshape((-1,) + placement[n].spec.shape[1:]) for f in files])
                for n in names}
    finally:
        for f in files:
            f.close()
