"""The systems the benchmarks measure, each behind one interface: how a job of it is
started. A benchmark says "run peer P with placement X at N ranks" (:func:`run`) and
gets back the run's record and the ranks' JSON-lines records; what the worker
processes measure (the benchmark's metric) stays in the benchmark.

| peer | processes | started by |
|---|---|---|
| :data:`HOSTREDUCE_RING` | hostreduce's ring (reducer, strategies, Estimator, Keras) | one per rank, ``TF_CONFIG``, a shared ``HOSTREDUCE_SECRET``; gRPC data path on shaped links |
| :data:`HOSTREDUCE_MPI` | hostreduce's MPI engine | the ``mpirun`` of mpi4py's Open MPI (on shaped links: started in the first namespace, daemons through ``ip netns exec``, TCP) |
| :data:`OPEN_MPI` | Open MPI itself, through mpi4py | the same ``mpirun`` |
| :data:`TF_COLLECTIVE` | TensorFlow's ``MultiWorkerMirroredStrategy`` | one per rank, ``TF_CONFIG`` |
| :data:`HOROVOD` | Horovod | the ``mpirun`` of Horovod's MPI |
| :data:`GRPC_FLOOR` | grpcio alone, moving a ring's bytes (plus a ring for barriers) | one per rank, ``TF_CONFIG``, more loopback addresses in ``BENCH_FLOOR_ADDRESSES`` |
| :data:`INDEPENDENT` | N processes that do not communicate (baselines) | one per rank, no cluster |
| :data:`HOSTREDUCE_PS` | hostreduce's ``ParameterServerStrategy`` | one per task (chief, worker, ps), ``TF_CONFIG``, a shared secret |
| :data:`TF_PS` | TensorFlow's ``ParameterServerStrategy`` | one per task (ps, worker, chief = coordinator), ``TF_CONFIG`` |
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from benchmarks.harness import placement as P
from benchmarks.harness.jobs import JobResult, PeakRss, WorkerJob, base_env, records, records_by_rank, run_job
from benchmarks.harness.report import loadavg

__all__ = ["Peer", "Run", "build_job", "run", "HOSTREDUCE_RING", "HOSTREDUCE_MPI", "OPEN_MPI", "TF_COLLECTIVE",
           "HOROVOD", "GRPC_FLOOR", "INDEPENDENT", "HOSTREDUCE_PS", "TF_PS"]


@dataclass(frozen=True)
class Peer:
    """How the processes of one system are started.

    ``launch``: ``cluster`` (one process per rank with the placement's ``TF_CONFIG``),
    ``mpirun`` (one launcher command, the ``mpirun`` of ``mpi``), ``independent`` (one
    process per rank, no cluster) or ``tasks`` (one process per task of a ``layout``).
    """

    label: str
    launch: str = "cluster"
    mpi: str | None = None
    secret: bool = False
    env: Mapping[str, str] = field(default_factory=dict)
    env_on_links: Mapping[str, str] = field(default_factory=dict)
    extra_addresses: str | None = None
    tasks_host: str = "127.0.0.1"

    def with_env(self, **env: str) -> "Peer":
        """The same peer with more environment for its processes."""
        return replace(self, env={**self.env, **env})


HOSTREDUCE_RING = Peer("hostreduce ring", secret=True,
                       # Between hosts "auto" is the tcp data path; the namespaces share one
                       # hostname, so there "auto" would pick shared memory.
                       env_on_links={"HOSTREDUCE_TRANSPORT": "tcp"})
# The ring with its data over the gRPC port (``transport="grpc"``), for comparison.
HOSTREDUCE_RING_GRPC = replace(HOSTREDUCE_RING, label="hostreduce ring (gRPC data path)",
                               env={"HOSTREDUCE_TRANSPORT": "grpc"}, env_on_links={"HOSTREDUCE_TRANSPORT": "grpc"})
HOSTREDUCE_MPI = Peer("hostreduce MPI engine", launch="mpirun", mpi="mpi")
OPEN_MPI = Peer("Open MPI (mpi4py)", launch="mpirun", mpi="mpi")
TF_COLLECTIVE = Peer("TensorFlow MultiWorkerMirroredStrategy")
HOROVOD = Peer("Horovod", launch="mpirun", mpi="horovod")
GRPC_FLOOR = Peer("grpcio transfer alone", secret=True, extra_addresses="BENCH_FLOOR_ADDRESSES")
INDEPENDENT = Peer("independent processes", launch="independent")
HOSTREDUCE_PS = Peer("hostreduce ParameterServerStrategy", launch="tasks", secret=True)
TF_PS = Peer("TensorFlow ParameterServerStrategy", launch="tasks", tasks_host="localhost")


def build_job(peer: Peer, where: P.Loopback | P.Namespaces, n: int, argv_of: Callable[[Any], list[str]],
              workdir: Path, timeout_s: float, env: Mapping[str, str] | None = None,
              layout: Sequence[tuple[str, int]] = ()) -> WorkerJob:
    """The job of ``peer`` at ``n`` ranks on ``where``. ``argv_of(slot)`` is the command
    of one process: ``slot`` is the rank, None for the command mpirun runs, or the
    ``(task type, index)`` of ``layout`` (``tasks`` peers)."""
    common = base_env({**peer.env, **(env or {})})
    if peer.secret:
        common["HOSTREDUCE_SECRET"] = secrets.token_hex(16)
    on_links = isinstance(where, P.Namespaces)
    if on_links and peer.launch not in ("cluster", "mpirun"):
        raise ValueError(f"{peer.label} runs on loopback only ({peer.launch}: its processes would not cross the "
                         f"shaped links). Received: {where.name}")
    name = workdir.name
    if peer.launch == "mpirun" and on_links:
        argv, links_env = where.mpirun(peer.mpi or "mpi", n, argv_of(None), export=list(common))
        return WorkerJob(name, [argv], [{**common, **links_env}], workdir, timeout_s)
    if peer.launch == "mpirun":
        argv = P.mpirun(peer.mpi or "mpi", n, argv_of(None), export=list(common))
        return WorkerJob(name, [argv], [common], workdir, timeout_s)
    if peer.launch == "independent":
        return WorkerJob(name, [argv_of(r) for r in range(n)], [common] * n, workdir, timeout_s)
    if peer.launch == "tasks":
        configs = P.task_configs(layout, peer.tasks_host)
        return WorkerJob(name, [argv_of(slot) for slot in layout], [{**common, "TF_CONFIG": c} for c in configs],
                         workdir, timeout_s)
    if peer.extra_addresses:
        common[peer.extra_addresses] = ",".join(P.loopback_addresses(n))
    if on_links:
        common.update(peer.env_on_links)
    envs = [{**common, **rank_env} for rank_env in where.rank_envs(n)]
    return WorkerJob(name, [where.wrap(r, argv_of(r)) for r in range(n)], envs, workdir, timeout_s)


@dataclass
class Run:
    """A finished job: its run record (``info``: status, seconds, load before and after,
    and what failed) and the records its ranks wrote."""

    job: JobResult | None
    info: dict[str, Any]
    workdir: Path

    @property
    def ok(self) -> bool:
        return self.info["status"] == "ok"

    @property
    def seconds(self) -> float:
        return self.job.seconds if self.job is not None else 0.0

    def records(self, kind: str | None = None) -> list[dict]:
        return records(self.workdir, kind)

    def records_by_rank(self, kind: str | None = None) -> dict[int, list[dict]]:
        return records_by_rank(self.workdir, kind)

    def say(self, label: str, *details: str | None) -> None:
        """One progress line: ``  <label>: <status>, <details>`` and, for a failed job,
        why (its one-line cause where the processes failed)."""
        line = f"  {label}: {self.info['status']}" + "".join(f", {d}" for d in details if d)
        if not self.ok:
            cause = self.info.get("cause") or (self.job.cause() if self.job is not None and not self.job.ok else None)
            line += f" -- {cause or self.info.get('error')}"
        print(line, flush=True)

    def fail(self, error: str) -> None:
        """Mark a job that ran to its end as failed (its records fell short)."""
        self.info.update(status="error", error=error)


def run(peer: Peer, where: P.Loopback | P.Namespaces, n: int, argv_of: Callable[[Any], list[str]], workdir: Path,
        timeout_s: float, *, env: Mapping[str, str] | None = None, layout: Sequence[tuple[str, int]] = (),
        info: Mapping[str, Any] | None = None, cause: bool = False, tail: int = 2000, rss: bool = False) -> Run:
    """Run one job of ``peer`` (see :func:`build_job`) in ``workdir``; never raises for
    a job that cannot start or fails (its record says why). ``info``: more fields of the
    run record; ``cause``: the failure's one-line cause instead of the worker's whole
    exception; ``rss``: the peak resident memory of every process (``peak_rss_mb``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {**(info or {}), "loadavg_before": loadavg()}
    try:
        job = build_job(peer, where, n, argv_of, workdir, timeout_s, env, layout)
    except Exception as exc:  # e.g. no mpirun for this peer
        error = f"{type(exc).__name__}: {exc}"
        record.update(status="error", error=error, loadavg_after=loadavg(), **({"cause": error} if cause else {}))
        return Run(None, record, workdir)
    sampler = PeakRss(workdir) if rss else None
    try:
        res = run_job(job)
    finally:
        if sampler is not None:
            record["peak_rss_mb"] = sampler.stop()
    record.update(status="ok" if res.ok else "error", seconds=round(res.seconds, 1), loadavg_after=loadavg())
    if not res.ok:
        record.update(res.failure(tail, cause))
    return Run(res, record, workdir)
