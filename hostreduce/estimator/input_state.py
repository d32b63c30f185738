"""The position of a worker's ``tf.data`` iterator, as bytes that can travel to the chief.

A ``tf.data`` iterator is checkpointable: ``tf.train.Checkpoint(iterator=it)`` writes
its position (buffered elements, shuffle buffers and seeds included) as a small
TensorFlow checkpoint. Each worker writes its own into a private directory of
TensorFlow's in-memory filesystem (``ram://``: no disk, whose metadata operations wait
for other writers' flushes) and packs the files into one byte string; the chief gathers every worker's string
through the job's reducer and stores them beside the variables, so workers need no
shared filesystem. Restoring is the reverse: the chief sends each worker its string and
the worker reads it back with ``tf.train.Checkpoint(iterator=it).read``.

A dataset whose state lives outside TensorFlow (``from_generator``, ``py_function``,
``numpy_function``) cannot be saved: TensorFlow refuses with
``FailedPreconditionError``, reported here as :class:`InputNotCheckpointable`.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import uuid
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from ..errors import HostReduceError, InputNotCheckpointable

__all__ = ["InputNotCheckpointable", "IteratorFiles", "save_iterator", "restore_iterator", "pack", "unpack",
           "gather", "broadcast"]

# File suffix (".index", ".data-00000-of-00001") -> contents, as tf.train.Checkpoint
# wrote them for one prefix.
IteratorFiles = Mapping[str, bytes]
_PREFIX = "input"


def save_iterator(iterator: Any) -> dict[str, bytes]:
    """The files of ``tf.train.Checkpoint(iterator=iterator)``, by suffix."""
    import tensorflow as tf

    with _ram_directory() as tmp:
        try:
            tf.train.Checkpoint(iterator=iterator).write(f"{tmp}/{_PREFIX}")
        except (tf.errors.FailedPreconditionError, tf.errors.UnimplementedError) as exc:
            raise InputNotCheckpointable(f"{type(exc).__name__}: {_reason(exc)}") from None
        files = {}
        for name in tf.io.gfile.listdir(tmp):
            if name.startswith(_PREFIX):
                with tf.io.gfile.GFile(f"{tmp}/{name}", "rb") as f:
                    files[name[len(_PREFIX):]] = f.read()
    return files


@contextlib.contextmanager
def _ram_directory() -> Iterator[str]:
    """A fresh directory of TensorFlow's in-memory filesystem, removed afterwards."""
    import tensorflow as tf

    path = f"ram://hostreduce-input-{os.getpid()}-{uuid.uuid4().hex}"
    tf.io.gfile.makedirs(path)
    try:
        yield path
    finally:
        tf.io.gfile.rmtree(path)


def _reason(exc: Exception) -> str:
    """TensorFlow's message without the function and op decorations around it."""
    text = str(getattr(exc, "message", exc)).strip()
    text = re.sub(r"\{\{[^}]*\}\}\s*", "", text)
    return re.sub(r"\s*\[Op:[^\]]*\].*$", "", text, flags=re.S).strip() or type(exc).__name__


def restore_iterator(iterator: Any, files: IteratorFiles) -> None:
    """Move ``iterator`` to the position that :func:`save_iterator` recorded in ``files``."""
    import tensorflow as tf

    with _ram_directory() as tmp:
        for suffix, data in files.items():
            if "/" in suffix or os.sep in suffix:
                raise HostReduceError(f"Input state holds an invalid file suffix {suffix!r}")
            with tf.io.gfile.GFile(f"{tmp}/{_PREFIX}{suffix}", "wb") as f:
                f.write(data)
        tf.train.Checkpoint(iterator=iterator).read(f"{tmp}/{_PREFIX}").assert_consumed()


def pack(files: IteratorFiles) -> bytes:
    """One byte string holding ``files`` (an ``.npz`` archive of ``uint8`` arrays)."""
    buffer = io.BytesIO()
    np.savez(buffer, **{f"f{i}": np.frombuffer(data, np.uint8) for i, data in enumerate(files.values())},
             names=np.array(list(files), dtype=str))
    return buffer.getvalue()


def unpack(blob: bytes) -> dict[str, bytes]:
    with np.load(io.BytesIO(blob), allow_pickle=False) as archive:
        names = [str(n) for n in archive["names"]]
        return {name: archive[f"f{i}"].tobytes() for i, name in enumerate(names)}


def _as_words(blob: bytes, length: int) -> np.ndarray:
    """``blob`` zero-padded to ``length`` int64 words (reducers carry numeric arrays)."""
    padded = blob + b"\0" * (8 * length - len(blob))
    return np.frombuffer(padded, np.int64).copy()


def _from_words(words: np.ndarray, size: int) -> bytes:
    return np.ascontiguousarray(words, np.int64).tobytes()[:size]


def gather(reducer: Any, blob: bytes | None, name: str) -> list[bytes | None]:
    """Every rank's ``blob`` (None where a rank has none), in rank order, on every rank:
    one all-gather of each rank's length word followed by its blob in words (ranks may
    send different lengths)."""
    own = np.array([-1], np.int64) if blob is None else \
        np.concatenate([np.array([len(blob)], np.int64), _as_words(blob, (len(blob) + 7) // 8)])
    words = reducer.allgather(f"{name}.blobs", own)
    found: list[bytes | None] = []
    at = 0
    for _ in range(reducer.size):
        size = int(words[at])
        length = 0 if size < 0 else (size + 7) // 8
        found.append(None if size < 0 else _from_words(words[at + 1:at + 1 + length], size))
        at += 1 + length
    if at != len(words):
        raise HostReduceError(f"All-gather {name!r}: {len(words)} words do not hold {reducer.size} blobs")
    return found


def broadcast(reducer: Any, blobs: Sequence[bytes | None] | None, name: str, root: int = 0) -> list[bytes | None]:
    """``root``'s ``blobs`` (one per rank, None where it has none) on every rank; the
    other ranks pass None."""
    ranks = reducer.size
    if blobs is not None and len(blobs) != ranks:
        raise HostReduceError(f"`blobs` must hold one entry per rank ({ranks}). Received: {len(blobs)} entries")
    own = np.array([-1 if b is None else len(b) for b in blobs], np.int64) if blobs is not None \
        else np.zeros(ranks, np.int64)
    sizes = [int(s) for s in reducer.broadcast(f"{name}.sizes", own, root=root)]
    offsets = np.cumsum([0] + [max((s + 7) // 8, 0) for s in sizes])
    if offsets[-1] == 0:
        return [None if s < 0 else b"" for s in sizes]
    if blobs is not None:
        data = np.concatenate([_as_words(b or b"", int(offsets[i + 1] - offsets[i])) for i, b in enumerate(blobs)])
    else:
        data = np.zeros(int(offsets[-1]), np.int64)
    data = reducer.broadcast(f"{name}.data", data, root=root)
    return [None if s < 0 else _from_words(data[offsets[i]:offsets[i + 1]], s) for i, s in enumerate(sizes)]
