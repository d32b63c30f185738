"""Shared-memory data path between ranks on one host.

Each rank owns a POSIX shared-memory segment split into two regions used alternately
by consecutive collectives (so a fast rank never overwrites data a slow rank still
reads). All-reduce: every rank writes its input into its region; after a barrier,
rank r reduces slice r of all regions into its own region; after a second barrier
every rank copies the reduced slices out. Each slice is computed by one rank only, so
results are bitwise identical everywhere. Barriers are per-rank counters in a small
control segment; waits yield the CPU and give up on a peer failure or a timeout.

Segment names are derived from a per-job random token; files are created with mode
0600 and unlinked as soon as every rank has mapped them. A rank killed in between leaves
a name behind, which the job's survivors or the next job remove (``_stale.py``).
"""
from __future__ import annotations

import mmap
import os
import sys
import time
from typing import Callable, Sequence

import numpy as np

from ...errors import PeerLostError
from . import _futex
from .algorithm import finalize, reduce_into, segment_bounds
from ..base import ReduceOp

__all__ = ["ShmGroup", "LANE_SLOW", "LANE_GONE"]

_DIR = "/dev/shm"
_ALIGN = 64
_BLOCK_BYTES = 1024 * 1024
_SPIN_S = 1e-3     # yield the CPU this long before sleeping, when every rank has a core
# Lane words (see ``ShmGroup.lane_post``): keys are 63-bit hashes, so these never collide.
LANE_SLOW = -1    # this rank negotiates this round through rank 0
LANE_GONE = -2    # this rank closed its reducer
LANE_LEFT = 1 << 62   # the round a closed rank reports: past every real one
_FUTEX_SLICE_S = 0.05   # longest single sleep: failures and the timeout are checked between


class _Segment:
    def __init__(self, name: str, nbytes: int, create: bool) -> None:
        self.path = os.path.join(_DIR, name)
        self.nbytes = nbytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            self.map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.owner = create

    def view(self, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
        return np.frombuffer(self.map, dtype=dtype, count=count, offset=offset)

    def unlink(self) -> None:
        if self.owner:
            self.owner = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a numpy view is still alive; the mapping goes with the process
            pass
        self.unlink()


class _Waiter:
    """Waits for peers' counters. Yields the CPU for up to 1 ms when every rank has a core
    (waking a sleeping process costs more than that wait, in a virtual machine above all),
    then sleeps in the kernel on the bell word of the first late rank, which that
    rank rings whenever it moves a counter; without futexes, sleeps that double up to
    1 ms. Gives up on a peer failure or after the timeout, naming the late ranks."""

    __slots__ = ("group", "what", "start", "spins", "nap", "on_timeout")

    def __init__(self, group: "ShmGroup", what: str,
                 on_timeout: Callable[[list[int]], BaseException] | None = None) -> None:
        self.group, self.what, self.start, self.spins, self.nap = group, what, 0.0, 0, 10e-6
        self.on_timeout = on_timeout

    def idle(self, late: Callable[[], list[int]]) -> None:
        g = self.group
        self.spins += 1
        if self.spins < 64:
            os.sched_yield()
            return
        if self.start == 0.0:
            self.start = time.monotonic()
        err = g._failed()
        if err is not None:
            raise err
        waited = time.monotonic() - self.start
        if waited > g._timeout:
            silent = g._not_answering() if g._not_answering is not None else None
            if silent is not None:  # the likely cause, whatever this wait was for
                raise silent
            if self.on_timeout is not None:
                raise self.on_timeout(late())
            raise PeerLostError(
                f"Rank {g.rank}: ranks {late()} did not reach {self.what} within "
                f"{g._timeout} s (hung or dead)"
            )
        if waited < g._spin_s:
            os.sched_yield()
            return
        if g._bells is not None:
            rung = [int(b) for b in g._bells]   # read before the check: no lost wake-up
            lag = [j for j in late() if j != g.rank]  # nobody else rings this rank's bell
            if lag:
                _futex.wait(g._bell_addr[lag[0]], rung[lag[0]], min(_FUTEX_SLICE_S, g._timeout - waited + 1e-3))
            return
        time.sleep(self.nap)
        self.nap = min(self.nap * 2, 1e-3)


class ShmGroup:
    """Collectives through shared memory among ``size`` ranks of one host."""

    # One 64-byte line per rank for each of these control words.
    _FIELDS = ("barrier", "copied", "reduced", "pid", "addr", "cma_ok", "done", "bell",
               "lane", "lane_k0", "lane_k1")

    def __init__(self, rank: int, size: int, token: str, timeout_s: float,
                 failed: Callable[[], BaseException | None], use_cma: bool = True,
                 not_answering: Callable[[], BaseException | None] | None = None) -> None:
        """``failed()`` is the job's error, if any (waits give up on it); after a wait
        times out, ``not_answering()`` is the error naming a peer that stopped answering,
        if one has, raised in place of the timeout."""
        self.rank, self.size = rank, size
        self._token = token
        self._timeout = timeout_s
        self._failed = failed
        self._not_answering = not_answering
        ctl_name = f"hostreduce-{token}-ctl"
        # Rank 0 creates the control segment before announcing the token to peers.
        self._ctl = _Segment(ctl_name, self._ctl_bytes(), create=True) if rank == 0 else None
        self._counters: np.ndarray | None = None
        self._copied: np.ndarray | None = None
        self._reduced: np.ndarray | None = None
        self._words: dict[str, np.ndarray] = {}
        self._direct: bool | None = None if use_cma else False
        self._direct_ops = 0
        self._lane_left = False
        self._probe = np.full(8, 0x5EED0000 + rank, np.int64)
        # Spinning only pays when every rank has a core; with more ranks than cores a
        # spinning rank takes the CPU from the peer it waits for.
        self._spin_s = _SPIN_S if size <= len(os.sched_getaffinity(0)) else 0.0
        self._use_futex = _futex.available()
        self._bells: np.ndarray | None = None
        self._bell_addr: list[int] = []
        self._seq = 0
        self._copied_base = 0
        self._reduced_base = [0] * size
        self._op = 0
        self._cap = [0] * size      # bytes per region of each rank's segment
        self._gen = [0] * size
        self._segs: list[_Segment | None] = [None] * size

    def release_names(self) -> None:
        """Remove the control segment's name once every rank has mapped it."""
        self._ensure_ctl()
        if self._ctl is not None:
            self._ctl.unlink()

    def _ctl_bytes(self) -> int:
        return _ALIGN * self.size * len(self._FIELDS)

    def _ensure_ctl(self) -> np.ndarray:
        if self._counters is None:
            if self._ctl is None:
                self._ctl = _Segment(f"hostreduce-{self._token}-ctl", self._ctl_bytes(), create=False)
            words = self._ctl.view(np.dtype(np.int64), 0, self._ctl_bytes() // 8)[:: _ALIGN // 8]
            for i, field in enumerate(self._FIELDS):
                self._words[field] = words[i * self.size: (i + 1) * self.size]
            self._counters = self._words["barrier"]
            bells = self._words["bell"]
            if self._use_futex:
                self._bells = bells
                low = 4 if sys.byteorder == "big" else 0   # the futex word is the counter's low half
                self._bell_addr = [bells.ctypes.data + j * bells.strides[0] + low for j in range(self.size)]
            self._copied = self._words["copied"]
            self._reduced = self._words["reduced"]
        return self._counters

    # ------------------------------------------------------------------ single-copy path
    def direct_available(self) -> bool:
        """Whether every rank can read every peer's memory (probed once, collectively)."""
        if self._direct is None:
            from . import _cma

            self._ensure_ctl()
            w = self._words
            ok = _cma.available()
            if ok:
                _cma.allow_peers()
            w["pid"][self.rank] = os.getpid()
            w["addr"][self.rank] = self._probe.ctypes.data
            self.barrier()
            if ok:
                got = np.zeros(8, np.int64)
                for j in range(self.size):
                    if j == self.rank:
                        continue
                    try:
                        _cma.read_into(int(w["pid"][j]), int(w["addr"][j]), got)
                    except OSError:
                        ok = False
                        break
                    if int(got[0]) != 0x5EED0000 + j:
                        ok = False
                        break
            w["cma_ok"][self.rank] = 1 if ok else 2
            self.barrier()
            self._direct = all(int(v) == 1 for v in w["cma_ok"])
            self._pids = [int(p) for p in w["pid"]]
        return bool(self._direct)

    def allreduce_direct(self, buf: np.ndarray, op: ReduceOp) -> None:
        """All-reduce the private flat array ``buf`` in place, reading peers' buffers
        directly (no shared segment): rank r reduces slice r from every peer's buffer,
        then copies every other slice from its owner. Three counter waits per call."""
        from . import _cma

        n = buf.size
        if n == 0:
            return
        w = self._words
        size, rank = self.size, self.rank
        self._direct_ops += 1
        seq = self._direct_ops
        w["addr"][rank] = buf.ctypes.data
        target_c = self._copied_base + 1
        self._post("copied", target_c)
        bounds = segment_bounds(n, size)
        waiter = _Waiter(self, "a direct all-reduce (buffers published)")
        while int(w["copied"].min()) < target_c:
            waiter.idle(lambda: [j for j in range(size) if int(w["copied"][j]) < target_c])
        addrs = [int(a) for a in w["addr"]]
        item = buf.dtype.itemsize
        lo, hi = bounds[rank], bounds[rank + 1]
        block = max(1, _BLOCK_BYTES // item)
        tmp = self._scratch(buf.dtype, min(block, max(hi - lo, 1)))
        try:
            for a in range(lo, hi, block):
                b = min(hi, a + block)
                acc = buf[a:b]
                t = tmp[: b - a]
                for j in range(size):
                    if j != rank:
                        _cma.read_into(self._pids[j], addrs[j] + a * item, t)
                        reduce_into(acc, t, op)
                finalize(acc, op, size)
            self._post("reduced", self._reduced_base[rank] + 1)
            for k in range(1, size):
                j = (rank + k) % size
                target_r = self._reduced_base[j] + 1
                waiter = _Waiter(self, f"rank {j}'s reduced slice")
                while int(w["reduced"][j]) < target_r:
                    waiter.idle(lambda: [j] if int(w["reduced"][j]) < target_r else [])
                a, b = bounds[j], bounds[j + 1]
                _cma.read_into(self._pids[j], addrs[j] + a * item, buf[a:b])
        except OSError as e:
            raise PeerLostError(f"Rank {rank}: reading rank {j}'s buffer failed ({e}); rank {j} has probably "
                                "exited") from None
        self._copied_base += 1
        for j in range(size):
            self._reduced_base[j] += 1
        self._post("done", seq)
        waiter = _Waiter(self, "the end of a direct all-reduce")
        while int(w["done"].min()) < seq:  # peers may still be reading our slice
            waiter.idle(lambda: [j for j in range(size) if int(w["done"][j]) < seq])

    # ------------------------------------------------------------------ fast lane
    def lane_post(self, seq: int, key: int) -> None:
        """Post this rank's word for lane round ``seq``: a collective's key, or LANE_SLOW.
        Rounds alternate between two key slots, so a rank one round ahead never
        overwrites a key that a peer has yet to read. Nothing after ``lane_leave``."""
        if self._lane_left:
            return
        self._ensure_ctl()
        self._words[f"lane_k{seq % 2}"][self.rank] = key
        self._post("lane", seq)

    def lane_withdraw(self, seq: int) -> None:
        """Turn this rank's word for round ``seq`` into LANE_SLOW (after giving up on it)."""
        if not self._lane_left:
            self._words[f"lane_k{seq % 2}"][self.rank] = LANE_SLOW

    def lane_decided(self, seq: int) -> bool:
        """Whether every rank has posted its word for round ``seq``."""
        return not self._lane_left and int(self._ensure_ctl_words()["lane"].min()) >= seq

    def lane_slow_posted(self, seq: int) -> bool:
        """Whether some open rank has already posted a "slow" word for round ``seq`` (a
        closed rank's words say "gone", which ``lane_keys`` reports)."""
        w = self._ensure_ctl_words()
        lane, keys = w["lane"], w[f"lane_k{seq % 2}"]
        return any(seq <= int(lane[j]) < LANE_LEFT and int(keys[j]) == LANE_SLOW
                   for j in range(self.size) if j != self.rank)

    def lane_latest(self) -> int:
        """The latest round any open rank has posted for."""
        return max(int(v) for v in self._ensure_ctl_words()["lane"] if int(v) < LANE_LEFT)

    def lane_keys(self, seq: int, what: str, on_timeout: Callable[[list[int]], BaseException]) -> list[int]:
        """Wait until every rank has posted its word for round ``seq``; return the keys.
        ``on_timeout`` makes the error raised after the timeout, from the late ranks."""
        lane = self._ensure_ctl_words()["lane"]
        size = self.size

        def late() -> list[int]:
            return [j for j in range(size) if int(lane[j]) < seq]

        waiter = _Waiter(self, what, on_timeout)
        while int(lane.min()) < seq:
            waiter.idle(late)
        return [int(k) for k in self._words[f"lane_k{seq % 2}"]]

    def lane_leave(self) -> None:
        """At close: every later round sees this rank as gone, so no peer waits for it.
        Final: this rank posts nothing after it."""
        if self._counters is None or self._lane_left:
            return
        self._lane_left = True
        self._words["lane_k0"][self.rank] = LANE_GONE
        self._words["lane_k1"][self.rank] = LANE_GONE
        self._post("lane", LANE_LEFT)

    def _ensure_ctl_words(self) -> dict[str, np.ndarray]:
        self._ensure_ctl()
        return self._words

    def _scratch(self, dtype: np.dtype, count: int) -> np.ndarray:
        buf = getattr(self, "_tmp", None)
        if buf is None or buf.nbytes < count * dtype.itemsize:
            buf = self._tmp = np.empty(max(count * dtype.itemsize, _BLOCK_BYTES), np.uint8)
        return buf[: count * dtype.itemsize].view(dtype)

    def _post(self, field: str, value: int) -> None:
        """Set this rank's ``field`` counter and ring its bell for peers waiting on it."""
        self._words[field][self.rank] = value
        bells = self._words["bell"]
        bells[self.rank] += 1
        if self._bells is not None:
            _futex.wake(self._bell_addr[self.rank])

    # ------------------------------------------------------------------ sync
    def barrier(self) -> None:
        counters = self._ensure_ctl()
        self._seq += 1
        target = self._seq
        self._post("barrier", target)
        waiter = _Waiter(self, f"shared-memory barrier #{target}")
        while int(counters.min()) < target:
            waiter.idle(lambda: [r for r in range(self.size) if int(counters[r]) < target])

    # ------------------------------------------------------------------ buffers
    def _prepare(self, needs: Sequence[int]) -> int:
        """Grow segments so that rank j's region holds ``needs[j]`` bytes (every rank
        computes the same growth from the same negotiated sizes). Returns the region
        index this collective uses."""
        grew = False
        for j, need in enumerate(needs):
            if need > self._cap[j]:
                cap = max(1 << 16, 1 << (need - 1).bit_length())
                self._cap[j] = cap
                self._gen[j] += 1
                old = self._segs[j]
                self._segs[j] = None
                if old is not None:
                    old.close()
                if j == self.rank:
                    self._segs[j] = _Segment(self._name(j), 2 * cap, create=True)
                grew = True
        if grew:
            # Attach to every new segment once its owner created it, then remove the
            # names at once: the mappings stay valid and names last only while a
            # segment grows.
            self.barrier()
            for j in range(self.size):
                self._peer(j) if self._cap[j] else None
            self.barrier()
            own = self._segs[self.rank]
            if own is not None:
                own.unlink()
        region = self._op & 1
        self._op += 1
        return region

    def _name(self, j: int) -> str:
        return f"hostreduce-{self._token}-r{j}-g{self._gen[j]}"

    def _peer(self, j: int) -> _Segment:
        seg = self._segs[j]
        if seg is None:  # created by its owner before the barrier we just passed
            seg = self._segs[j] = _Segment(self._name(j), 2 * self._cap[j], create=False)
        return seg

    def _region(self, j: int, region: int, dtype: np.dtype, count: int) -> np.ndarray:
        seg = self._peer(j)
        return seg.view(dtype, region * self._cap[j], count)

    # ------------------------------------------------------------------ collectives
    def allreduce(self, parts: Sequence[np.ndarray], dtype: np.dtype, n: int, op: ReduceOp,
                  out: np.ndarray) -> None:
        """Reduce the concatenation of flat ``parts`` (n elements) into flat ``out``.

        Pipelined in cache-sized blocks: every rank copies block b in and bumps its
        "copied" counter; block b's owner (b mod size) reduces it once every rank has
        copied it and bumps its "reduced" counter; every rank copies it out once it is
        reduced. A block stays in cache between the three steps, and no full-buffer
        barrier separates them.
        """
        if n == 0:
            return
        self._ensure_ctl()
        copied, reduced = self._copied, self._reduced
        assert copied is not None and reduced is not None
        region = self._prepare([n * dtype.itemsize] * self.size)
        views = [self._region(j, region, dtype, n) for j in range(self.size)]
        mine = views[self.rank]
        block = max(1, _BLOCK_BYTES // dtype.itemsize)
        nblocks = -(-n // block)
        size, rank = self.size, self.rank
        base_c = self._copied_base
        base_r = self._reduced_base
        owned = list(range(rank, nblocks, size))
        # Input pieces as (start, array) for copying block by block.
        starts, off = [], 0
        for p in parts:
            starts.append(off)
            off += p.size
        piece = 0
        n_in = n_red = n_out = 0
        waiter = _Waiter(self, "a shared-memory all-reduce step")
        while n_out < nblocks:
            progressed = False
            if n_in < nblocks:
                lo, hi = n_in * block, min(n, (n_in + 1) * block)
                while piece < len(parts) and starts[piece] + parts[piece].size <= lo:
                    piece += 1
                k = piece
                while k < len(parts) and starts[k] < hi:
                    a, b = max(lo, starts[k]), min(hi, starts[k] + parts[k].size)
                    mine[a:b] = parts[k][a - starts[k]: b - starts[k]]
                    k += 1
                n_in += 1
                self._post("copied", base_c + n_in)
                progressed = True
            while n_red < len(owned) and int(copied.min()) >= base_c + owned[n_red] + 1:
                b = owned[n_red]
                lo, hi = b * block, min(n, (b + 1) * block)
                acc = mine[lo:hi]
                for j in range(size):
                    if j != rank:
                        reduce_into(acc, views[j][lo:hi], op)
                finalize(acc, op, size)
                n_red += 1
                self._post("reduced", base_r[rank] + n_red)
                progressed = True
            while n_out < nblocks:
                owner = n_out % size
                if int(reduced[owner]) < base_r[owner] + n_out // size + 1:
                    break
                lo, hi = n_out * block, min(n, (n_out + 1) * block)
                out[lo:hi] = views[owner][lo:hi]
                n_out += 1
                progressed = True
            if not progressed:
                def blocking() -> list[int]:
                    # The ranks this rank waits for right now, first the one it needs next.
                    late = []
                    if n_red < len(owned):
                        late += [j for j in range(size) if int(copied[j]) < base_c + owned[n_red] + 1]
                    owner = n_out % size
                    if owner != rank and int(reduced[owner]) < base_r[owner] + n_out // size + 1:
                        late.append(owner)
                    return late

                waiter.idle(blocking)
        self._copied_base = base_c + nblocks
        for j in range(size):
            base_r[j] += len(range(j, nblocks, size))

    def allgather(self, part: np.ndarray, counts: Sequence[int], out: np.ndarray) -> None:
        dtype = part.dtype
        if not sum(counts):
            return
        region = self._prepare([c * dtype.itemsize for c in counts])
        if part.size:
            self._region(self.rank, region, dtype, part.size)[:] = part
        self.barrier()
        off = 0
        for j, c in enumerate(counts):
            if c:
                out[off:off + c] = self._region(j, region, dtype, c)
            off += c

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        nbytes = buf.size * buf.dtype.itemsize
        region = self._prepare([nbytes if j == root else 0 for j in range(self.size)])
        if self.rank == root:
            self._region(root, region, buf.dtype, buf.size)[:] = buf
        self.barrier()
        if self.rank != root:
            buf[:] = self._region(root, region, buf.dtype, buf.size)

    def close(self) -> None:
        self._counters = None
        for seg in self._segs:
            if seg is not None:
                seg.close()
        self._segs = [None] * self.size
        if self._ctl is not None:
            self._ctl.close()
            self._ctl = None
