"""Files that survive a crash whole or not at all: write to a temporary name, flush to
disk, rename over the target, then flush the directory (the rename is only durable once
the directory entry is). Both checkpoint writers (the Estimator's and the ps shards')
use these."""
from __future__ import annotations

import os
import uuid
from typing import IO, Callable

__all__ = ["fsync_path", "write_synced", "replace_atomically"]


def fsync_path(path: str) -> None:
    """Flush a file's or a directory's entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: str, data: bytes | Callable[[IO[bytes]], object]) -> None:
    """Write ``data`` (bytes, or a function that writes to the open file) to ``path``
    and flush it to disk."""
    with open(path, "wb") as f:
        if callable(data):
            data(f)
        else:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_atomically(path: str, data: bytes | Callable[[IO[bytes]], object]) -> None:
    """Replace ``path`` with ``data`` so that a reader, or a restart after a crash, sees
    the old file or the new one, never a part."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write_synced(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_path(directory)
