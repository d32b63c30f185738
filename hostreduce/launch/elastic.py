"""``hostreduce run --min-np A --max-np B [--host-discovery-script S]``: an elastic job.

The launcher starts the first ``-np`` workers, runs the rendezvous service
(``hostreduce.elastic``) through which every epoch's members find each other, and then
follows the job: a worker that fails is counted against its host and the others go on
without it (they reset to their last commit); the discovery script, run every second,
names the hosts and slots the job may use (``host:slots`` per line), and the launcher
starts workers on free slots, up to ``--max-np``, which join the running workers at
their next commit. A host whose workers failed ``--blacklist-after`` times gets no new
workers. The job ends with status 0 when the members of its last epoch all finish,
and fails when fewer than ``--min-np`` workers are left and none can be started within
``--elastic-timeout``, or after ``--reset-limit`` resets.

Workers on this machine (the discovery script's ``localhost``, this machine's names, or
``--host``) are started directly; on another host through a remote-shell agent
(``--ssh-command``, default ``ssh -o BatchMode=yes``, called as ``AGENT HOST COMMAND``
as ``horovodrun`` and mpirun call ssh), in the launcher's working directory, with its
environment passed on the command line and the job's secret on the agent's standard
input. Remote workers must reach the rendezvous service, so ``--host`` must then be an
address of this machine that they can reach (not a loopback address).
"""
from __future__ import annotations

import dataclasses
import os
import queue
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Mapping, Sequence

from ..cluster import TF_CONFIG
from ..cluster.mpi_env import HOROVOD_VARIABLES
from ..elastic.wire import (DEFAULT_ELASTIC_TIMEOUT_S, ELASTIC_ADDRESS_VAR, ELASTIC_HOST_VAR, ELASTIC_TIMEOUT_VAR,
                            ELASTIC_WORKER_VAR, SECRET_VAR)
from ..elastic.rendezvous import Member, Membership, RendezvousService
from ..errors import ConfigError
from ..processes import exit_code, stop_groups
from .runner import GRACE_PERIOD_S, STOP_SIGNALS, TIMEOUT_EXIT_CODE, Relay, merge_env, message

__all__ = ["run_elastic", "parse_discovery", "remote_command", "DISCOVERY_EVERY_S", "ELASTIC_TIMEOUT_S",
           "SSH_COMMAND"]

DISCOVERY_EVERY_S = 1.0
DISCOVERY_TIMEOUT_S = 5.0
ELASTIC_TIMEOUT_S = DEFAULT_ELASTIC_TIMEOUT_S
BLACKLIST_AFTER = 3
SSH_COMMAND = "ssh -o BatchMode=yes"
MAX_SLOTS = 1024          # per host and line of the discovery script
_HOST_RE = re.compile(r"[A-Za-z0-9_.%:-]+")


def parse_discovery(text: str) -> dict[str, int]:
    """``{host: slots}`` from a discovery script's output: one ``host`` or ``host:slots``
    per line (``host`` alone: one slot); blank lines and ``#`` comments are skipped."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, sep, slots = line.rpartition(":") if line.count(":") == 1 or line.startswith("[") else ("", "", line)
        if not sep:
            host, slots = line, "1"
        host = host.strip("[]")
        try:
            count = int(slots)
        except ValueError:
            count = -1
        if _HOST_RE.fullmatch(host) is None or host.startswith("-") or not 0 <= count <= MAX_SLOTS:
            raise ConfigError(f"The host discovery script must print `host` or `host:slots` per line (a host name "
                              f"or address, 0 to {MAX_SLOTS} slots). Received: line {number}: {raw[:100]!r}")
        hosts[host] = hosts.get(host, 0) + count
    return hosts


_LOOPBACK = {"127.0.0.1", "::1", "localhost"}
# Not passed to workers on other hosts: they describe this machine's session.
_LOCAL_ONLY = {"HOME", "PWD", "OLDPWD", "SHELL", "SHLVL", "TERM", "DISPLAY", "USER", "LOGNAME", "HOSTNAME", "TMPDIR",
               "SSH_AUTH_SOCK", "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "_", "LS_COLORS", SECRET_VAR}


def remote_command(command: Sequence[str], env: Mapping[str, str], cwd: str) -> str:
    """The shell command a worker on another host runs (given to the remote-shell agent
    after the host): it reads the job's secret from its standard input, goes to ``cwd``,
    and runs ``command`` with ``env`` (less what describes this machine's session)."""
    assigns = [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())
               if k not in _LOCAL_ONLY and k.replace("_", "a").isalnum() and not k[:1].isdigit()]
    return (f"read -r {SECRET_VAR} && export {SECRET_VAR} && cd {shlex.quote(cwd)} && exec env "
            + " ".join(assigns) + " " + " ".join(shlex.quote(c) for c in command))


def _local_names(host: str) -> set[str]:
    names = {"localhost", "127.0.0.1", "::1", host}
    try:
        names.add(socket.gethostname())
        names.add(socket.getfqdn())
    except OSError:
        pass
    return names


@dataclasses.dataclass
class _Worker:
    wid: int
    host: str
    proc: subprocess.Popen
    relays: list[Relay]
    removed: bool = False    # retired by the launcher (its slot went away): its end is no failure
    stopping: bool = False


class _ElasticJob:
    def __init__(self, command: list[str], base: dict[str, str], secret: str, host: str, min_np: int,
                 max_np: int, prefix: bool, verbose: bool, elastic_timeout: float, ssh: list[str]) -> None:
        self.command, self.base, self.secret, self.host = command, base, secret, host
        self.elastic_timeout, self.ssh = elastic_timeout, ssh
        self.min_np, self.max_np, self.prefix, self.verbose = min_np, max_np, prefix, verbose
        self.workers: dict[int, _Worker] = {}
        self.exits: "queue.Queue[tuple[int, int]]" = queue.Queue()
        self.next_id = 0
        self.out_lock, self.err_lock = threading.Lock(), threading.Lock()
        self.epochs: list[list[Member]] = []
        self.membership = Membership(min_np, on_epoch=self._epoch_formed, on_ask=lambda w: message(
            f"worker {w} waits to join; the members take it in at their next commit"))
        self.service = RendezvousService(self.membership, secret, host)

    def _epoch_formed(self, epoch: int, members: list[Member]) -> None:
        self.epochs.append(list(members))
        if epoch > 1:
            message(f"epoch {epoch}: {len(members)} worker(s), ids {', '.join(str(m.worker) for m in members)} "
                    "in rank order")

    def running_on(self, host: str) -> list[_Worker]:
        return [w for w in self.workers.values() if w.host == host and w.proc.poll() is None and not w.removed]

    def start(self, host: str) -> None:
        """Start a worker on ``host``: this machine's (``self.host``) directly, another
        through the remote-shell agent."""
        wid = self.next_id
        self.next_id += 1
        env = {k: v for k, v in self.base.items() if k not in HOROVOD_VARIABLES and k != TF_CONFIG}
        env.update({SECRET_VAR: self.secret, ELASTIC_ADDRESS_VAR: self.service.address,
                    ELASTIC_WORKER_VAR: str(wid), ELASTIC_HOST_VAR: host,
                    ELASTIC_TIMEOUT_VAR: repr(self.elastic_timeout)})
        pipe = subprocess.PIPE if self.prefix else None
        self.membership.started(wid, host)   # before it can ask for its place
        try:
            proc = self._popen(host, env, pipe)
        except OSError:
            self.membership.ended(wid)
            raise
        relays: list[Relay] = []
        if self.prefix:
            tag = f"[{wid}] ".encode()
            for src, dest, lock in ((proc.stdout, sys.stdout, self.out_lock), (proc.stderr, sys.stderr, self.err_lock)):
                relay = Relay(src, dest, tag, lock, quiet=not self.verbose)  # type: ignore[arg-type]
                relays.append(relay)
                relay.thread.start()
        self.workers[wid] = _Worker(wid, host, proc, relays)

        def wait() -> None:
            self.exits.put((wid, proc.wait()))

        threading.Thread(target=wait, name=f"elastic-watch{wid}", daemon=True).start()

    def _popen(self, host: str, env: dict[str, str], pipe: int | None) -> subprocess.Popen:
        if host == self.host:
            proc = subprocess.Popen(self.command, env=env, stdin=subprocess.DEVNULL, stdout=pipe, stderr=pipe,
                                    start_new_session=True)
        else:
            proc = subprocess.Popen([*self.ssh, host, remote_command(self.command, env, os.getcwd())],
                                    env=self.base, stdin=subprocess.PIPE, stdout=pipe, stderr=pipe,
                                    start_new_session=True)
            try:  # the secret on the agent's stdin, never on a command line
                assert proc.stdin is not None
                proc.stdin.write(self.secret.encode() + b"\n")
                proc.stdin.close()
            except OSError:
                pass   # the agent failed at once: its exit is the worker's failure
        return proc

    def error_of(self, wid: int) -> str | None:
        worker = self.workers[wid]
        if len(worker.relays) < 2:
            return None
        worker.relays[1].thread.join(timeout=2.0)
        return worker.relays[1].last_error

    def stop(self, workers: Sequence[_Worker], grace: float) -> None:
        stop_groups([w.proc for w in workers], grace_s=grace)
        for w in workers:
            for relay in w.relays:
                relay.thread.join(timeout=5.0)


def _discover(script: str) -> dict[str, int] | str:
    """The script's hosts, or why it could not be read (it and what it started are
    stopped after ``DISCOVERY_TIMEOUT_S``)."""
    try:
        proc = subprocess.Popen([script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    try:
        out, err = proc.communicate(timeout=DISCOVERY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stop_groups([proc], grace_s=1.0)
        return f"it did not finish within {DISCOVERY_TIMEOUT_S:g} s"
    if proc.returncode != 0:
        return f"it exited with code {proc.returncode}: {err.decode(errors='replace').strip()[-300:]}"
    try:
        found = parse_discovery(out.decode(errors="replace"))
    except ConfigError as e:
        return str(e)
    if not any(found.values()):
        return "it printed no host with a slot (an empty reading is not taken as every host gone)"
    return found


def run_elastic(
    command: list[str],
    num_workers: int,
    *,
    min_np: int,
    max_np: int,
    discovery_script: str | None = None,
    reset_limit: int | None = None,
    elastic_timeout: float = ELASTIC_TIMEOUT_S,
    blacklist_after: int = BLACKLIST_AFTER,
    ssh_command: str = SSH_COMMAND,
    env: Mapping[str, str | None] | None = None,
    timeout: float | None = None,
    prefix: bool = True,
    host: str = "127.0.0.1",
    grace_period: float = GRACE_PERIOD_S,
    verbose: bool = False,
) -> int:
    """Run ``command`` as an elastic job of ``num_workers`` local workers to start with,
    between ``min_np`` and ``max_np`` while it runs (module docstring); ``ssh_command``
    starts workers on other hosts. Returns 0 when the
    members of the last epoch all succeeded, else the status of the last failure (124
    on ``timeout``, 128 + signal when interrupted)."""
    for name, value in (("num_workers", num_workers), ("min_np", min_np), ("max_np", max_np),
                        ("blacklist_after", blacklist_after)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}")
    if not min_np <= num_workers <= max_np:
        raise ConfigError(f"`num_workers` must be between `min_np` and `max_np`. Received: min_np={min_np}, "
                          f"num_workers={num_workers}, max_np={max_np}")
    if reset_limit is not None and (not isinstance(reset_limit, int) or isinstance(reset_limit, bool)
                                    or reset_limit < 0):
        raise ConfigError(f"`reset_limit` must be an integer >= 0 or None. Received: reset_limit={reset_limit!r}")
    if not elastic_timeout > 0:
        raise ConfigError(f"`elastic_timeout` must be a number of seconds > 0. Received: {elastic_timeout!r}")
    if discovery_script is not None and not os.access(discovery_script, os.X_OK):
        raise ConfigError("`--host-discovery-script` must name an executable file. "
                          f"Received: {discovery_script!r}")
    if discovery_script is not None:
        discovery_script = os.path.abspath(discovery_script)   # run as given, not looked up on PATH
    base = merge_env(env)
    base.setdefault("PYTHONUNBUFFERED", "1")
    secret = base.get(SECRET_VAR) or secrets.token_hex(32)
    job = _ElasticJob(list(command), base, secret, host, min_np, max_np, prefix, verbose, elastic_timeout,
                      shlex.split(ssh_command))
    received: list[int] = []
    previous: dict[int, object] = {}
    local = _local_names(host)
    failures: dict[str, int] = {}
    blacklisted: set[str] = set()
    told_remote: set[str] = set()
    final, code = "", 0
    finished = False          # a member of the current epoch finished: no epoch forms any more
    last_failure = 0
    short_since: float | None = None
    waiting_since: float | None = None
    next_discovery = 0.0
    discovery_failing = False

    def fail_start(where: str, exc: OSError) -> None:
        nonlocal last_failure
        last_failure = 127 if isinstance(exc, FileNotFoundError) else 126
        failures[where] = failures.get(where, 0) + 1
        message(f"cannot start a worker on {where}: {exc.strerror or exc}")

    try:
        if threading.current_thread() is threading.main_thread():
            for name in STOP_SIGNALS:
                signum = getattr(signal, name, None)
                if signum is None or signal.getsignal(signum) is signal.SIG_IGN:
                    continue
                previous[signum] = signal.signal(signum, lambda s, _f: received.append(s))
        try:
            for _ in range(num_workers):
                job.start(host)
        except OSError as exc:
            message(f"cannot start a worker: {command[0]!r}: {exc.strerror or exc}")
            return 127 if isinstance(exc, FileNotFoundError) else 126
        deadline = None if timeout is None else time.monotonic() + timeout
        while not received:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                message(f"timed out after {timeout:g} s; stopping every worker")
                return TIMEOUT_EXIT_CODE
            if reset_limit is not None and len(job.epochs) - 1 > reset_limit:
                final = f"the job reset {len(job.epochs) - 1} times, more than --reset-limit {reset_limit}"
                return last_failure or 1
            try:
                wid, returncode = job.exits.get(timeout=0.1)
            except queue.Empty:
                wid = None
            if wid is not None:
                worker = job.workers[wid]
                members = job.membership.member_ids()
                job.membership.ended(wid)
                if returncode == 0:
                    if wid in members and not finished:
                        # The job is done once its members are: no new epoch forms (a
                        # worker still waiting to join would start training alone).
                        finished = True
                        job.membership.close()
                elif not worker.removed:
                    last_failure = exit_code(returncode)
                    how = (f"was killed by {signal.Signals(-returncode).name}"
                           if returncode < 0 and -returncode in signal.valid_signals()
                           else f"exited with code {returncode}")
                    error = job.error_of(wid)
                    failures[worker.host] = failures.get(worker.host, 0) + 1
                    left = len(job.membership.running())
                    message(f"worker {wid} {how}{f' ({error})' if error else ''}; {left} worker(s) go on")
                    if failures[worker.host] >= blacklist_after and worker.host not in blacklisted:
                        blacklisted.add(worker.host)
                        message(f"host {worker.host} is blacklisted: its workers failed {failures[worker.host]} "
                                "times; no new worker starts there")
            running = job.membership.running()
            if finished:
                members = job.epochs[-1] if job.epochs else []
                if not {m.worker for m in members} & set(running):
                    rest = [w for w in job.workers.values() if w.proc.poll() is None]
                    job.stop(rest, grace_period)
                    bad = [w.proc.returncode for w in (job.workers[m.worker] for m in members)
                           if w.proc.returncode not in (0, None) and not w.removed]
                    if bad:
                        final = "the job's last epoch ended with a failed member"
                        return exit_code(bad[0])
                    return 0
                continue
            if not running and not discovery_script:
                # Done: with status 0 if the last epoch's members (every worker, when no
                # epoch formed) all succeeded.
                last = [m.worker for m in job.epochs[-1]] if job.epochs else list(job.workers)
                if all(job.workers[w].proc.returncode == 0 for w in last):
                    return 0
                final = "every worker has ended"
                return last_failure or 1
            # New workers on free slots (discovery), up to max_np.
            if discovery_script and now >= next_discovery:
                next_discovery = now + DISCOVERY_EVERY_S
                found = _discover(discovery_script)
                if isinstance(found, str):
                    if not discovery_failing:   # said once until it reads again
                        message(f"the host discovery script failed: {found}")
                    discovery_failing = True
                else:
                    discovery_failing = False
                    slots_of: dict[str, int] = {}
                    for name, slots in found.items():
                        where = host if name in local else name
                        if where != host and host in _LOOPBACK:
                            if name not in told_remote:
                                told_remote.add(name)
                                message(f"host {name!r} from the discovery script is not this machine, and workers "
                                        f"there cannot reach the launcher at --host {host}: give --host an address "
                                        "of this machine that they can reach; left out")
                            continue
                        slots_of[where] = slots_of.get(where, 0) + slots
                    room = max_np - len(running)
                    staying = len([w for w in job.workers.values() if w.proc.poll() is None and not w.removed])
                    for where in sorted({host, *slots_of, *(w.host for w in job.workers.values())}):
                        wanted, current = slots_of.get(where, 0), job.running_on(where)
                        # A slot free again (a worker of the host ended) first goes back to a
                        # worker leaving it that is still a member: nothing is restarted.
                        for w in sorted((w for w in job.workers.values() if w.host == where and w.removed
                                         and not w.stopping and w.proc.poll() is None), key=lambda w: w.wid):
                            if len(current) >= wanted or not job.membership.keep(w.wid):
                                continue
                            w.removed = False
                            current.append(w)
                            staying += 1
                            message(f"worker {w.wid}: a slot of {where} is free again; it stays in the job")
                        if where not in blacklisted:
                            for _ in range(max(0, min(wanted - len(current), room))):
                                try:
                                    job.start(where)
                                except OSError as exc:
                                    fail_start(where, exc)
                                    break
                                room -= 1
                        # Never below --min-np: the members go on, and leave when slots agree.
                        extra = min(len(current) - wanted, staying - min_np)
                        for w in sorted(current, key=lambda w: -w.wid)[:max(0, extra)]:
                            # The members reset at their next commit without it (nothing lost);
                            # it is stopped once it is out of the epoch.
                            w.removed = True
                            staying -= 1
                            job.membership.retire(w.wid)
                            message(f"worker {w.wid}: its slot left the discovery script's hosts; it leaves the job "
                                    "at the next commit")
            for w in list(job.workers.values()):
                if w.removed and w.proc.poll() is None and job.membership.retired(w.wid) and not w.stopping:
                    w.stopping = True
                    threading.Thread(target=job.stop, args=([w], grace_period), daemon=True).start()
            running = job.membership.running()
            if len(running) < min_np:
                short_since = now if short_since is None else short_since
                if now - short_since > elastic_timeout or not discovery_script:
                    final = (f"{len(running)} worker(s) left, fewer than --min-np {min_np}"
                             + (f", and none could be started within {elastic_timeout:g} s" if discovery_script else ""))
                    return last_failure or 1
            else:
                short_since = None
            # A member of the current epoch that never asks for its next place while other
            # members wait at the rendezvous is stuck (workers waiting to join are not).
            members = set(job.membership.member_ids()) & set(running)
            waiting = set(job.membership.waiting())
            stuck_ids = sorted(members - waiting) if waiting & members else []
            if stuck_ids:
                waiting_since = now if waiting_since is None else waiting_since
                if now - waiting_since > elastic_timeout:
                    stuck = [job.workers[w] for w in stuck_ids]
                    message(f"worker(s) {stuck_ids} did not come to the rendezvous within {elastic_timeout:g} s "
                            "while other members waited; stopping them")
                    threading.Thread(target=job.stop, args=(stuck, grace_period), daemon=True).start()
                    waiting_since = None
            else:
                waiting_since = None
        code = 128 + received[0]
        message(f"received {signal.Signals(received[0]).name}; stopping every worker")
        return code
    finally:
        job.membership.close()
        job.stop([w for w in job.workers.values()], grace_period)
        job.service.stop()
        if final:
            message(final)
        for signum, handler in previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
