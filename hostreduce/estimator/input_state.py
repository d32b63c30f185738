"""The position of a worker's ``tf.data`` iterator, as bytes that can travel to the chief.

A ``tf.data`` iterator is checkpointable: its state (buffered elements, shuffle buffers
and seeds included) is one variant tensor, the one ``tf.train.Checkpoint(iterator=it)``
stores. Each worker serializes that tensor as a ``TensorProto`` (``tf.io.serialize_tensor``,
``.state``): a tenth of the cost of writing a checkpoint of the iterator, which matters
because every save waits for it. The chief gathers every worker's bytes through the
job's reducer and stores them beside the variables, so workers need no shared
filesystem. Restoring is the reverse: the chief sends each worker its bytes and the
worker parses them back into its iterator. Positions saved by earlier releases, as a
``tf.train.Checkpoint`` of the iterator (``.index`` and ``.data-*`` files), are restored
the way they were written.

A dataset whose state lives outside TensorFlow (``from_generator``, ``py_function``,
``numpy_function``) cannot be saved: TensorFlow refuses with
``FailedPreconditionError``, reported here as :class:`InputNotCheckpointable`.
"""
from __future__ import annotations

import contextlib
import os
import re
import struct
import threading
import uuid
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from ..errors import HostReduceError, InputNotCheckpointable

__all__ = ["InputNotCheckpointable", "IteratorFiles", "save_iterator", "restore_iterator", "pack", "unpack",
           "gather", "start_gather", "broadcast"]

# File suffix -> contents: ".state" (the iterator's state tensor, serialized), or
# ".index" and ".data-00000-of-00001" as tf.train.Checkpoint wrote them for one prefix
# (earlier releases).
IteratorFiles = Mapping[str, bytes]
_PREFIX = "input"
_STATE = "_STATE"
_STATE_SUFFIX = ".state"


def save_iterator(iterator: Any) -> dict[str, bytes]:
    """``iterator``'s position: ``{".state": <its state tensor, serialized>}``."""
    import tensorflow as tf

    try:
        state = _state_tensors(iterator)[_STATE]
    except (tf.errors.FailedPreconditionError, tf.errors.UnimplementedError) as exc:
        raise InputNotCheckpointable(f"{type(exc).__name__}: {_reason(exc)}") from None
    return {_STATE_SUFFIX: tf.io.serialize_tensor(state).numpy()}


def _state_tensors(iterator: Any) -> dict[str, Any]:
    """The tensors ``tf.train.Checkpoint`` saves of ``iterator`` (TensorFlow's trackable
    protocol: ``{"_STATE": <variant>}`` for a ``tf.data`` iterator)."""
    serialize = getattr(iterator, "_serialize_to_tensors", None)
    if serialize is None:
        raise InputNotCheckpointable(f"{type(iterator).__name__} is not a tf.data iterator")
    tensors = serialize()
    if _STATE not in tensors:
        raise InputNotCheckpointable(f"{type(iterator).__name__} saves {sorted(tensors)}, not {_STATE!r}")
    return tensors


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

    for suffix in files:
        if "/" in suffix or os.sep in suffix:
            raise HostReduceError(f"Input state holds an invalid file suffix {suffix!r}")
    if _STATE_SUFFIX in files:
        try:
            state = tf.io.parse_tensor(files[_STATE_SUFFIX], tf.variant)
        except tf.errors.InvalidArgumentError as exc:
            raise HostReduceError(f"Input state {_STATE_SUFFIX!r} is not a serialized tensor: {_reason(exc)}") from None
        iterator._restore_from_tensors({_STATE: state})
        return
    with _ram_directory() as tmp:  # a tf.train.Checkpoint of the iterator (earlier releases)
        for suffix, data in files.items():
            with tf.io.gfile.GFile(f"{tmp}/{_PREFIX}{suffix}", "wb") as f:
                f.write(data)
        tf.train.Checkpoint(iterator=iterator).read(f"{tmp}/{_PREFIX}").assert_consumed()


def pack(files: IteratorFiles) -> bytes:
    """One byte string holding ``files``: their count, then each file's name and contents,
    each behind its length (little-endian 64-bit words)."""
    parts = [struct.pack("<q", len(files))]
    for name, data in files.items():
        encoded = name.encode()
        parts += [struct.pack("<q", len(encoded)), encoded, struct.pack("<q", len(data)), bytes(data)]
    return b"".join(parts)


def unpack(blob: bytes) -> dict[str, bytes]:
    """The files :func:`pack` packed into ``blob``."""
    view, at = memoryview(blob), 0

    def take(size: int) -> memoryview:
        nonlocal at
        if size < 0 or at + size > len(view):
            raise HostReduceError(f"Input state of {len(view)} bytes is cut short or malformed (at byte {at})")
        at += size
        return view[at - size:at]

    def length() -> int:
        return struct.unpack("<q", take(8))[0]

    files = {}
    count = length()
    if count < 0:
        raise HostReduceError(f"Input state of {len(view)} bytes is malformed (it counts {count} files)")
    for _ in range(count):
        name = bytes(take(length())).decode(errors="replace")
        files[name] = bytes(take(length()))
    if at != len(view):
        raise HostReduceError(f"Input state of {len(view)} bytes has {len(view) - at} bytes after its files")
    return files


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
    return start_gather(reducer, blob, name)()


def start_gather(reducer: Any, blob: bytes | None, name: str) -> Callable[[], list[bytes | None]]:
    """:func:`gather`, started: the all-gather runs while the caller goes on, and the
    function returned waits for it and returns the blobs (raising its error); it may be
    called again, from any thread, and parses them once."""
    own = np.array([-1], np.int64) if blob is None else \
        np.concatenate([np.array([len(blob)], np.int64), _as_words(blob, (len(blob) + 7) // 8)])
    handle = reducer.allgather_async(f"{name}.blobs", own)
    lock, parsed = threading.Lock(), []  # (the blobs, once parsed)

    def blobs() -> list[bytes | None]:
        words = handle.wait()  # (raises the collective's error, every call)
        with lock:
            if not parsed:
                parsed.append(split(words))
            return parsed[0]

    def split(words: np.ndarray) -> list[bytes | None]:
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

    return blobs


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
