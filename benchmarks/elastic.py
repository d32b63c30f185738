#!/usr/bin/env python
"""Elastic jobs: what ``state.commit()`` and a reset cost, and random kills and joins.

    python benchmarks/elastic.py                  # both models, 20 random trials (~10 min on 2 cores)
    python benchmarks/elastic.py --quick          # smoke run: MNIST model only, few commits, 1 trial
    python benchmarks/elastic.py --parts trials --trials 50 --seed 7

Every job runs under ``hostreduce run -np 2 --min-np 1 --max-np 3
--host-discovery-script S`` on this machine; ``S`` prints ``localhost:<slots>`` from a
file the benchmark rewrites (under a lock the benchmark holds while it kills a worker,
so that the launcher never reads a slot count that does not match the workers alive).

Part 1, ``commit`` (one job per model; the worker is this script, ``--worker``):

* ``mnist``: the CNN of Horovod's elastic TF2 example
  (``tests/elastic_workers/tensorflow2_mnist_elastic.py``: conv 8, conv 16, pool,
  dense 32, dense 10) on the example's 8x8 digits, batch 32;
* ``mlp``: an MLP 1024-1792x8-1000 (26.1M float32 parameters, ``end_to_end.py``'s
  large model) on fixed standard-normal features, batch 32;

both with Keras 3's Adam (its two slots make the state three times the weights), a
``tf.function`` step with ``hvd.DistributedGradientTape`` and
``hvd.elastic.TensorFlowKerasState``, as in the example. After a warm-up (a commit every
step), ``--blocks`` pairs of ``--block`` steps alternate without and with a
``state.commit()`` after every step. Each commit is timed as a whole and split into
``save`` (the host copies of every variable) and ``check`` (``check_host_updates``:
rank 0 asks the launcher for its update count, ``ask``, then the answer is broadcast);
``step ratio`` = median time of a step with its commit / median time of a step without.
Then, at the commit after the timed blocks, worker 1 is SIGKILLed: ``kill -> commit``
is the time from the kill to the end of the survivor's first commit in the new epoch,
split at the survivor's own events (the failed collective noticed, the state
restored, the place in the new epoch from the launcher, the new ring's first
collective, the state's broadcast ``sync``). A few commits later the discovery script
offers 3 slots: two workers start (their first line is before TensorFlow's import) and
join at the survivor's next commit; ``start -> commit at 3`` runs from a new worker's
start to the end of its first commit at size 3 (``whole``), and ``join -> commit at 3``
from its call of ``hvd.init()`` (the rendezvous and the ring, ``rendezvous/ring
part``). Every time is ``time.monotonic()``, one clock for every process on the host.

Part 2, ``trials``: ``--trials`` runs of the example itself (unchanged, with
``HR_ELASTIC_MARKS``), each with a random schedule of 1 to 3 events at commit points:
kill a random member (SIGKILL), add one or two workers, or both; never more than 3
workers nor fewer than 1 alive, at most 2 kills per trial (the launcher blacklists a
host after 3 failures). An event at batch B holds every member after its commit of B
(``hold-b<B>``), acts, waits until the new workers have asked the launcher for a place
(their gRPC connection to the rendezvous service), then lets the members go on. A trial
passes when it ends within ``--trial-timeout`` (else it is a hang: every process is
stopped, their stacks dumped into the log first), the launcher exits 0, every rank of
the last epoch prints the same weight digest and that epoch holds every worker alive,
no process of the trial is left (``/proc/*/environ`` holds the trial's marker) and no
new ``/dev/shm`` entry is left behind.

Results go to ``<out>/elastic.json`` and ``<out>/elastic.png``.
"""
from __future__ import annotations

import time as _time

_T_START = _time.monotonic()  # a worker's start, before anything heavy is imported

import os  # noqa: E402
import sys  # noqa: E402

MNIST_BATCH = 32
MLP = {"input": 1024, "hidden": 1792, "layers": 8, "classes": 1000, "batch": 32}


# --------------------------------------------------------------------------- the worker (part 1)


def _mark(directory: str, name: str) -> None:
    open(os.path.join(directory, name), "a").close()


def _worker_main(argv: list[str]) -> int:
    import argparse
    import faulthandler
    import json
    import threading
    import traceback

    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--plan")
    p.add_argument("--workdir")
    args = p.parse_args(argv)
    with open(args.plan) as f:
        plan = json.load(f)
    wid = int(os.environ.get("HOSTREDUCE_ELASTIC_WORKER", "-1"))
    marks = os.path.join(args.workdir, "marks")
    _mark(marks, f"started-w{wid}")
    faulthandler.dump_traceback_later(plan["worker_timeout_s"], exit=True)
    lock = threading.Lock()
    out = open(os.path.join(args.workdir, f"w{wid}.jsonl"), "a")

    def emit(kind: str, **fields) -> None:
        with lock:
            out.write(json.dumps({"kind": kind, "worker": wid, **fields}) + "\n")
            out.flush()

    emit("event", what="started", t=_T_START, pid=os.getpid())
    try:
        _train(plan, marks, wid, emit)
    except BaseException as exc:
        emit("error", error=f"{type(exc).__name__}: {exc}"[:500], traceback=traceback.format_exc()[-4000:])
        raise
    return 0


def _train(plan: dict, marks: str, wid: int, emit) -> None:
    import hashlib
    import logging
    import time

    import numpy as np
    import tensorflow as tf

    import hostreduce.horovod as hvd
    from hostreduce.horovod import elastic as hvd_elastic
    from hostreduce.ops import job as hr_job

    now, clock = time.monotonic, time.perf_counter
    emit("event", what="imported", t=now())

    class Stamps(logging.Handler):
        """The times of the library's own messages: a lost worker noticed, a join
        noticed at a commit, a place in a new epoch."""

        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            what = ("lost" if "lost a worker" in msg else "interrupt" if "wait to join" in msg
                    else "place" if msg.startswith("elastic worker") and " epoch " in msg else None)
            if what:
                emit("event", what=what, t=now(), message=msg[:300])
            if record.levelno >= logging.WARNING:
                print(f"{record.name}: {msg}", file=sys.stderr, flush=True)

    for name in ("hostreduce.elastic", "hostreduce.horovod"):
        logger = logging.getLogger(name)
        logger.addHandler(Stamps())
        logger.setLevel(logging.INFO)

    emit("event", what="init_call", t=now())
    hvd.init()
    emit("event", what="init_done", t=now(), rank=hvd.rank(), size=hvd.size())

    model, loss_fn, batches = _model(plan["model"], tf, np)
    lr = 0.001
    opt = tf.optimizers.Adam(lr * hvd.size())

    @tf.function
    def training_step(images, labels, allreduce=True):
        with tf.GradientTape() as tape:
            probs = model(images, training=True)
            loss_value = loss_fn(labels, probs)
        if allreduce:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss_value

    training_step(*batches[0], allreduce=False)  # the optimizer's slots exist from here
    nparams = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    state = hvd.elastic.TensorFlowKerasState(model, opt, batch=0, final_from=-1)
    nstate = int(sum(np.prod(v.shape) for v in state._variables._variables()))
    emit("event", what="built", t=now(), params=nparams, state_floats=nstate)

    cur: dict[str, float] = {}

    def timed(name: str, fn, stamp: bool = False):
        def call(*a, **k):
            if stamp:
                emit("event", what=f"{name}_start", t=now())
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                cur[name] = cur.get(name, 0.0) + clock() - t0
                if stamp:
                    emit("event", what=f"{name}_end", t=now())
        return call

    state.save = timed("save", state.save)
    state.check_host_updates = timed("check", state.check_host_updates)
    state.sync = timed("sync", state.sync, stamp=True)
    state.restore = timed("restore", state.restore, stamp=True)
    hvd_elastic._updates = timed("ask", hvd_elastic._updates)

    def epoch() -> int:
        client = hr_job.elastic_client()
        return client.epoch if client is not None else 0

    def on_reset() -> None:
        opt.learning_rate.assign(lr * hvd.size())
        emit("event", what="reset", t=now(), rank=hvd.rank(), size=hvd.size(), epoch=epoch())

    state.register_reset_callbacks([on_reset])

    warmup, block, blocks = plan["warmup"], plan["block"], plan["blocks"]
    timed_end = warmup + 2 * block * blocks          # first batch of the event phase
    timing: list[dict] = []

    def phase_of(b: int) -> str:
        if b < warmup:
            return "warmup"
        if b < timed_end:
            return "nocommit" if ((b - warmup) // block) % 2 == 0 else "commit"
        return "event"

    @hvd.elastic.run
    def train(state):
        while True:
            size = hvd.size()
            if size >= plan["final_size"] and state.final_from < 0:
                state.final_from = state.batch
            if (state.final_from >= 0 and state.batch >= state.final_from + plan["tail"]) \
                    or state.batch >= plan["max_batch"]:
                return
            b = state.batch
            phase = phase_of(b)
            images, labels = batches[b % len(batches)]
            cur.clear()
            t0 = clock()
            float(training_step(images, labels))
            t1 = clock()
            state.batch = b + 1
            if phase != "nocommit":
                state.commit()
            t2 = clock()
            row = {"b": b, "phase": phase, "rank": hvd.rank(), "size": size, "epoch": epoch(),
                   "step_s": t1 - t0, "iter_s": t2 - t0, "commit_s": t2 - t1 if phase != "nocommit" else None,
                   "save_s": cur.get("save"), "check_s": cur.get("check"), "ask_s": cur.get("ask")}
            if phase in ("nocommit", "commit"):
                timing.append(row)
                if b == timed_end - 1:
                    emit("timing", rows=timing)
            elif phase == "event":
                emit("commit", t_end=now(), **row)
                _mark(marks, f"commit-w{wid}-b{b}-s{size}")
                hold = os.path.join(marks, f"hold-b{b}")
                deadline = now() + plan["hold_timeout_s"]
                while os.path.exists(hold) and now() < deadline:
                    time.sleep(0.002)

    train(state)
    values = np.concatenate([np.ravel(v.numpy()).astype(np.float64) for v in model.variables])
    digest = hashlib.sha256(values.tobytes()).hexdigest()[:16]
    emit("done", t=now(), rank=hvd.rank(), size=hvd.size(), batch=state.batch, digest=digest)
    print(f"RESULT rank {hvd.rank()}/{hvd.size()}: weights={digest}", flush=True)


def _model(name: str, tf, np):
    """The model, its loss and 8 fixed batches."""
    if name == "mnist":
        from sklearn.datasets import load_digits

        digits = load_digits()  # the example's data: 8x8 digits as uint8 images, / 255
        x = (np.round(digits.images * (255.0 / 16.0)) / 255.0).astype(np.float32)[..., None]
        y = digits.target.astype(np.int64)
        batch = MNIST_BATCH
        model = tf.keras.Sequential([
            tf.keras.Input((8, 8, 1)),
            tf.keras.layers.Conv2D(8, [3, 3], activation='relu'),
            tf.keras.layers.Conv2D(16, [3, 3], activation='relu'),
            tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
            tf.keras.layers.Dropout(0.25),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(32, activation='relu'),
            tf.keras.layers.Dropout(0.5),
            tf.keras.layers.Dense(10, activation='softmax')])
        loss = tf.losses.SparseCategoricalCrossentropy()
    else:
        batch = MLP["batch"]
        rng = np.random.default_rng(0)
        x = rng.standard_normal((8 * batch, MLP["input"])).astype(np.float32)
        y = rng.integers(0, MLP["classes"], 8 * batch).astype(np.int64)
        model = tf.keras.Sequential([tf.keras.Input((MLP["input"],))]
                                    + [tf.keras.layers.Dense(MLP["hidden"], activation="relu")
                                       for _ in range(MLP["layers"])]
                                    + [tf.keras.layers.Dense(MLP["classes"])])
        loss = tf.losses.SparseCategoricalCrossentropy(from_logits=True)
    batches = [(tf.constant(x[i * batch:(i + 1) * batch]), tf.constant(y[i * batch:(i + 1) * batch]))
               for i in range(8)]
    return model, loss, batches


if __name__ == "__main__" and "--worker" in sys.argv:
    sys.exit(_worker_main(sys.argv[1:]))

# --------------------------------------------------------------------------- coordinator

import argparse  # noqa: E402
import fcntl  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import cli, jobs, report  # noqa: E402
from benchmarks.harness.jobs import REPO_ROOT, workroot  # noqa: E402
from hostreduce.processes import alive, stop_groups  # noqa: E402

EXAMPLE = REPO_ROOT / "tests" / "elastic_workers" / "tensorflow2_mnist_elastic.py"
MARKER_VAR = "HR_BENCH_ELASTIC_MARKER"
MODELS = {"mnist": "the example's CNN (conv 8, conv 16, pool, dense 32, dense 10) on 8x8 digits, batch 32, Adam",
          "mlp": f"MLP {MLP['input']}-{MLP['hidden']}x{MLP['layers']}-{MLP['classes']}, standard-normal features, "
                 f"batch {MLP['batch']}, Adam"}
SHM = "/dev/shm"
_RESULT = re.compile(r"RESULT rank (\d+)/(\d+): weights=(\w+)")


class Hang(Exception):
    """A job did not reach an event within its wall-clock limit."""


class Ended(Exception):
    """The launcher exited before an awaited event."""


class ElasticJob:
    """One ``hostreduce run --min-np 1 --max-np 3`` job of this host, its discovery
    script, marks directory and wall-clock limit."""

    def __init__(self, workdir: Path, worker: list[str], timeout_s: float, env: dict[str, str] | None = None,
                 reset_limit: int | None = None) -> None:
        self.workdir, self.marks = workdir, workdir / "marks"
        self.marks.mkdir(parents=True, exist_ok=True)
        self.hosts, self.lock_path = workdir / "hosts", workdir / "hosts.lock"
        self.hosts.write_text("localhost:2\n")
        self.lock_path.touch()
        self.discover = workdir / "discover.sh"
        # flock: the launcher reads the slots only while the benchmark does not hold the lock.
        self.discover.write_text(f"#!/bin/sh\nexec flock -s {self.lock_path} cat {self.hosts}\n")
        self.discover.chmod(0o755)
        self.marker = f"elastic-{os.getpid()}-{workdir.name}-{time.monotonic_ns()}"
        self.log_path = workdir / "launcher.log"
        self.timeout_s = timeout_s
        self.cmd = [sys.executable, "-m", "hostreduce", "run", "-np", "2", "--min-np", "1", "--max-np", "3",
                    "--host-discovery-script", str(self.discover)]
        if reset_limit is not None:
            self.cmd += ["--reset-limit", str(reset_limit)]
        self.cmd += ["--", *worker]
        env_all = {k: v for k, v in os.environ.items()
                   if k not in ("TF_CONFIG", "HOSTREDUCE_SECRET") and not k.startswith(("OMPI_", "PMI_", "PMIX_"))}
        self.env = {**env_all, **jobs.base_env(env), MARKER_VAR: self.marker, "PYTHONFAULTHANDLER": "1"}
        self.proc: subprocess.Popen | None = None
        self.pids: set[int] = set()
        self.t_start = 0.0
        self.deadline = 0.0
        self._last_scan = 0.0

    # -- running -------------------------------------------------------------------
    def start(self) -> None:
        self.t_start = time.monotonic()
        self.deadline = self.t_start + self.timeout_s
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=str(REPO_ROOT), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def processes(self) -> list[int]:
        """Live processes of this job (the marker in their environment)."""
        tag = f"{MARKER_VAR}={self.marker}".encode()
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    with open(f"/proc/{entry}/environ", "rb") as f:
                        if tag in f.read().split(b"\0"):
                            pids.append(int(entry))
                except OSError:
                    continue
        self.pids.update(pids)
        return pids

    def wait_for(self, ready: Callable[[], Any], what: str, poll_s: float = 0.005) -> Any:
        """``ready()``'s first true value; Hang past the deadline, Ended if the launcher exits first."""
        while True:
            value = ready()
            if value:
                return value
            now = time.monotonic()
            if now > self.deadline:
                raise Hang(f"{what}: not within {self.timeout_s:g} s of the start")
            if self.proc is not None and self.proc.poll() is not None:
                value = ready()
                if value:
                    return value
                raise Ended(f"the launcher exited with code {self.proc.returncode} before {what}")
            if now - self._last_scan > 0.5:
                self._last_scan = now
                self.processes()
            time.sleep(poll_s)

    def wait_exit(self) -> int:
        assert self.proc is not None
        self.wait_for(lambda: self.proc.poll() is not None, "the launcher's exit", poll_s=0.02)
        return self.proc.returncode

    def worker_pid(self, wid: int) -> int | None:
        want = f"HOSTREDUCE_ELASTIC_WORKER={wid}".encode()
        for pid in self.processes():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if want in f.read().split(b"\0"):
                        return pid
            except OSError:
                continue
        return None

    def set_slots(self, slots: int) -> float:
        with open(self.lock_path) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.hosts.write_text(f"localhost:{slots}\n")
            return time.monotonic()

    def kill(self, wid: int, slots: int) -> float:
        """SIGKILL worker ``wid`` and leave ``slots`` in the discovery script's output,
        with the launcher's reading of the slots held off until the worker is reaped (so
        that it neither starts a replacement nor stops another worker for the slot)."""
        pid = self.wait_for(lambda: self.worker_pid(wid), f"worker {wid}'s process")
        with open(self.lock_path) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            os.kill(pid, signal.SIGKILL)
            t_kill = time.monotonic()
            self.wait_for(lambda: not os.path.exists(f"/proc/{pid}"), f"worker {wid} reaped", poll_s=0.001)
            self.hosts.write_text(f"localhost:{slots}\n")
        return t_kill

    def asked(self, wid: int) -> bool:
        """Whether worker ``wid`` has called the launcher's rendezvous service (its
        gRPC connection to it is up: it asked for its place)."""
        pid = self.worker_pid(wid)
        if pid is None:
            return False
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            port = int(env[b"HOSTREDUCE_ELASTIC"].rsplit(b":", 1)[1])
            inodes = set()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
            for table in ("tcp", "tcp6"):
                with open(f"/proc/{pid}/net/{table}") as f:
                    for line in f.readlines()[1:]:
                        fields = line.split()
                        if (fields[9] in inodes and fields[3] == "01"
                                and int(fields[2].rsplit(":", 1)[1], 16) == port):
                            return True
        except (OSError, KeyError, ValueError, IndexError):
            return False
        return False

    # -- the end -------------------------------------------------------------------
    def stop_all(self, dump: bool) -> None:
        """Stop every process of the job; with ``dump``, first have its workers print
        every thread's stack into the log (faulthandler's answer to SIGABRT)."""
        pids = self.processes()
        if dump:
            launcher = self.proc.pid if self.proc is not None else -1
            workers = [p for p in pids if p != launcher]
            for pid in workers:
                try:
                    os.kill(pid, signal.SIGABRT)
                except OSError:
                    pass
            end = time.monotonic() + 5.0
            while any(alive(p) for p in workers) and time.monotonic() < end:
                time.sleep(0.05)
        stop_groups([self.proc] if self.proc is not None else [], self.processes(), grace_s=2.0)

    def leftovers(self, grace_s: float = 2.0) -> list[int]:
        end = time.monotonic() + grace_s
        pids = self.processes()
        while pids and time.monotonic() < end:
            time.sleep(0.05)
            pids = self.processes()
        return pids

    def log(self, tail: int | None = None) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return (data[-tail:] if tail else data).decode("utf-8", "replace")

    def marks_now(self) -> set[str]:
        return set(os.listdir(self.marks))


def held_at(marks: set[str], batch: int) -> list[int] | None:
    """The workers of one epoch that all committed ``batch`` (marks
    ``commit-w<id>-b<batch>-s<size>``, ``size`` of them), or None."""
    by_size: dict[int, list[int]] = {}
    pattern = re.compile(rf"commit-w(\d+)-b{batch}-s(\d+)")
    for name in marks:
        m = pattern.fullmatch(name)
        if m:
            by_size.setdefault(int(m.group(2)), []).append(int(m.group(1)))
    for size, workers in by_size.items():
        if len(workers) == size:
            return sorted(workers)
    return None


def shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM))
    except OSError:
        return set()


def shm_owner_pids(entries: set[str]) -> dict[str, list[int]]:
    """For each ``hostreduce-<token>-...`` entry, the pids its job's owners file lists."""
    out: dict[str, list[int]] = {}
    for name in entries:
        m = re.match(r"hostreduce-([0-9a-f]{16})-", name)
        if not m:
            continue
        try:
            with open(os.path.join(SHM, f"hostreduce-{m.group(1)}-owners")) as f:
                out[name] = [int(line.split()[0]) for line in f if line.strip()]
        except (OSError, ValueError, IndexError):
            out[name] = []
    return out


def read_records(workdir: Path) -> list[dict]:
    rows = []
    for path in sorted(workdir.glob("w*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    return rows


def pct(xs: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of ``xs``, linear between order statistics."""
    if not xs:
        return None
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def stats_ms(xs: list[float]) -> dict[str, Any]:
    return {"median_ms": ms(pct(xs, 0.5)), "p90_ms": ms(pct(xs, 0.9)), "n": len(xs)}


# --------------------------------------------------------------------------- part 1: commit and reset cost


def commit_job(rep: report.Report, model: str, root: Path, args: argparse.Namespace) -> None:
    workdir = root / f"commit-{model}"
    workdir.mkdir()
    warmup, block, blocks = args.warmup, args.block, args.blocks
    event_b = warmup + 2 * block * blocks + 1        # the held commit at which worker 1 is killed
    plan = {"model": model, "warmup": warmup, "block": block, "blocks": blocks, "final_size": 3,
            "tail": args.tail, "max_batch": event_b + 100000, "hold_timeout_s": args.job_timeout,
            "worker_timeout_s": args.job_timeout + 30}
    plan_path = jobs.write_plan(workdir / "plan.json", plan)
    job = ElasticJob(workdir, [sys.executable, str(Path(__file__).resolve()), "--worker", "--plan", str(plan_path),
                               "--workdir", str(workdir)], args.job_timeout)
    (job.marks / f"hold-b{event_b}").touch()
    run: dict[str, Any] = {"status": "ok", "plan": plan}
    times: dict[str, float] = {}
    job.start()
    try:
        job.wait_for(lambda: held_at(job.marks_now(), event_b) == [0, 1], f"both workers' commit of batch {event_b}")
        times["kill"] = job.kill(1, slots=1)
        (job.marks / f"hold-b{event_b}").unlink()
        job.wait_for(lambda: f"commit-w0-b{event_b + 3}-s1" in job.marks_now(), "the survivor's commits alone")
        times["hosts3"] = job.set_slots(3)
        rc = job.wait_exit()
        if rc != 0:
            run.update(status="failed", error=f"the launcher exited with code {rc}")
    except (Hang, Ended) as exc:
        run.update(status="hang" if isinstance(exc, Hang) else "failed", error=str(exc))
        job.stop_all(dump=isinstance(exc, Hang))
    finally:
        if job.proc is not None and job.proc.poll() is None:
            job.stop_all(dump=False)
    run["seconds"] = round(time.monotonic() - job.t_start, 1)
    records = read_records(workdir)
    errors = [r for r in records if r["kind"] == "error"]
    if errors and run["status"] == "ok":
        run.update(status="failed", error=errors[0]["error"])
    if run["status"] != "ok":
        run["log_tail"] = job.log(4000)
        run["worker_errors"] = [e["error"] for e in errors]
    rep["runs"][f"commit/{model}"] = run
    if run["status"] == "ok":
        rep["commit"][model] = summarize_commit(model, records, times, job.log())
    rep.save()
    status = run["status"] if run["status"] != "ok" else "ok"
    print(f"  commit/{model}: {status} in {run['seconds']} s" + (f" ({run.get('error')})" if status != "ok" else ""),
          flush=True)


def _events(records: list[dict], wid: int) -> list[dict]:
    return [r for r in records if r["worker"] == wid and r["kind"] == "event"]


def _first(events: list[dict], what: str, after: float = float("-inf")) -> float | None:
    return next((e["t"] for e in events if e["what"] == what and e["t"] >= after), None)


def _span(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round((b - a) * 1e3, 1)


def summarize_commit(model: str, records: list[dict], times: dict[str, float], log: str) -> dict[str, Any]:
    out: dict[str, Any] = {"description": MODELS[model]}
    built = next(r for r in records if r["kind"] == "event" and r["what"] == "built")
    out["parameters"], out["state_floats"] = built["params"], built["state_floats"]
    out["state_mib"] = round(built["state_floats"] * 4 / 2 ** 20, 3)
    ranks = {}
    for rec in (r for r in records if r["kind"] == "timing"):
        rows = rec["rows"]
        rank = rows[0]["rank"]
        with_c = [r for r in rows if r["phase"] == "commit"]
        without = [r for r in rows if r["phase"] == "nocommit"]
        entry = {"worker": rec["worker"], "commits": len(with_c),
                 "commit": stats_ms([r["commit_s"] for r in with_c]),
                 "save": stats_ms([r["save_s"] for r in with_c]),
                 "check": stats_ms([r["check_s"] for r in with_c]),
                 "step_without_commit": stats_ms([r["iter_s"] for r in without]),
                 "step_with_commit": stats_ms([r["iter_s"] for r in with_c]),
                 "train_step_in_commit_blocks": stats_ms([r["step_s"] for r in with_c])}
        asks = [r["ask_s"] for r in with_c if r["ask_s"] is not None]
        if asks:
            entry["ask"] = stats_ms(asks)
            entry["broadcast"] = stats_ms([r["check_s"] - r["ask_s"] for r in with_c if r["ask_s"] is not None])
        entry["step_ratio"] = round(entry["step_with_commit"]["median_ms"] / entry["step_without_commit"]["median_ms"], 3)
        entry["raw_ms"] = {k: [round(r[f"{k}_s"] * 1e3, 3) for r in with_c] for k in ("commit", "save", "check")}
        entry["raw_ms"]["step_without_commit"] = [round(r["iter_s"] * 1e3, 3) for r in without]
        ranks[str(rank)] = entry
    out["ranks"] = dict(sorted(ranks.items()))

    commits = [r for r in records if r["kind"] == "commit"]
    w0 = _events(records, 0)
    # The kill: the survivor (worker 0) from the SIGKILL to the end of its first commit in the new epoch.
    t_kill = times["kill"]
    first_alone = next((c for c in commits if c["worker"] == 0 and c["size"] == 1), None)
    t_lost = _first(w0, "lost", t_kill)
    t_restored = _first(w0, "restore_end", t_kill)
    t_place = _first(w0, "place", t_kill)
    t_sync = _first(w0, "sync_end", t_kill)
    t_done = first_alone["t_end"] if first_alone else None
    out["kill"] = {"killed": "worker 1 (rank 1), SIGKILL while both were held after their commit",
                   "kill_to_first_commit_ms": _span(t_kill, t_done),
                   "parts_ms": {"kill -> failure noticed": _span(t_kill, t_lost),
                                "failure noticed -> state restored": _span(t_lost, t_restored),
                                "restored -> place in the new epoch (shutdown, rendezvous)": _span(t_restored, t_place),
                                "place -> sync done (new ring, state broadcast)": _span(t_place, t_sync),
                                "sync done -> first commit done (one step, commit)": _span(t_sync, t_done)},
                   "rendezvous_ring_ms": _span(t_lost, t_sync)}
    # The growth: two new workers from their start to their first commit at size 3.
    t_hosts = times["hosts3"]
    news = sorted({r["worker"] for r in records if r["worker"] >= 2})
    joiners = {}
    for wid in news:
        ev = _events(records, wid)
        first3 = next((c for c in commits if c["worker"] == wid and c["size"] == 3), None)
        t = {k: _first(ev, k) for k in ("started", "imported", "init_call", "place", "init_done", "built",
                                        "sync_end")}
        t_end = first3["t_end"] if first3 else None
        joiners[str(wid)] = {
            "start_to_commit_at_3_ms": _span(t["started"], t_end),
            "join_to_commit_at_3_ms": _span(t["init_call"], t_end),
            "parts_ms": {"discovery offers 3 slots -> process start (poll, spawn, interpreter)": _span(t_hosts, t["started"]),
                         "start -> imported (TensorFlow, hostreduce)": _span(t["started"], t["imported"]),
                         "imported -> hvd.init() called": _span(t["imported"], t["init_call"]),
                         "hvd.init() called -> place (rendezvous: wait for the survivor's commit)": _span(t["init_call"], t["place"]),
                         "place -> model built, first local step": _span(t["place"], t["built"]),
                         "built -> sync done (new ring, state broadcast)": _span(t["built"], t["sync_end"]),
                         "sync done -> first commit at 3 done": _span(t["sync_end"], t_end)}}
    out["grow"] = {"joiners": joiners}
    ends = [c["t_end"] for c in commits if c["size"] == 3]
    t_all3 = min(ends) if ends else None
    starts = [_first(_events(records, w), "started") for w in news]
    out["grow"]["hosts_to_first_commit_at_3_ms"] = _span(t_hosts, t_all3)
    if starts and all(s is not None for s in starts):
        out["grow"]["first_start_to_first_commit_at_3_ms"] = _span(min(starts), t_all3)
    t_int = _first(w0, "interrupt", t_hosts)
    out["grow"]["survivor_ms"] = {
        "join noticed at a commit -> place": _span(t_int, _first(w0, "place", t_int or t_hosts)),
        "join noticed -> first commit at 3 done": _span(t_int, next((c["t_end"] for c in commits
                                                                   if c["worker"] == 0 and c["size"] == 3), None))}
    out["grow"]["resets_noticed_by_survivor_after_growth"] = sum(
        1 for e in w0 if e["what"] == "interrupt" and e["t"] >= t_hosts)
    out["grow"]["epochs"] = max((c["epoch"] for c in commits), default=None)
    done = [r for r in records if r["kind"] == "done"]
    out["final"] = {"size": done[0]["size"] if done else None,
                    "digests_equal": len({d["digest"] for d in done}) == 1 if done else False,
                    "ranks": sorted(d["rank"] for d in done)}
    return out


# --------------------------------------------------------------------------- part 2: random trials


def make_schedule(rng: random.Random, max_events: int) -> list[dict]:
    """1..max_events events at increasing commit points; never above 3 workers nor
    below 1, at most 2 kills (the launcher blacklists the host at its 3rd failure)."""
    alive, kills = 2, 0
    batch = rng.randint(3, 8)
    events = []
    for _ in range(rng.randint(1, max_events)):
        choices = []
        if alive >= 2 and kills < 2:
            choices.append((True, 0))
        for add in (1, 2):
            if alive + add <= 3:
                choices.append((False, add))
            if alive >= 2 and kills < 2 and alive - 1 + add <= 3:
                choices.append((True, add))
        if not choices:  # 3 workers and 2 kills done: nothing left to do
            break
        kill, add = rng.choice(choices)
        events.append({"batch": batch, "kill": kill, "add": add, "pick": round(rng.random(), 4)})
        alive += add - int(kill)
        kills += int(kill)
        batch += rng.randint(3, 8)
    return events


def run_trial(index: int, seed: int, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(seed)
    schedule = make_schedule(rng, args.max_events)
    workdir = root / f"trial-{index:03d}"
    workdir.mkdir()
    job = ElasticJob(workdir, [sys.executable, str(EXAMPLE), str(args.example_batches), str(workdir / "ckpt")],
                     args.trial_timeout, env={"HR_ELASTIC_MARKS": str(workdir / "marks")})
    for ev in schedule:
        (job.marks / f"hold-b{ev['batch']}").touch()
    shm_before = shm_entries()
    trial: dict[str, Any] = {"trial": index, "seed": seed, "schedule": schedule, "events": []}
    next_id, outcome = 2, "ok"
    alive_ids = {0, 1}
    job.start()
    try:
        for ev in schedule:
            b = ev["batch"]
            held = job.wait_for(lambda: held_at(job.marks_now(), b), f"every member's commit of batch {b}")
            t_held = time.monotonic()
            done: dict[str, Any] = {"batch": b, "held": held, "t_s": round(t_held - job.t_start, 2)}
            slots = len(alive_ids)
            if ev["kill"]:
                if len(held) >= 2:
                    victim = held[min(int(ev["pick"] * len(held)), len(held) - 1)]
                    job.kill(victim, slots=slots - 1 + ev["add"])
                    alive_ids.discard(victim)
                    done["killed"] = victim
                else:
                    done["kill_skipped"] = f"only {len(held)} member(s) held"
                    if ev["add"]:
                        job.set_slots(slots + ev["add"])
            elif ev["add"]:
                job.set_slots(slots + ev["add"])
            if ev["add"]:
                new = list(range(next_id, next_id + ev["add"]))
                next_id += ev["add"]
                alive_ids.update(new)
                job.wait_for(lambda: all(job.asked(w) for w in new), f"workers {new} asking for a place")
                done["added"] = new
                done["join_wait_s"] = round(time.monotonic() - t_held, 2)
            (job.marks / f"hold-b{b}").unlink()
            trial["events"].append(done)
        rc = job.wait_exit()
    except Exception as exc:  # noqa: BLE001 - a trial's failure is recorded, the next one runs
        outcome = "hang" if isinstance(exc, Hang) else "failed"
        trial["error"] = str(exc) if isinstance(exc, (Hang, Ended)) else f"{type(exc).__name__}: {exc}"
        job.stop_all(dump=isinstance(exc, Hang))
        rc = job.proc.returncode if job.proc is not None else None
    finally:
        if job.proc is not None and job.proc.poll() is None:
            job.stop_all(dump=False)
            rc = job.proc.returncode
    trial["seconds"] = round(time.monotonic() - job.t_start, 1)
    trial["launcher_exit"] = rc
    leftovers = job.leftovers()
    if leftovers:  # recorded, then stopped so that they cannot skew the next trial
        stop_groups([], leftovers, grace_s=1.0)
    new_shm = sorted(shm_entries() - shm_before)
    if any(e.startswith("hostreduce-") for e in new_shm):
        time.sleep(1.0)  # another job's start-up entries live for milliseconds: look again
        new_shm = sorted(set(new_shm) & shm_entries())
    owners = shm_owner_pids(set(new_shm))
    # hostreduce's entries of this trial (its owners file lists one of its processes), or
    # of no job that can be named; other names (another user's MPI segments) are only listed.
    ours = [e for e in new_shm if e in owners and (not owners[e] or set(owners[e]) & job.pids)]
    log = job.log()
    results = [(int(r), int(n), d) for r, n, d in _RESULT.findall(log)]
    sizes = {n for _, n, _ in results}
    final_size = sizes.pop() if len(sizes) == 1 else None
    checks = {
        "ended_in_time": outcome != "hang",
        "launcher_exit_0": rc == 0,
        "every_final_rank_reported": final_size is not None and sorted(r for r, _, _ in results) == list(range(final_size)),
        "digests_equal": len({d for _, _, d in results}) == 1,
        "final_size_is_workers_alive": final_size == len(alive_ids),
        "no_leftover_process": not leftovers,
        "no_new_dev_shm_entry": not ours,
    }
    trial.update(final_size=final_size, expected_size=len(alive_ids), digests=sorted({d for _, _, d in results}),
                 leftovers=leftovers, new_shm=new_shm, new_shm_ours=ours, checks=checks,
                 killed_lines=re.findall(r"worker \d+ was killed by SIGKILL", log),
                 passed=all(checks.values()))
    trial["outcome"] = "passed" if trial["passed"] else ("hang" if outcome == "hang" else "failed")
    if not trial["passed"]:
        trial["log_tail"] = job.log(6000)
        failed = [k for k, v in checks.items() if not v]
        trial.setdefault("error", f"failed checks: {failed}")
    return trial


def describe(ev: dict) -> str:
    parts = []
    if ev["kill"]:
        parts.append("kill")
    if ev["add"]:
        parts.append(f"+{ev['add']}")
    return f"b{ev['batch']}:{'&'.join(parts)}"


# --------------------------------------------------------------------------- output


def show(result: dict[str, Any]) -> None:
    commit = result.get("commit", {})
    if commit:
        print(f"\n{'model':<6} {'rank':>4} {'state MiB':>9} {'commit ms med/p90':>18} {'save ms med/p90':>17} "
              f"{'check ms med/p90':>17} {'ask ms':>7} {'step ms':>8} {'+commit':>8} {'ratio':>6}")
        for model, m in commit.items():
            for rank, r in m["ranks"].items():
                ask = r.get("ask", {}).get("median_ms")
                print(f"{model:<6} {rank:>4} {m['state_mib']:>9} "
                      f"{r['commit']['median_ms']:>8.2f}/{r['commit']['p90_ms']:<9.2f} "
                      f"{r['save']['median_ms']:>7.2f}/{r['save']['p90_ms']:<9.2f} "
                      f"{r['check']['median_ms']:>7.2f}/{r['check']['p90_ms']:<9.2f} "
                      f"{ask if ask is not None else '-':>7} {r['step_without_commit']['median_ms']:>8.1f} "
                      f"{r['step_with_commit']['median_ms']:>8.1f} {r['step_ratio']:>6.2f}")
        print(f"\n{'model':<6} {'kill->commit ms':>15} {'noticed':>8} {'rendezvous+ring':>16} "
              f"{'start->commit@3 ms':>19} {'join->commit@3':>15} {'import':>7} {'resets':>6}")
        for model, m in commit.items():
            k = m["kill"]
            js = list(m["grow"]["joiners"].values())
            start3 = max((j["start_to_commit_at_3_ms"] or 0) for j in js) if js else None
            join3 = max((j["join_to_commit_at_3_ms"] or 0) for j in js) if js else None
            imp = max((j["parts_ms"]["start -> imported (TensorFlow, hostreduce)"] or 0) for j in js) if js else None
            print(f"{model:<6} {k['kill_to_first_commit_ms']!s:>15} {k['parts_ms']['kill -> failure noticed']!s:>8} "
                  f"{k['rendezvous_ring_ms']!s:>16} {start3!s:>19} {join3!s:>15} {imp!s:>7} "
                  f"{m['grow']['resets_noticed_by_survivor_after_growth']:>6}")
    trials = result.get("trials", [])
    if trials:
        print(f"\n{'trial':>5} {'seed':>10} {'schedule':<28} {'final':>5} {'s':>6} outcome")
        for t in trials:
            sched = " ".join(describe(e) for e in t["schedule"])
            print(f"{t['trial']:>5} {t['seed']:>10} {sched:<28} {t['final_size']!s:>5} {t['seconds']:>6} "
                  f"{t['outcome']}" + ("" if t["passed"] else f" ({t.get('error', '')[:120]})"))
        s = result["trials_summary"]
        print(f"trials: {s['passed']}/{s['trials']} passed, hangs: {s['hangs']}")


def plot(result: dict[str, Any], path: Path) -> None:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(18, 6.4), gridspec_kw={"width_ratios": [1, 1.5, 1]})
    ax, bx, cx = axes
    commit = result.get("commit", {})
    labels = [(model, rank) for model, m in commit.items() for rank in m["ranks"]]
    width = 0.27
    for k, (key, name) in enumerate((("commit", "commit"), ("save", "save (host copies)"),
                                     ("check", "check_host_updates (ask + broadcast)"))):
        xs = [i + (k - 1) * width for i in range(len(labels))]
        med = [commit[m]["ranks"][r][key]["median_ms"] for m, r in labels]
        p90 = [commit[m]["ranks"][r][key]["p90_ms"] for m, r in labels]
        ax.bar(xs, med, width, color=f"C{k}", label=name)
        ax.plot(xs, p90, "k_", ms=10, label="p90" if k == 0 else None)
    ax.set_xticks(range(len(labels)), [f"{m}\nrank {r}" for m, r in labels])
    ax.set_yscale("log")
    ax.set_ylabel("ms per commit (bars: median, dashes: p90)")
    ax.set_title("state.commit() on 2 workers")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    rows, bars = [], []
    for model, m in commit.items():
        rows.append(f"{model}: SIGKILL\n-> survivor's commit")
        bars.append([(f"kill: {name}", v) for name, v in m["kill"]["parts_ms"].items()])
        for wid, j in m["grow"]["joiners"].items():
            rows.append(f"{model}: worker {wid} start\n-> commit at size 3")
            bars.append([(f"join: {name}", v) for name, v in list(j["parts_ms"].items())[1:]])
    names = list(dict.fromkeys(name for parts in bars for name, _ in parts))
    cmap = plt.get_cmap("tab20")
    for i, parts in enumerate(bars):
        left = 0.0
        for name, v in parts:
            v = (v or 0.0) / 1e3
            bx.barh(i, v, left=left, color=cmap(names.index(name) % 20), edgecolor="white",
                    label=name if i == next(j for j, p in enumerate(bars) if name in dict(p)) else None)
            left += v
        bx.text(left, i, f" {left:.2f} s", va="center", fontsize=8)
    bx.set_yticks(range(len(rows)), rows, fontsize=7)
    bx.invert_yaxis()
    bx.set_xlabel("s, each part of the reset in order")
    bx.set_title("reset cost (2 -> 1 by SIGKILL, then 1 -> 3)")
    bx.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    bx.grid(True, axis="x", alpha=0.3)
    trials = result.get("trials", [])
    colors = {"passed": "C2", "failed": "C3", "hang": "k"}
    cx.bar([t["trial"] for t in trials], [t["seconds"] for t in trials],
           color=[colors[t["outcome"]] for t in trials])
    if trials:
        cx.set_xticks([t["trial"] for t in trials])
        cx.tick_params(axis="x", labelsize=7)
    cx.set_xlabel("trial")
    cx.set_ylabel("wall s")
    s = result.get("trials_summary", {})
    cx.set_title(f"random trials: {s.get('passed', 0)}/{s.get('trials', 0)} passed, hangs {s.get('hangs', 0)}\n"
                 "(green: passed, red: failed, black: hang)", fontsize=10)
    cx.grid(True, axis="y", alpha=0.3)
    report.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="commit,trials", help="comma-separated: commit,trials")
    p.add_argument("--models", help="comma-separated, of mnist,mlp (default: both; --quick: mnist)")
    p.add_argument("--warmup", type=int, help="steps before the timed blocks, a commit each (default 5; --quick: 3)")
    p.add_argument("--block", type=int, help="steps per timed block (default 10; --quick: 5)")
    p.add_argument("--blocks", type=int, help="pairs of blocks without / with commits (default 5, i.e. 50 commits; "
                                              "--quick: 1)")
    p.add_argument("--tail", type=int, default=5, help="steps at size 3 before the part-1 job ends (default 5)")
    p.add_argument("--trials", type=int, help="random trials (default 20; --quick: 1)")
    p.add_argument("--max-events", type=int, default=3, help="events per trial, at most (default 3)")
    p.add_argument("--example-batches", type=int, default=120,
                   help="the example's BATCHES argument in the trials (default 120)")
    p.add_argument("--seed", type=int, default=2024, help="seed of the trials' schedules (default 2024)")
    p.add_argument("--trial-timeout", type=float, default=180.0, help="wall-clock limit of one trial (s)")
    p.add_argument("--job-timeout", type=float, default=300.0, help="wall-clock limit of one part-1 job (s)")
    p.add_argument("--quick", action="store_true", help="smoke run")
    cli.add_run_options(p)
    args = p.parse_args(argv)
    parts = cli.parse_choices(p, "--parts", args.parts, ["commit", "trials"])
    models = cli.parse_choices(p, "--models", args.models, list(MODELS)) if args.models else \
        (["mnist"] if args.quick else list(MODELS))
    args.warmup = args.warmup if args.warmup is not None else (3 if args.quick else 5)
    args.block = args.block or (5 if args.quick else 10)
    args.blocks = args.blocks or (1 if args.quick else 5)
    trials = args.trials if args.trials is not None else (1 if args.quick else 20)
    if args.warmup < 1 or args.block < 2 or args.blocks < 1 or trials < 0 or args.tail < 1 or args.max_events < 1:
        p.error("--warmup, --tail and --blocks must be >= 1, --block >= 2, --trials >= 0 and --max-events >= 1. "
                f"Received: --warmup {args.warmup} --block {args.block} --blocks {args.blocks} --trials {trials} "
                f"--tail {args.tail} --max-events {args.max_events}")
    rep = report.Report(
        args.out, "elastic", "elastic",
        "elastic jobs under hostreduce run --min-np 1 --max-np 3 on this host: state.commit() split into save and "
        "check_host_updates, step time without / with a commit every step, reset cost after a SIGKILL and after "
        "two workers join; random kill / join trials of Horovod's elastic TF2 example",
        packages=("numpy", "grpcio", "tensorflow", "keras"),
        environment_extra={"load_wait": report.wait_for_quiet(args.max_load, args.max_wait_s),
                           "hostreduce_env": report.hostreduce_env()},
        settings={"parts": parts, "models": {m: MODELS[m] for m in models}, "warmup": args.warmup,
                  "block": args.block, "blocks": args.blocks, "commits_timed": args.block * args.blocks,
                  "tail": args.tail, "trials": trials, "max_events": args.max_events,
                  "example": str(EXAMPLE.relative_to(REPO_ROOT)), "example_batches": args.example_batches,
                  "seed": args.seed, "trial_timeout_s": args.trial_timeout, "job_timeout_s": args.job_timeout,
                  "quick": args.quick,
                  "definitions": {
                      "commit_ms": "wall time of state.commit() after a step, per rank",
                      "save_ms": "state.save(): host copies (numpy) of the model's and optimizer's variables",
                      "check_ms": "state.check_host_updates(): rank 0 asks the launcher (ask_ms), then a broadcast",
                      "step_ratio": "median (step + commit) / median step without commit, same job, alternating blocks",
                      "kill_to_first_commit_ms": "SIGKILL of worker 1 -> end of the survivor's first commit in the "
                                                 "new epoch",
                      "start_to_commit_at_3_ms": "a new worker's first line (before TensorFlow's import) -> end of "
                                                 "its first commit at size 3",
                      "join_to_commit_at_3_ms": "its hvd.init() call (rendezvous, ring) -> end of that commit"}},
        runs={}, commit={}, trials=[], trials_summary={})
    rep.announce(f"elastic: parts {', '.join(parts)}; models {', '.join(models)}; {trials} trial(s)")
    with workroot("elastic", args.keep_workdir) as root:
        if "commit" in parts:
            for model in models:
                commit_job(rep, model, root, args)
        if "trials" in parts and trials:
            seeds = random.Random(args.seed)
            for i in range(trials):
                trial = run_trial(i, seeds.randrange(2 ** 31), root, args)
                rep["trials"].append(trial)
                passed = sum(t["passed"] for t in rep["trials"])
                rep["trials_summary"] = {"trials": len(rep["trials"]), "passed": passed,
                                         "hangs": sum(t["outcome"] == "hang" for t in rep["trials"]),
                                         "failed": len(rep["trials"]) - passed}
                rep.save()
                print(f"  trial {i}: {' '.join(describe(e) for e in trial['schedule'])} -> {trial['outcome']} "
                      f"(size {trial['final_size']}, {trial['seconds']} s)"
                      + ("" if trial["passed"] else f": {trial.get('error', '')[:200]}"), flush=True)
    rep.close(plot=lambda path: plot(rep.result, path), no_plot=args.no_plot, show=lambda: show(rep.result))
    bad_runs = report.exit_status(rep["runs"])
    return int(bad_runs or any(not t["passed"] for t in rep["trials"]))


if __name__ == "__main__":
    sys.exit(main())
