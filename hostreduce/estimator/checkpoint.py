"""Atomic checkpoints of the training state in ``model_dir``.

A checkpoint is a directory ``ckpt-<step>`` holding ``variables.npz`` and ``meta.json``.
It is written under a temporary name, every file and the directory are fsynced, and
only then is it renamed into place, so a crash at any moment leaves the previous
checkpoints intact and never exposes a half-written one. Only the newest
``keep_checkpoint_max`` are kept.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from typing import Any, Mapping

import numpy as np

from ..errors import HostReduceError

__all__ = ["CheckpointManager", "CheckpointError"]

_NAME = re.compile(r"^ckpt-(\d+)$")
_TMP_PREFIX = ".tmp-ckpt-"
_VARIABLES = "variables.npz"
_META = "meta.json"
FORMAT_VERSION = 1


class CheckpointError(HostReduceError):
    """A checkpoint could not be read or written."""


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    """Writes, lists, loads and prunes the checkpoints of one ``model_dir``."""

    def __init__(self, model_dir: str, keep_checkpoint_max: int = 5) -> None:
        self.model_dir = model_dir
        self.keep_checkpoint_max = keep_checkpoint_max

    def checkpoints(self) -> list[tuple[int, str]]:
        """``(step, path)`` of every complete checkpoint, oldest first."""
        try:
            names = os.listdir(self.model_dir)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            match = _NAME.match(name)
            path = os.path.join(self.model_dir, name)
            if match and os.path.isfile(os.path.join(path, _META)):
                found.append((int(match.group(1)), path))
        return sorted(found)

    def latest(self) -> tuple[int, str] | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def save(self, step: int, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any] | None = None) -> str:
        """Write the checkpoint of ``step`` atomically; return its path."""
        os.makedirs(self.model_dir, exist_ok=True)
        final = os.path.join(self.model_dir, f"ckpt-{step:09d}")
        if os.path.isdir(final):
            return final
        self._remove_stale_temporaries()
        tmp = os.path.join(self.model_dir, f"{_TMP_PREFIX}{step}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.mkdir(tmp)
        try:
            keys = list(arrays)
            with open(os.path.join(tmp, _VARIABLES), "wb") as f:
                np.savez(f, **{f"a{i}": np.asarray(arrays[k]) for i, k in enumerate(keys)})
                f.flush()
                os.fsync(f.fileno())
            info = {"format": FORMAT_VERSION, "step": int(step), "keys": keys, **dict(meta or {})}
            with open(os.path.join(tmp, _META), "w") as f:
                json.dump(info, f)
                f.flush()
                os.fsync(f.fileno())
            _fsync_path(tmp)
            os.rename(tmp, final)
            _fsync_path(self.model_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune()
        return final

    def load(self, path: str | None = None) -> tuple[int, dict[str, np.ndarray], dict[str, Any]]:
        """``(step, arrays, meta)`` of ``path`` (default: the latest checkpoint)."""
        if path is None:
            latest = self.latest()
            if latest is None:
                raise CheckpointError(f"No checkpoint in model_dir={self.model_dir!r}")
            path = latest[1]
        try:
            with open(os.path.join(path, _META)) as f:
                meta = json.load(f)
            with np.load(os.path.join(path, _VARIABLES)) as data:
                arrays = {k: data[f"a{i}"] for i, k in enumerate(meta["keys"])}
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"Checkpoint {path!r} cannot be read: {exc}") from exc
        return int(meta["step"]), arrays, meta

    def _prune(self) -> None:
        found = self.checkpoints()
        for _, path in found[: max(len(found) - self.keep_checkpoint_max, 0)]:
            shutil.rmtree(path, ignore_errors=True)

    def _remove_stale_temporaries(self) -> None:
        for name in os.listdir(self.model_dir):
            if name.startswith(_TMP_PREFIX):
                shutil.rmtree(os.path.join(self.model_dir, name), ignore_errors=True)
