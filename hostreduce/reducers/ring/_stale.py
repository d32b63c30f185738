"""A one-host job's entries in /dev/shm: who owns them, and removing them when no owner
is left.

Every entry of a job is named ``hostreduce-<token>-...`` after the job's random token.
Rank 0 writes ``hostreduce-<token>-owners`` (every rank's pid and start time) before it
creates anything else, and it is removed last, so any entry a killed job leaves behind
sits next to that file. Survivors of a failed job remove the job's entries when they
close; entries of a job none of whose processes is alive any more (all killed) are
removed by the next job that starts on the host (``sweep``). Entries of a job with a
live process, and anything not made this way, are never touched.
"""
from __future__ import annotations

import os
import re
import shutil

__all__ = ["DIR", "start_time", "write_owners", "remove_job", "sweep"]

DIR = "/dev/shm"
_OWNERS = re.compile(r"hostreduce-([0-9a-f]{16})-owners")


def _owners_path(token: str) -> str:
    return os.path.join(DIR, f"hostreduce-{token}-owners")


def start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (tells a reused pid apart);
    -1 when there is no such process or it has exited (a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return -1
    fields = stat[stat.rfind(b")") + 2:].split()
    if not fields or fields[0] in (b"Z", b"X"):
        return -1
    return int(fields[19])


def write_owners(token: str, pids: list[int], starts: list[int]) -> None:
    """Rank 0, before it creates the job's other entries."""
    text = "".join(f"{p} {s}\n" for p, s in zip(pids, starts))
    fd = os.open(_owners_path(token), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def remove_job(token: str) -> None:
    """Remove every entry of the job (the owners file last). Best effort."""
    prefix = f"hostreduce-{token}-"
    owners = _owners_path(token)
    try:
        names = [n for n in os.listdir(DIR) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        path = os.path.join(DIR, name)
        if path == owners:
            continue
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
        except OSError:
            pass
    try:
        os.unlink(owners)
    except OSError:
        pass


def _all_dead(path: str) -> bool:
    try:
        st = os.lstat(path)
        if st.st_uid != os.getuid():
            return False
        with open(path) as f:
            owners = [tuple(int(v) for v in line.split()) for line in f if line.strip()]
    except (OSError, ValueError):
        return False
    if not owners or any(len(o) != 2 for o in owners):
        return False
    return all(start_time(pid) != start for pid, start in owners)


def sweep() -> int:
    """Remove the entries of every job of this user whose processes have all exited;
    returns how many jobs were cleaned."""
    try:
        names = os.listdir(DIR)
    except OSError:
        return 0
    cleaned = 0
    for name in names:
        m = _OWNERS.fullmatch(name)
        if m and _all_dead(os.path.join(DIR, name)):
            remove_job(m.group(1))
            cleaned += 1
    return cleaned
