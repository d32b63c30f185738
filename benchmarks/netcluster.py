#!/usr/bin/env python
"""A simulated cluster on one machine: N workers, each in its own network namespace,
joined through a Linux bridge by links shaped to a given rate.

    python benchmarks/netcluster.py check -n 4 --rate 1gbit     # build, measure a link, tear down
    python benchmarks/netcluster.py run -n 2 --rate 10gbit -- python -c 'import os; print(os.environ["NETCLUSTER_RANK"])'
    python benchmarks/netcluster.py cleanup                      # remove what a killed run left behind

``mpirun`` reaches the workers too (:meth:`NetCluster.mpirun_argv`): it runs in the first
worker's namespace and starts its daemon on each other worker through ``netcluster.py
rsh`` (an ``ip netns exec`` in place of ssh); MPI's data then crosses the shaped links
over TCP.

Layout (everything lives in namespaces this module creates; the machine's own
interfaces, addresses and routes are never touched)::

    hr-<token>-0  eth0 10.213.0.1/24 --veth-- w0 \
    hr-<token>-1  eth0 10.213.0.2/24 --veth-- w1  >- br0   (in namespace hr-<token>-br)
    ...                                          /

Each link is shaped in both directions with a token bucket (``tc qdisc ... tbf rate R
burst B latency 50ms``): on the worker's ``eth0`` (what it sends) and on the bridge's
port ``w<i>`` (what it receives), so every worker has a full-duplex link of rate R, as
behind a switch. An optional ``netem`` delay is added on the worker's side.

Used as a context manager, the cluster is set up on entry and torn down on exit, on
exceptions and on SIGTERM/SIGHUP; namespaces left by a run that was killed outright are
removed the next time a cluster is built (their name carries the owner's pid). Needs
root.
"""
from __future__ import annotations

import argparse
import atexit
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hostreduce.processes import alive, stop_groups  # noqa: E402

__all__ = [
    "NetCluster",
    "NetClusterError",
    "cleanup_stale",
    "list_namespaces",
    "netns_usable",
    "parse_rate",
]

PREFIX = "hr-"
HOSTS_ENV = "NETCLUSTER_HOSTS"
DEFAULT_SUBNET = "10.213.0.0/24"
MIN_WORKERS, MAX_WORKERS = 2, 8
# hr-<pid>.<serial>-<i|br>: the pid says whether the run that owns it is still alive.
_NAME = re.compile(r"^hr-(\d+)\.(\d+)-(br|\d+)$")
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmg]?)(bit|bps)?\s*$", re.I)
_serial = 0
_serial_lock = threading.Lock()

# A TCP receiver and sender for the shaping check; run inside the namespaces with the
# same interpreter (standard library only).
_RECEIVER = r"""
import json, socket, sys, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2]))); srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept(); buf = bytearray(1 << 20); view = memoryview(buf)
total = 0; first = None
while True:
    n = conn.recv_into(view)
    if not n:
        break
    if first is None:
        first = time.perf_counter()
    total += n
end = time.perf_counter()
print(json.dumps({"bytes": total, "seconds": end - first if first else 0.0}), flush=True)
"""
_SENDER = r"""
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
data = bytes(1 << 20); deadline = time.perf_counter() + float(sys.argv[3])
while time.perf_counter() < deadline:
    s.sendall(data)
s.shutdown(socket.SHUT_WR); s.recv(1); s.close()
"""


class NetClusterError(RuntimeError):
    """The simulated cluster cannot be built, used or torn down."""


# --------------------------------------------------------------------------- helpers


def _effective_uid() -> int:
    return os.geteuid()


def _require_root() -> None:
    uid = _effective_uid()
    if uid != 0:
        raise NetClusterError(
            "The simulated cluster needs root: it creates network namespaces (`ip netns add`), "
            "veth pairs, a bridge and tc qdiscs. Run it as root (for example with sudo). "
            f"Received: effective uid={uid}")


def _ip_binary() -> str:
    path = shutil.which("ip")
    if path is None:
        raise NetClusterError(
            "The `ip` command (iproute2) was not found on PATH; install it, e.g. "
            "`apt-get install iproute2`.")
    return path


def _sh(argv: Sequence[str], check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise NetClusterError(f"`{shlex.join(argv)}` failed (exit {proc.returncode}): "
                              f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def parse_rate(rate: str | int | float) -> float:
    """Link rate in bits/s from ``'1gbit'``, ``'10gbit'``, ``'500mbit'`` or a number."""
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        value = float(rate)
    else:
        m = _RATE.match(str(rate))
        if not m:
            raise NetClusterError(f"`rate` must look like 1gbit, 10gbit or 500mbit. Received: rate={rate!r}")
        number, unit, kind = float(m.group(1)), m.group(2).lower(), (m.group(3) or "bit").lower()
        value = number * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[unit] * (8 if kind == "bps" else 1)
    if not value > 0:
        raise NetClusterError(f"`rate` must be > 0. Received: rate={rate!r}")
    return value


def list_namespaces() -> list[str]:
    """Names of every network namespace (``ip netns list``)."""
    out = _sh([_ip_binary(), "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace_processes(ns: str) -> None:
    """End what still runs inside one of our namespaces (only our workers can be there)."""
    ip = _ip_binary()
    for _ in range(2):  # again for any process started while the first ones ended
        pids = [int(p) for p in _sh([ip, "netns", "pids", ns], check=False).stdout.split() if p.isdigit()]
        pids = [p for p in pids if p != os.getpid()]
        if not pids:
            return
        stop_groups((), pids, grace_s=2.0)


def _delete_namespaces(names: Sequence[str]) -> list[str]:
    """Delete namespaces (workers before bridges); return the ones that would not go."""
    ip = _ip_binary()
    order = sorted(names, key=lambda n: n.endswith("-br"))
    for ns in order:
        _kill_namespace_processes(ns)
    for ns in order:
        _sh([ip, "netns", "del", ns], check=False)
    left = set(list_namespaces())
    return [ns for ns in order if ns in left]


def cleanup_stale() -> list[str]:
    """Delete the namespaces of runs whose owning process is gone; return their names."""
    stale = [ns for ns in list_namespaces()
             if (m := _NAME.match(ns)) and not alive(int(m.group(1)))]
    if stale:
        _delete_namespaces(stale)
    return stale


def netns_usable() -> tuple[bool, str]:
    """Whether namespaces, veth pairs, a bridge and tbf can be created here, and if not why."""
    try:
        _require_root()
        ip = _ip_binary()
        if shutil.which("tc") is None:
            return False, "the `tc` command (iproute2) was not found on PATH"
    except NetClusterError as exc:
        return False, str(exc)
    probe = f"{PREFIX}{os.getpid()}.probe"
    try:
        for argv in ([ip, "netns", "add", probe],
                     [ip, "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"],
                     [ip, "-n", probe, "link", "add", "pb", "type", "bridge"],
                     ["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "1gbit",
                      "burst", "256kb", "latency", "50ms"]):
            proc = _sh(argv, check=False)
            if proc.returncode != 0:
                return False, f"`{shlex.join(argv)}` failed: {(proc.stderr or proc.stdout).strip()}"
        return True, "ok"
    finally:
        _sh([ip, "netns", "del", probe], check=False)


# --------------------------------------------------------------------------- the cluster


class NetCluster:
    """N workers in network namespaces behind a bridge, links shaped to ``rate``.

    Args:
        nworkers: 2 to 8.
        rate: link rate per worker and direction (``'1gbit'``, ``'10gbit'``, bits/s).
        burst: token-bucket size; default 256 KiB per Gbit/s (2 ms at the link rate).
        delay_ms: one-way delay added with ``netem`` on each worker's egress (0: none).
        subnet: private IPv4 range for the workers' addresses (inside the namespaces).
        shape_ingress: also shape the bridge side, so that receiving is limited too.
        mtu: MTU of the links.
    """

    def __init__(self, nworkers: int, rate: str | float = "1gbit", *, burst: str | None = None,
                 delay_ms: float = 0.0, subnet: str = DEFAULT_SUBNET, shape_ingress: bool = True,
                 mtu: int = 1500) -> None:
        if not isinstance(nworkers, int) or isinstance(nworkers, bool) or not MIN_WORKERS <= nworkers <= MAX_WORKERS:
            raise NetClusterError(f"`nworkers` must be an integer from {MIN_WORKERS} to {MAX_WORKERS}. "
                                  f"Received: nworkers={nworkers!r}")
        self.rate_bps = parse_rate(rate)
        self.rate = f"{self.rate_bps / 1e6:g}mbit"
        self.burst = burst or f"{max(256, int(round(256 * self.rate_bps / 1e9)))}kb"
        if delay_ms < 0:
            raise NetClusterError(f"`delay_ms` must be >= 0. Received: delay_ms={delay_ms!r}")
        self.delay_ms = float(delay_ms)
        net = ipaddress.ip_network(subnet)
        if not net.is_private or net.version != 4 or net.num_addresses < nworkers + 2:
            raise NetClusterError(f"`subnet` must be a private IPv4 range with room for {nworkers} hosts. "
                                  f"Received: subnet={subnet!r}")
        self.nworkers = nworkers
        self.subnet = net
        self.shape_ingress = shape_ingress
        self.mtu = int(mtu)
        global _serial
        with _serial_lock:
            _serial += 1
            self.token = f"{os.getpid()}.{_serial}"
        self.bridge_ns = f"{PREFIX}{self.token}-br"
        self.namespaces = [f"{PREFIX}{self.token}-{i}" for i in range(nworkers)]
        hosts = list(net.hosts())
        self.addresses = [str(hosts[i]) for i in range(nworkers)]
        self.device = "eth0"
        self._up = False
        self._procs: list[subprocess.Popen] = []
        self._old_handlers: dict[int, Any] = {}
        self.stale_removed: list[str] = []

    # ----------------------------------------------------------------- life cycle

    def __enter__(self) -> "NetCluster":
        self.setup()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.teardown()

    def setup(self) -> None:
        _require_root()
        ip = _ip_binary()
        if shutil.which("tc") is None:
            raise NetClusterError("The `tc` command (iproute2) was not found on PATH; install iproute2.")
        self.stale_removed = cleanup_stale()
        self._install_signal_handlers()
        atexit.register(self.teardown)
        self._up = True  # from here on, teardown has something to remove
        try:
            br = self.bridge_ns
            prefix_len = self.subnet.prefixlen
            _sh([ip, "netns", "add", br])
            _sh([ip, "-n", br, "link", "set", "lo", "up"])
            _sh([ip, "-n", br, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0"])
            _sh([ip, "-n", br, "link", "set", "br0", "up"])
            for i, ns in enumerate(self.namespaces):
                port = f"w{i}"
                _sh([ip, "netns", "add", ns])
                # Both ends are created inside our namespaces: no interface ever exists in
                # the machine's own namespace.
                _sh([ip, "-n", br, "link", "add", port, "mtu", str(self.mtu), "type", "veth",
                     "peer", "name", self.device, "netns", ns, "mtu", str(self.mtu)])
                _sh([ip, "-n", br, "link", "set", port, "master", "br0"])
                _sh([ip, "-n", br, "link", "set", port, "up"])
                _sh([ip, "-n", ns, "link", "set", "lo", "up"])
                _sh([ip, "-n", ns, "addr", "add", f"{self.addresses[i]}/{prefix_len}", "dev", self.device])
                _sh([ip, "-n", ns, "link", "set", self.device, "up"])
                self._shape(ns, self.device, netem=True)
                if self.shape_ingress:
                    self._shape(br, port, netem=False)
            self._wait_reachable()
        except BaseException:
            self.teardown()
            raise

    def _shape(self, ns: str, dev: str, netem: bool) -> None:
        tbf = ["tbf", "rate", self.rate, "burst", self.burst, "latency", "50ms"]
        if netem and self.delay_ms > 0:
            proc = _sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                        "delay", f"{self.delay_ms:g}ms"], check=False)
            if proc.returncode != 0:
                raise NetClusterError(
                    f"Cannot add a netem delay of {self.delay_ms:g} ms on {ns}/{dev}: "
                    f"{(proc.stderr or proc.stdout).strip()} (this kernel may lack sch_netem); "
                    "use delay_ms=0.")
            _sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf])
        else:
            _sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf])

    def _wait_reachable(self, timeout_s: float = 10.0) -> None:
        """Every worker answers on its address from worker 0 (bridge ports are forwarding)."""
        deadline = time.monotonic() + timeout_s
        pending = list(range(1, self.nworkers))
        while pending:
            i = pending[0]
            proc = _sh(["ip", "netns", "exec", self.namespaces[0], sys.executable, "-c",
                        "import socket,sys\ns=socket.socket()\ns.settimeout(0.5)\n"
                        "r=s.connect_ex((sys.argv[1],9))\nsys.exit(0 if r in (0,111) else 1)",
                        self.addresses[i]], check=False)
            if proc.returncode == 0:  # connected or refused: the host is there
                pending.pop(0)
            elif time.monotonic() > deadline:
                raise NetClusterError(f"Worker {i} ({self.addresses[i]}) is not reachable from worker 0 "
                                      f"after {timeout_s:.0f} s: {proc.stderr.strip()}")
            else:
                time.sleep(0.1)

    def teardown(self) -> None:
        """Stop what runs in the namespaces and delete them; safe to call twice."""
        if not self._up:
            return
        self._up = False
        try:
            atexit.unregister(self.teardown)
        except Exception:
            pass
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in self._procs:
            try:
                p.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        mine = set(self.namespaces) | {self.bridge_ns}
        left = _delete_namespaces([ns for ns in list_namespaces() if ns in mine])
        self._restore_signal_handlers()
        if left:
            raise NetClusterError(f"Could not delete network namespaces {left}")

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def on_signal(signum: int, _frame: Any) -> None:
            # Unwinds through __exit__ (and the finally blocks of callers) to teardown.
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, on_signal)
            except (ValueError, OSError):
                pass

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._old_handlers.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, OSError, TypeError):
                pass
        self._old_handlers.clear()

    # ----------------------------------------------------------------- running things

    def exec_argv(self, index: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside worker ``index``'s namespace."""
        if not 0 <= index < self.nworkers:
            raise NetClusterError(f"`index` must be in [0, {self.nworkers}). Received: index={index!r}")
        return [_ip_binary(), "netns", "exec", self.namespaces[index], *argv]

    def popen(self, index: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` in worker ``index``'s namespace with ``env`` added to ours; it is
        killed at teardown if still running."""
        if not self._up:
            raise NetClusterError("The cluster is not set up; use it as `with NetCluster(...) as c:`.")
        full_env = {**os.environ, **(env or {})}
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.exec_argv(index, argv), env=full_env, **kwargs)
        self._procs.append(proc)
        return proc

    def run_all(self, argv: Sequence[str], envs: Sequence[Mapping[str, str]] | None = None,
                timeout_s: float = 600.0) -> list[int | None]:
        """Run ``argv`` on every worker at once (``{rank}`` and ``{addr}`` in it are filled
        in), each with its ``envs[i]``; return the exit codes. Past ``timeout_s`` the rest
        are killed and their code is None."""
        procs = []
        for i in range(self.nworkers):
            args = [a.replace("{rank}", str(i)).replace("{addr}", self.addresses[i]) for a in argv]
            procs.append(self.popen(i, args, env=envs[i] if envs else None))
        deadline = time.monotonic() + timeout_s
        codes: list[int | None] = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for p, code in zip(procs, codes):
            if code is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                p.wait()
        return codes

    def hosts_env(self) -> dict[str, str]:
        """What ``netcluster.py rsh`` reads to find a worker's namespace by its address."""
        return {HOSTS_ENV: ",".join(f"{a}={ns}" for a, ns in zip(self.addresses, self.namespaces))}

    def mpirun_argv(self, mpirun: Sequence[str], argv: Sequence[str]) -> list[str]:
        """``mpirun`` (its command up to the program: binary, ``-np``, exports) run in the
        first worker's namespace with one rank per worker and MPI's TCP transport on the
        links. Its environment must hold :meth:`hosts_env`. Each worker's processes get
        the namespace's name as their hostname (:func:`own_hostname`)."""
        subnet = self.subnet.with_prefixlen
        rsh = f"{sys.executable} {Path(__file__).resolve()} rsh"
        extra = ["--host", ",".join(f"{a}:1" for a in self.addresses), "--map-by", "node", "--mca", "plm_rsh_agent", rsh,
                 "--mca", "pml", "ob1", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", subnet,
                 "--mca", "oob_tcp_if_include", subnet,
                 # Every namespace has this machine's hostname: Open MPI's hierarchical
                 # and shared-memory collectives would take the workers for one node and
                 # meet in /dev/shm, which the namespaces share.
                 "--mca", "coll", "^han,sm",
                 # Open MPI 4's daemons in the other namespaces would put hwloc's topology in
                 # shared memory at a hole of their address space, and now and then crash
                 # there (orted: segfault in hwloc_shmem_topology_write); "none" skips it.
                 # Open MPI 5 has no such parameter and ignores it.
                 "--mca", "rtc_hwloc_vmhole", "none"]
        return self.exec_argv(0, own_hostname(self.namespaces[0], [*mpirun, *extra, *argv]))

    def worker_env(self, index: int, port: int = 29500, secret: str | None = None) -> dict[str, str]:
        """``TF_CONFIG`` (this cluster's addresses, one port) plus the worker's identity."""
        addrs = [f"{a}:{port}" for a in self.addresses]
        env = {
            "TF_CONFIG": json.dumps({"cluster": {"worker": addrs}, "task": {"type": "worker", "index": index}}),
            "NETCLUSTER_RANK": str(index),
            "NETCLUSTER_SIZE": str(self.nworkers),
            "NETCLUSTER_ADDRESSES": ",".join(self.addresses),
        }
        if secret is not None:
            env["HOSTREDUCE_SECRET"] = secret
        return env

    # ----------------------------------------------------------------- verification

    def measure_rate(self, src: int = 0, dst: int = 1, seconds: float = 1.0, port: int = 29999) -> dict[str, Any]:
        """Send TCP data from worker ``src`` to ``dst`` for ``seconds``; the achieved rate."""
        receiver = self.popen(dst, [sys.executable, "-c", _RECEIVER, self.addresses[dst], str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = receiver.stdout.readline() if receiver.stdout else ""
            if line.strip() != "ready":
                raise NetClusterError(f"Rate check: the receiver did not start: {line!r} "
                                      f"{receiver.stderr.read() if receiver.stderr else ''}")
            sender = self.popen(src, [sys.executable, "-c", _SENDER, self.addresses[dst], str(port), str(seconds)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            _, err = sender.communicate(timeout=seconds + 30)
            if sender.returncode != 0:
                raise NetClusterError(f"Rate check: the sender failed: {err.strip()}")
            out, err = receiver.communicate(timeout=30)
        finally:
            if receiver.poll() is None:
                receiver.kill()
                receiver.wait()
        try:
            rec = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise NetClusterError(f"Rate check: unexpected receiver output {out!r} {err!r}") from None
        bps = rec["bytes"] * 8 / rec["seconds"] if rec["seconds"] > 0 else 0.0
        return {"src": src, "dst": dst, "bytes": rec["bytes"], "seconds": round(rec["seconds"], 4),
                "achieved_bps": bps, "achieved_gbps": round(bps / 1e9, 4), "nominal_bps": self.rate_bps,
                "ratio_to_nominal": round(bps / self.rate_bps, 4)}

    def describe(self) -> dict[str, Any]:
        return {"nworkers": self.nworkers, "rate": self.rate, "rate_bps": self.rate_bps, "burst": self.burst,
                "delay_ms": self.delay_ms, "shape_ingress": self.shape_ingress, "mtu": self.mtu,
                "subnet": str(self.subnet), "addresses": self.addresses, "namespaces": self.namespaces,
                "bridge_namespace": self.bridge_ns}


# --------------------------------------------------------------------------- CLI


def _cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--nworkers", type=int, default=2, help="workers, 2..8 (default 2)")
    p.add_argument("--rate", default="1gbit", help="link rate per worker and direction (default 1gbit)")
    p.add_argument("--burst", default=None, help="tbf burst (default 256kb per Gbit/s)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="netem one-way delay on each worker (default 0)")
    p.add_argument("--subnet", default=DEFAULT_SUBNET, help=f"private range for the workers (default {DEFAULT_SUBNET})")
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--no-ingress-shaping", action="store_true", help="shape only what workers send")


def _make(args: argparse.Namespace) -> NetCluster:
    return NetCluster(args.nworkers, args.rate, burst=args.burst, delay_ms=args.delay_ms, subnet=args.subnet,
                      shape_ingress=not args.no_ingress_shaping, mtu=args.mtu)


def rsh(argv: Sequence[str]) -> int:
    """``rsh [options] HOST COMMAND...``: run COMMAND with ``/bin/sh`` in the namespace of
    the worker whose address is HOST (from :data:`HOSTS_ENV`): ``mpirun``'s launch agent."""
    args = list(argv)
    while args and args[0].startswith("-"):
        args.pop(0)
    if len(args) < 2:
        print("netcluster rsh: usage: rsh HOST COMMAND...", file=sys.stderr)
        return 2
    table = dict(item.split("=", 1) for item in os.environ.get(HOSTS_ENV, "").split(",") if "=" in item)
    if args[0] not in table:
        print(f"netcluster rsh: no namespace for host {args[0]!r} in {HOSTS_ENV}={os.environ.get(HOSTS_ENV)!r}",
              file=sys.stderr)
        return 2
    ns = table[args[0]]
    os.execv(_ip_binary(), [_ip_binary(), "netns", "exec", ns, *own_hostname(ns, ["/bin/sh", "-c", " ".join(args[1:])])])
    return 0  # not reached


def own_hostname(name: str, argv: Sequence[str]) -> list[str]:
    """``argv`` run with a hostname of its own (a UTS namespace): MPI launchers tell
    nodes apart by hostname, and every network namespace has this machine's."""
    return ["unshare", "--uts", "/bin/sh", "-c", 'hostname "$0" && exec "$@"', name, *argv]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["rsh"]:  # mpirun's launch agent: its arguments are not ours to parse
        return rsh(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    chk = sub.add_parser("check", help="build the cluster, measure one link's TCP rate, tear down")
    _cluster_args(chk)
    chk.add_argument("--seconds", type=float, default=1.0, help="length of the TCP transfer (default 1)")
    run = sub.add_parser("run", help="run a command on every worker ({rank}, {addr} are filled in)")
    _cluster_args(run)
    run.add_argument("--port", type=int, default=29500, help="port of every worker in TF_CONFIG")
    run.add_argument("--secret", action="store_true", help="set a random HOSTREDUCE_SECRET shared by the workers")
    run.add_argument("--timeout", type=float, default=600.0)
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    sub.add_parser("cleanup", help="delete namespaces left behind by runs that no longer exist")
    args = p.parse_args(argv)
    try:
        if args.cmd == "cleanup":
            _require_root()
            removed = cleanup_stale()
            print(f"removed {len(removed)} namespace(s)" + (f": {' '.join(removed)}" if removed else ""))
            return 0
        cluster = _make(args)
        if args.cmd == "check":
            with cluster:
                print(json.dumps(cluster.describe()))
                res = cluster.measure_rate(0, 1, seconds=args.seconds)
                print(f"TCP {cluster.addresses[0]} -> {cluster.addresses[1]}: {res['achieved_gbps']:.3f} Gbit/s "
                      f"({res['ratio_to_nominal']:.1%} of {cluster.rate})")
            gone = not any(ns in list_namespaces() for ns in cluster.namespaces + [cluster.bridge_ns])
            print("torn down: " + ("ok" if gone else "NAMESPACES LEFT"))
            return 0 if gone else 1
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            p.error("run needs a command after --")
        with cluster:
            secret = secrets.token_hex(16) if args.secret else None
            envs = [cluster.worker_env(i, args.port, secret) for i in range(cluster.nworkers)]
            codes = cluster.run_all(command, envs, timeout_s=args.timeout)
        print(f"exit codes: {codes}", file=sys.stderr)
        return 0 if all(c == 0 for c in codes) else 1
    except NetClusterError as exc:
        print(f"netcluster: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
