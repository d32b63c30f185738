"""The simulated cluster builds its namespaces, shapes its links, and always removes
everything it made: on normal exit, on exceptions, on SIGTERM, and (for a run killed
outright) on the next start."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import netcluster as NC

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "netcluster.py"

_USABLE, _WHY = NC.netns_usable()
needs_netns = pytest.mark.skipif(not _USABLE, reason=f"`ip netns` is not usable here: {_WHY}")


def _ours(cluster: NC.NetCluster) -> set[str]:
    return set(cluster.namespaces) | {cluster.bridge_ns}


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def test_refuses_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NC, "_effective_uid", lambda: 1000)
    cluster = NC.NetCluster(2)
    with pytest.raises(NC.NetClusterError, match=r"needs root.*Received: effective uid=1000"):
        with cluster:
            pass  # pragma: no cover
    assert NC.netns_usable()[0] is False
    assert "needs root" in NC.netns_usable()[1]


def test_cli_refuses_without_root_with_clear_message() -> None:
    if os.geteuid() == 0:
        cmd = [sys.executable, "-c",  # run in ROOT: `python -c` imports from its working directory
               "import sys; from benchmarks import netcluster as NC; "
               "NC._effective_uid = lambda: 1000; sys.exit(NC.main(['check', '-n', '2']))"]
    else:
        cmd = [sys.executable, str(SCRIPT), "check", "-n", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert proc.returncode == 2
    assert "needs root" in proc.stderr and "sudo" in proc.stderr


@pytest.mark.parametrize("kwargs, match", [
    ({"nworkers": 1}, "`nworkers` must be an integer from 2 to 8"),
    ({"nworkers": 9}, "`nworkers` must be an integer from 2 to 8"),
    ({"nworkers": 2, "rate": "fast"}, "`rate` must look like"),
    ({"nworkers": 2, "subnet": "8.8.8.0/24"}, "`subnet` must be a private"),
    ({"nworkers": 2, "delay_ms": -1}, "`delay_ms` must be >= 0"),
])
def test_invalid_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(NC.NetClusterError, match=match):
        NC.NetCluster(**kwargs)


def test_parse_rate() -> None:
    assert NC.parse_rate("1gbit") == 1e9
    assert NC.parse_rate("10gbit") == 1e10
    assert NC.parse_rate("500mbit") == 5e8
    assert NC.parse_rate("125MBps") == 1e9
    assert NC.parse_rate(2e9) == 2e9


@needs_netns
@pytest.mark.timeout(120)
def test_setup_shapes_links_and_teardown_removes_everything() -> None:
    cluster = NC.NetCluster(3, "1gbit")
    with cluster:
        present = set(NC.list_namespaces())
        assert _ours(cluster) <= present
        for i, ns in enumerate(cluster.namespaces):
            addr = _ip("-n", ns, "-o", "-4", "addr", "show", "dev", "eth0")
            assert f"{cluster.addresses[i]}/24" in addr
            assert "UP" in _ip("-n", ns, "link", "show", "lo")
            qdisc = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", "eth0"], capture_output=True,
                                   text=True, check=True).stdout
            assert "tbf" in qdisc and "rate 1Gbit" in qdisc
            port = subprocess.run(["tc", "-n", cluster.bridge_ns, "qdisc", "show", "dev", f"w{i}"],
                                  capture_output=True, text=True, check=True).stdout
            assert "tbf" in port  # receiving is shaped too
        # The machine's own namespace has none of our links.
        assert "w0" not in _ip("-o", "link", "show") and "br0" not in _ip("-o", "link", "show")
        # A command runs in a worker's namespace and sees its address only.
        out = subprocess.run(cluster.exec_argv(2, ["ip", "-o", "-4", "addr", "show"]), capture_output=True,
                             text=True, check=True).stdout
        assert cluster.addresses[2] in out and cluster.addresses[0] not in out
        env = cluster.worker_env(1, port=1234, secret="s3")
        assert json.loads(env["TF_CONFIG"]) == {
            "cluster": {"worker": [f"{a}:1234" for a in cluster.addresses]}, "task": {"type": "worker", "index": 1}}
        assert env["HOSTREDUCE_SECRET"] == "s3"
        codes = cluster.run_all([sys.executable, "-c",
                                 "import os,sys; sys.exit(0 if os.environ['NETCLUSTER_RANK'] == sys.argv[1] "
                                 "and sys.argv[2].startswith('10.213.') else 1)", "{rank}", "{addr}"],
                                [cluster.worker_env(i) for i in range(3)], timeout_s=60)
        assert codes == [0, 0, 0]
        # A process still running at teardown is ended with its namespace.
        sleeper = cluster.popen(0, ["sleep", "60"])
    assert sleeper.poll() is not None
    assert not _ours(cluster) & set(NC.list_namespaces())
    cluster.teardown()  # a second teardown is harmless


@needs_netns
@pytest.mark.timeout(120)
def test_measured_rate_matches_shaping() -> None:
    with NC.NetCluster(2, "1gbit") as cluster:
        res = cluster.measure_rate(0, 1, seconds=0.5)
    # TCP/IP headers take ~4.5 % of a 1500-byte frame; a busy machine takes a bit more.
    assert 0.6 < res["ratio_to_nominal"] <= 1.02, res
    assert res["bytes"] > 0


@needs_netns
@pytest.mark.timeout(60)
def test_teardown_on_exception() -> None:
    cluster = NC.NetCluster(2)
    with pytest.raises(RuntimeError, match="boom"):
        with cluster:
            assert _ours(cluster) <= set(NC.list_namespaces())
            raise RuntimeError("boom")
    assert not _ours(cluster) & set(NC.list_namespaces())


@needs_netns
@pytest.mark.timeout(60)
def test_teardown_on_sigterm() -> None:
    code = ("import time; from benchmarks import netcluster as NC\n"
            "with NC.NetCluster(2) as c:\n"
            "    print(' '.join(c.namespaces + [c.bridge_ns]), flush=True)\n"
            "    time.sleep(60)\n")  # runs until the SIGTERM (the readline below waits for its start)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
    try:
        names = set(proc.stdout.readline().split())
        assert len(names) == 3 and names <= set(NC.list_namespaces())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not names & set(NC.list_namespaces())


@needs_netns
@pytest.mark.timeout(60)
def test_leftovers_of_a_killed_run_are_cleaned_on_next_start() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = [f"hr-{dead.pid}.1-0", f"hr-{dead.pid}.1-br"]
    live = f"hr-{os.getpid()}.999-0"  # a run that is still alive keeps its namespaces
    for ns in stale + [live]:
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        with NC.NetCluster(2) as cluster:
            assert set(stale) <= set(cluster.stale_removed)
            present = set(NC.list_namespaces())
            assert not set(stale) & present and live in present
    finally:
        for ns in stale + [live]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@needs_netns
@pytest.mark.timeout(60)
def test_cli_check_reports_rate_and_tears_down() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "check", "-n", "2", "--seconds", "0.3"],
                          capture_output=True, text=True, timeout=50, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    assert "Gbit/s" in proc.stdout and "torn down: ok" in proc.stdout
    info = json.loads(proc.stdout.splitlines()[0])
    assert not set(info["namespaces"]) & set(NC.list_namespaces())


@needs_netns
@pytest.mark.timeout(180)
@pytest.mark.parametrize("library", ["mpi", "horovod"])
def test_mpirun_runs_one_rank_per_namespace_over_the_links(library: str) -> None:
    # mpirun of the peer's MPI started in the first namespace: each rank runs in its own
    # namespace with its own hostname, and an all-reduce's bytes leave through its link.
    from benchmarks.harness import placement as P
    from hostreduce.reducers.mpi.select import mpirun_for

    try:
        mpirun_for(library)
    except Exception as exc:
        pytest.skip(f"no mpirun for {library}: {exc}")
    code = ("import os, json, socket, numpy as np\n"
            "from mpi4py import MPI\n"
            "tx = lambda: int(open('/sys/class/net/eth0/statistics/tx_bytes').read())\n"
            "c = MPI.COMM_WORLD; a = np.ones(1 << 20, np.float32); b = np.empty_like(a)\n"
            "c.Barrier(); t0 = tx(); c.Allreduce(a, b); c.Barrier(); sent = tx() - t0\n"
            "print(json.dumps({'rank': c.rank, 'host': socket.gethostname(), 'sum': float(b[0]), 'sent': sent,"
            " 'netns': os.readlink('/proc/self/ns/net')}), flush=True)\n")
    with P.network("1gbit", 3) as where:
        argv, env = where.mpirun(library, 3, [sys.executable, "-c", code])
        proc = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=150)
        names = where.cluster.namespaces
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # mpirun merges the ranks' output: one rank's line can land inside another's.
    ranks = [json.loads(m) for m in re.findall(r"\{[^{}]*\}", proc.stdout)]
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2]
    assert len({r["netns"] for r in ranks}) == 3 and os.readlink("/proc/self/ns/net") not in {r["netns"] for r in ranks}
    assert sorted(r["host"] for r in ranks) == sorted(names)
    assert all(r["sum"] == 3.0 for r in ranks)
    # 4 MiB reduced over 3 ranks: each sends at least a third of it over its link.
    assert all(r["sent"] >= (4 << 20) // 3 for r in ranks), ranks
