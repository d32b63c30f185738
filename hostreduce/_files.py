"""Files that survive a crash whole or not at all: write to a temporary name, flush to
disk, rename over the target, then flush the directory (the rename is only durable once
the directory entry is). Both checkpoint writers (the Estimator's and the ps shards')
use these.

Flushing several paths costs about one flush when they are flushed together
(:func:`fsync_paths`): the filesystem commits them in one journal transaction, where
one after the other each waits for its own (about 2 ms against 25 ms for the nine
files and directory of an Estimator checkpoint here).
"""
from __future__ import annotations

import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Callable, Iterable

__all__ = ["fsync_path", "fsync_paths", "write_file", "replace_atomically"]

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_POOL_THREADS = 8


def fsync_path(path: str) -> None:
    """Flush a file's or a directory's entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_paths(paths: Iterable[str]) -> None:
    """Flush every one of ``paths`` (files or directories) to disk, all at once; return
    when every flush is done, raising the first error."""
    global _pool
    paths = list(paths)
    if len(paths) <= 1:
        for path in paths:
            fsync_path(path)
        return
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix="hostreduce-fsync")
    for future in [_pool.submit(fsync_path, path) for path in paths]:
        future.result()


def write_file(path: str, data: bytes) -> None:
    """Write ``data`` to ``path``, not flushed (the caller flushes it with others)."""
    with open(path, "wb") as f:
        f.write(data)


def replace_atomically(path: str, data: bytes | Callable[[IO[bytes]], object], sync_first: Iterable[str] = (),
                       durable: bool = True) -> None:
    """Replace ``path`` with ``data`` so that a reader, or a restart after a crash, sees
    the old file or the new one, never a part. ``sync_first``: paths flushed together
    with the new data, all before the replacement (what the new file refers to);
    ``durable``: flush the directory after the replacement, so that a crash cannot
    bring the old file back."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
        fsync_paths([tmp, *sync_first])
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    if durable:
        fsync_path(directory)
