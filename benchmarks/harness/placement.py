"""Where the ranks of a job run and how they find each other.

* :class:`Loopback`: every rank on this host, on fresh loopback ports, each with its
  ``TF_CONFIG``;
* :class:`Namespaces`: one rank per network namespace of a simulated cluster
  (``netcluster.NetCluster``: a bridge, links shaped with ``tc`` to a rate), each with
  the cluster's ``TF_CONFIG`` and its command run inside its namespace;
* :func:`mpirun`: one launcher command that starts the ranks itself, with the
  ``mpirun`` that belongs to the MPI library of the peer (hostreduce's choice, found one
  way for every benchmark).

:func:`network` opens the placement a benchmark's ``--networks`` value names:
``loopback`` or a link rate such as ``1gbit``.

Ports and ``TF_CONFIG`` come from the project's process library (``hostreduce.processes``,
``hostreduce.cluster``), as the launcher's and the tests' do.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

from hostreduce.cluster import format_tf_config
from hostreduce.processes import free_ports, tf_config
from hostreduce.reducers.mpi.select import mpirun_command, mpirun_for

from benchmarks import netcluster as NC

__all__ = ["CLUSTER_PORT", "Loopback", "Namespaces", "network", "usable_networks", "mpirun", "mpirun_version",
           "horovod_mpirun", "loopback_addresses", "task_configs", "free_ports"]

CLUSTER_PORT = 29500  # every worker of a simulated cluster has its own address


def loopback_addresses(n: int) -> list[str]:
    """``n`` loopback addresses on ports that were free a moment ago."""
    return [f"127.0.0.1:{p}" for p in free_ports(n)]


class Loopback:
    """Every rank on this host."""

    name = "loopback"
    rate_bps: float | None = None
    cluster = None

    def rank_envs(self, n: int) -> list[dict[str, str]]:
        addresses = loopback_addresses(n)
        return [{"TF_CONFIG": tf_config(addresses, r)} for r in range(n)]

    def wrap(self, rank: int, argv: list[str]) -> list[str]:
        return argv

    def measure_rate(self, seconds: float) -> None:
        return None


class Namespaces:
    """One rank per namespace of a simulated cluster that is set up."""

    def __init__(self, cluster: NC.NetCluster, name: str | None = None, port: int = CLUSTER_PORT) -> None:
        self.cluster, self.port = cluster, port
        self.name, self.rate_bps = name or cluster.rate, cluster.rate_bps

    def rank_envs(self, n: int) -> list[dict[str, str]]:
        if n != self.cluster.nworkers:
            raise ValueError(f"`n` must be the cluster's {self.cluster.nworkers} workers. Received: n={n}")
        return [self.cluster.worker_env(r, self.port) for r in range(n)]

    def wrap(self, rank: int, argv: list[str]) -> list[str]:
        return self.cluster.exec_argv(rank, argv)

    def mpirun(self, library: str, n: int, argv: list[str], export: Sequence[str] = ()) -> tuple[list[str], dict]:
        """The command and extra environment of an ``mpirun`` job with one rank per
        namespace (``netcluster.NetCluster.mpirun_argv``)."""
        if n != self.cluster.nworkers:
            raise ValueError(f"`n` must be the cluster's {self.cluster.nworkers} workers. Received: n={n}")
        env = self.cluster.hosts_env()
        base = mpirun(library, n, [], export=[*export, *env])
        return self.cluster.mpirun_argv(base, argv), env

    def measure_rate(self, seconds: float) -> dict[str, Any]:
        """One link's TCP rate (worker 0 -> 1), for the run record."""
        return self.cluster.measure_rate(0, 1, seconds=seconds)


@contextlib.contextmanager
def network(name: str, n: int) -> Iterator[Loopback | Namespaces]:
    """The placement of ``n`` ranks on ``name``: ``loopback``, or a simulated cluster
    with links of that rate, set up for the ``with`` block and torn down after it."""
    if name == "loopback":
        yield Loopback()
        return
    with NC.NetCluster(n, name) as cluster:
        yield Namespaces(cluster, name)


def usable_networks(wanted: Sequence[str]) -> tuple[list[str], bool, str]:
    """The networks of ``wanted`` this machine can run (simulated clusters need root and
    ``ip``/``tc``), whether namespaces are usable, and why not; says so when it drops some."""
    usable, why = NC.netns_usable()
    if not usable and any(nw != "loopback" for nw in wanted):
        print(f"network namespaces unavailable ({why}); running the loopback part only", flush=True)
    return [nw for nw in wanted if nw == "loopback" or usable], usable, why


def mpirun(library: str, n: int, argv: list[str], export: Sequence[str] = ()) -> list[str]:
    """``mpirun -np n ... argv`` with the mpirun of ``library`` (``mpi``: the one mpi4py's
    Open MPI belongs to; ``horovod``: the one of Horovod's MPI), exporting ``export``."""
    return mpirun_command(library, n, argv, extra=[a for k in export for a in ("-x", k)])


def mpirun_version(library: str = "mpi") -> str | None:
    """The first line of ``mpirun --version`` for ``library``, None where there is none."""
    from benchmarks.harness.report import command_output

    try:
        out = command_output([mpirun_for(library), "--version"])
    except Exception:
        return None
    return out.splitlines()[0] if out else None


def horovod_mpirun() -> tuple[bool, str]:
    """Whether Horovod is installed with an mpirun for it, and if not why."""
    import importlib.util

    if importlib.util.find_spec("horovod") is None:
        return False, "horovod is not installed"
    try:
        mpirun_for("horovod")
    except Exception as exc:
        return False, str(exc)
    return True, "ok"


def task_configs(layout: Sequence[tuple[str, int]], host: str = "127.0.0.1") -> list[str]:
    """The ``TF_CONFIG`` of each task of a job with several task types (``chief``,
    ``worker``, ``ps``), in the order of ``layout``'s ``(type, index)`` pairs, on fresh
    ports of ``host``."""
    counts: dict[str, int] = {}
    for task, index in layout:
        counts[task] = max(counts.get(task, 0), index + 1)
    ports = iter(free_ports(sum(counts.values())))
    cluster = {t: [f"{host}:{next(ports)}" for _ in range(counts[t])] for t in ("chief", "worker", "ps") if t in counts}
    return [format_tf_config(cluster, index, task) for task, index in layout]
