"""Atomic checkpoints of the training state in ``model_dir``, in TensorFlow's format.

Layout of ``model_dir``::

    checkpoint                       TensorFlow's index: the latest and the kept checkpoints
    ckpt-000000008/
        variables.index              the variables, a TensorFlow checkpoint (TensorBundle)
        variables.data-00000-of-00001
        checkpoint                   index of this directory alone ("variables")
        input-rank0.state, ...       each worker's input position: its tf.data iterator's
                                       state tensor, a serialized TensorProto (earlier
                                       releases: input-rank0.index and .data-*, a
                                       ``tf.train.Checkpoint(iterator=it)``)
        meta.json                    step, world size, what was saved

The variables file is name-based, like the checkpoints ``tf.compat.v1.train.Saver`` and
``tf.estimator`` wrote: ``tf.train.load_checkpoint`` and ``tf.train.list_variables``
read it from the directory, from the prefix ``ckpt-N/variables`` or from ``model_dir``.
Each variable is stored under its Estimator name (``Estimator.get_variable_names()``),
the Estimator's step under ``hostreduce/global_step`` (int64).

A checkpoint is written under a temporary name, every file and the directory are
fsynced (together: one flush's time, not one per file), and only then is the directory
renamed into place; the ``checkpoint`` index is replaced once that rename is on disk,
and old checkpoints are pruned last. A crash at any moment leaves
the previous checkpoint complete and indexed, and never exposes a half-written one; a
crash between the rename and the index's replacement leaves the index one checkpoint
behind, and the chief's next start points it at the newest (:meth:`repair_index`).
Only the newest ``keep_checkpoint_max`` are kept.

Checkpoints of the earlier format (``variables.npz``) still load, without input state.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from typing import Any, Mapping

import numpy as np

from .._files import fsync_paths, replace_atomically, write_file
from ..errors import CheckpointError

__all__ = ["CheckpointManager", "CheckpointError", "GLOBAL_STEP"]

_NAME = re.compile(r"^ckpt-(\d+)$")
_INPUT = re.compile(r"^input-rank(\d+)(\..+)$")
_TMP_PREFIX = ".tmp-ckpt-"
_VARIABLES = "variables"
_NPZ = "variables.npz"  # format 1
_META = "meta.json"
_INDEX = "checkpoint"
FORMAT_VERSION = 2
GLOBAL_STEP = "hostreduce/global_step"


def _index_text(latest: str, kept: list[str]) -> bytes:
    """TensorFlow's ``CheckpointState`` text proto (paths relative to its directory)."""
    lines = [f"model_checkpoint_path: {json.dumps(latest)}"]
    lines += [f"all_model_checkpoint_paths: {json.dumps(p)}" for p in kept]
    return ("\n".join(lines) + "\n").encode()


def _write_index(directory: str, latest: str, kept: list[str]) -> None:
    """Replace ``directory/checkpoint`` atomically, once ``directory``'s entries (the
    checkpoint it names) are on disk. The replacement itself is not flushed: lost in a
    crash, the index names the checkpoint before, which is whole too."""
    replace_atomically(os.path.join(directory, _INDEX), _index_text(latest, kept), sync_first=[directory],
                       durable=False)


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

    def find(self, step: int) -> str | None:
        """The path of the complete checkpoint of ``step``, if there is one."""
        path = os.path.join(self.model_dir, f"ckpt-{step:09d}")
        return path if os.path.isfile(os.path.join(path, _META)) else None

    @staticmethod
    def prefix(path: str) -> str:
        """What ``tf.train.Checkpoint`` and ``tf.train.load_checkpoint`` call the
        checkpoint in directory ``path`` (the directory itself for the npz format)."""
        return os.path.join(path, _VARIABLES) if os.path.isfile(os.path.join(path, _VARIABLES + ".index")) else path

    def save(self, step: int, arrays: Mapping[str, Any], meta: Mapping[str, Any] | None = None,
             inputs: Mapping[int, Mapping[str, bytes]] | None = None, prune: bool = True) -> str:
        """Write the checkpoint of ``step`` atomically; return its directory.

        Args:
            step: the global step.
            arrays: variable values by name (NumPy arrays or tensors).
            meta: extra JSON-serializable entries for ``meta.json``.
            inputs: each rank's input position: ``{rank: {suffix: file contents}}``, as
                :func:`hostreduce.estimator.input_state.save_iterator` returns them.
            prune: remove the checkpoints beyond ``keep_checkpoint_max`` (else the
                caller does, with :meth:`prune`).
        """
        if GLOBAL_STEP in arrays:
            raise CheckpointError(f"`arrays` must not hold the reserved name {GLOBAL_STEP!r}")
        os.makedirs(self.model_dir, exist_ok=True)
        final = os.path.join(self.model_dir, f"ckpt-{step:09d}")
        if os.path.isdir(final):
            return final
        self._remove_stale_temporaries()
        tmp = os.path.join(self.model_dir, f"{_TMP_PREFIX}{step}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.mkdir(tmp)
        try:
            names = list(arrays)
            _save_tensors(os.path.join(tmp, _VARIABLES), {GLOBAL_STEP: np.int64(step), **arrays})
            for rank, files in sorted((inputs or {}).items()):
                for suffix, data in files.items():
                    if not suffix.startswith(".") or "/" in suffix or os.sep in suffix:
                        raise CheckpointError(f"Input state of rank {rank}: invalid file suffix {suffix!r}")
                    write_file(os.path.join(tmp, f"input-rank{int(rank)}{suffix}"), data)
            write_file(os.path.join(tmp, _INDEX), _index_text(_VARIABLES, [_VARIABLES]))
            info = {"format": FORMAT_VERSION, "step": int(step), "names": names,
                    "input_ranks": sorted(int(r) for r in (inputs or {})), **dict(meta or {})}
            write_file(os.path.join(tmp, _META), json.dumps(info).encode())
            fsync_paths([os.path.join(tmp, name) for name in os.listdir(tmp)] + [tmp])
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._index(self.checkpoints())
        if prune:
            self.prune()
        return final

    def load(self, path: str | None = None) -> tuple[int, dict[str, np.ndarray], dict[str, Any]]:
        """``(step, arrays, meta)`` of the checkpoint in directory ``path`` (default:
        the latest checkpoint). ``arrays`` holds the variables only."""
        if path is None:
            latest = self.latest()
            if latest is None:
                raise CheckpointError(f"No checkpoint in model_dir={self.model_dir!r}")
            path = latest[1]
        meta_path = os.path.join(path, _META)
        try:
            with open(meta_path) as f:
                meta = json.load(f)
            if int(meta.get("format", 1)) == 1:
                with np.load(os.path.join(path, _NPZ)) as data:
                    arrays = {k: data[f"a{i}"] for i, k in enumerate(meta["keys"])}
            else:
                arrays = _load_tensors(os.path.join(path, _VARIABLES), meta["names"])
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"Checkpoint {path!r} cannot be read: {exc}") from exc
        except Exception as exc:  # TensorFlow's reader errors (NotFoundError, DataLossError, ...)
            raise CheckpointError(f"Checkpoint {path!r} cannot be read: {type(exc).__name__}: {exc}") from exc
        return int(meta["step"]), arrays, meta

    def load_inputs(self, path: str) -> dict[int, dict[str, bytes]]:
        """Each rank's input position saved in checkpoint directory ``path``, by rank."""
        found: dict[int, dict[str, bytes]] = {}
        try:
            for name in sorted(os.listdir(path)):
                match = _INPUT.match(name)
                if match:
                    with open(os.path.join(path, name), "rb") as f:
                        found.setdefault(int(match.group(1)), {})[match.group(2)] = f.read()
        except OSError as exc:
            raise CheckpointError(f"Checkpoint {path!r} cannot be read: {exc}") from exc
        return found

    def _index(self, found: list[tuple[int, str]]) -> None:
        kept = found[max(len(found) - self.keep_checkpoint_max, 0):]
        _write_index(self.model_dir, f"{os.path.basename(kept[-1][1])}/{_VARIABLES}",
                     [f"{os.path.basename(p)}/{_VARIABLES}" for _, p in kept])

    def repair_index(self) -> bool:
        """Point TensorFlow's ``checkpoint`` index at the newest complete checkpoint
        where it names an older one (a crash between a checkpoint's rename and the
        index's replacement leaves it so); return whether it was rewritten."""
        found = self.checkpoints()
        if not found:
            return False
        want = _index_text(f"{os.path.basename(found[-1][1])}/{_VARIABLES}", [])
        try:
            with open(os.path.join(self.model_dir, _INDEX), "rb") as f:
                if f.readline() == want.splitlines(keepends=True)[0]:
                    return False
        except FileNotFoundError:
            pass
        self._index(found)
        return True

    def prune(self) -> None:
        """Remove the checkpoints older than the newest ``keep_checkpoint_max``."""
        found = self.checkpoints()
        for _, path in found[: max(len(found) - self.keep_checkpoint_max, 0)]:
            shutil.rmtree(path, ignore_errors=True)

    def _remove_stale_temporaries(self) -> None:
        for name in os.listdir(self.model_dir):
            if name.startswith(_TMP_PREFIX):
                shutil.rmtree(os.path.join(self.model_dir, name), ignore_errors=True)


def _save_tensors(prefix: str, arrays: Mapping[str, Any]) -> None:
    """A name-based TensorFlow checkpoint at ``prefix`` (``SaveV2``, as ``tf.compat.v1.train.Saver``);
    ``arrays``' values are NumPy arrays or tensors (taken as they are: no copy)."""
    import tensorflow as tf

    names = list(arrays)
    with tf.device("/CPU:0"):
        tensors = [v if isinstance(v, tf.Tensor) else tf.convert_to_tensor(np.asarray(v)) for v in arrays.values()]
        tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names), tensors=tensors)


def _load_tensors(prefix: str, names: list[str]) -> dict[str, np.ndarray]:
    import tensorflow as tf

    reader = tf.train.load_checkpoint(prefix)
    return {name: np.asarray(reader.get_tensor(name)) for name in names}
