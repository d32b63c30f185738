"""Elastic jobs: the membership of each epoch, the rendezvous service under strangers,
and Horovod's elastic TensorFlow 2 example run under ``hostreduce run --min-np --max-np``
while a worker is killed and others are added."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import grpc
import pytest

from hostreduce.elastic import wire
from hostreduce.elastic.rendezvous import Membership, RendezvousService
from hostreduce.errors import ConfigError, WireError
from hostreduce.launch.elastic import parse_discovery

from tests.marks import wait_for_marks
from tests.script_jobs import MARKER_VAR, Job, base_env

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "tests" / "elastic_workers" / "tensorflow2_mnist_elastic.py"


# ------------------------------------------------------------------ membership
def _ready(reply):
    assert reply["state"] == "ready", reply
    return reply


def test_an_epoch_forms_once_every_running_worker_asked():
    m = Membership(min_np=1)
    m.started(0, "h")
    m.started(1, "h")
    assert m.join(0, 0, "h:1")["state"] == "wait"
    a = _ready(m.join(1, 0, "h:2"))
    assert (a["epoch"], a["rank"], a["size"], a["addresses"]) == (1, 1, 2, ["h:1", "h:2"])
    assert _ready(m.join(0, 0, "h:1"))["rank"] == 0
    assert m.updates_count() == 0


def test_survivors_keep_their_order_and_newcomers_come_last():
    m = Membership(min_np=1)
    for w in range(3):
        m.started(w, "h")
    for w in (2, 0, 1):
        m.join(w, 0, f"h:{w}")
    m.ended(0)                     # rank 0 fails: the lowest survivor becomes rank 0
    m.started(3, "h")              # a new worker asks while epoch 1 runs
    assert m.join(3, 0, "h:3")["state"] == "wait"
    assert m.updates_count() == 1
    assert m.join(3, 0, "h:3")["state"] == "wait" and m.updates_count() == 1   # counted once
    assert m.join(2, 1, "h:22")["state"] == "wait"
    b = _ready(m.join(1, 1, "h:11"))
    assert b["epoch"] == 2 and b["addresses"] == ["h:11", "h:22", "h:3"] and b["rank"] == 0
    assert _ready(m.join(3, 0, "h:3"))["rank"] == 2


def test_a_place_carries_the_update_count_its_epoch_includes():
    m = Membership(min_np=1)
    m.started(0, "h")
    m.started(1, "h")
    m.join(0, 0, "h:0")
    _ready(m.join(1, 0, "h:1"))
    m.started(2, "h")
    m.started(3, "h")
    assert m.join(2, 0, "h:2")["state"] == "wait"    # the members see it at a commit and reset
    assert m.join(0, 1, "h:0")["state"] == "wait"
    assert m.join(1, 1, "h:1")["state"] == "wait"
    place = _ready(m.join(3, 0, "h:3"))              # a second joiner, counted during the reset
    assert place["size"] == 4 and place["updates"] == m.updates_count() == 2


def test_check_host_updates_resets_only_for_joins_after_its_epoch_formed(monkeypatch):
    from hostreduce.horovod import elastic as hvd_elastic
    from hostreduce.ops import job as hr_job

    class Client:
        epoch_updates, count = 2, 2

        def updates(self):
            return self.count

    client = Client()
    monkeypatch.setattr(hr_job, "elastic_client", lambda: client)
    state = hvd_elastic.ObjectState(bcast_object=lambda obj: obj, get_rank=lambda: 0, batch=0)
    client.epoch_updates, client.count = 0, 1
    with pytest.raises(hvd_elastic.HostsUpdatedInterrupt):   # it sees the first join at a commit
        state.check_host_updates()
    client.epoch_updates, client.count = 2, 2   # the next epoch took in that joiner and a second one
    state.check_host_updates()
    client.count = 3                # a worker asks while the epoch runs
    with pytest.raises(hvd_elastic.HostsUpdatedInterrupt):
        state.check_host_updates()
    state.check_host_updates()


def test_a_worker_that_ends_releases_the_others_and_strangers_get_no_place():
    m = Membership(min_np=1)
    m.started(0, "h")
    m.started(1, "h")
    assert m.join(0, 0, "h:0")["state"] == "wait"
    m.ended(1)
    assert _ready(m.join(0, 0, "h:0"))["size"] == 1
    assert m.join(7, 0, "h:7")["state"] == "leave"


def test_a_retired_worker_leaves_at_the_next_epoch():
    m = Membership(min_np=1)
    for w in range(3):
        m.started(w, "h")
    for w in range(3):
        m.join(w, 0, f"h:{w}")
    m.retire(2)                          # its slot went away: members reset at their next commit
    assert m.updates_count() == 1 and not m.retired(2)
    assert m.join(0, 1, "h:0")["state"] == "wait"
    assert _ready(m.join(1, 1, "h:1"))["size"] == 2
    assert m.join(2, 1, "h:2")["state"] == "wait" and m.retired(2)   # until the launcher stops it


def test_a_retirement_is_taken_back_while_the_worker_is_still_a_member():
    m = Membership(min_np=1)
    for w in range(3):
        m.started(w, "h")
    for w in range(3):
        m.join(w, 0, f"h:{w}")
    m.retire(2)
    m.ended(1)                           # a slot came free again before the next epoch
    assert m.keep(2) and not m.retired(2)
    assert m.join(0, 1, "h:0")["state"] == "wait"
    place = _ready(m.join(2, 1, "h:2"))
    assert place["size"] == 2 and place["addresses"] == ["h:0", "h:2"]
    assert not m.keep(2)                 # not leaving any more
    assert not m.keep(7)                 # never one of the job's workers


def test_a_retirement_cannot_be_taken_back_once_an_epoch_formed_without_it():
    m = Membership(min_np=1)
    for w in range(2):
        m.started(w, "h")
    for w in range(2):
        m.join(w, 0, f"h:{w}")
    m.retire(1)
    assert _ready(m.join(0, 1, "h:0"))["size"] == 1 and m.retired(1)
    assert not m.keep(1) and m.retired(1)   # the launcher stops it


def test_no_epoch_below_min_np():
    m = Membership(min_np=2)
    m.started(0, "h")
    assert m.join(0, 0, "h:0")["state"] == "wait"
    m.started(1, "h")
    assert _ready(m.join(1, 0, "h:1"))["size"] == 2


def test_discovery_output():
    assert parse_discovery("localhost:2\n# a comment\n\nnode-1\n[::1]:3\n") == {"localhost": 2, "node-1": 1,
                                                                                 "::1": 3}
    with pytest.raises(ConfigError, match="host:slots"):
        parse_discovery("localhost:two\n")


# ------------------------------------------------------------------ the service
def test_rendezvous_service_refuses_strangers_and_answers_members():
    """Strangers' calls (no request, garbage, a wrong secret, non-ASCII, a body that is
    never finished) are refused at once and change nothing; a worker's sealed call gets
    its place, a reply is good for its own request only, a replayed request is refused."""
    import threading

    m = Membership(min_np=1)
    m.started(0, "127.0.0.1")
    service = RendezvousService(m, "s3cret")
    key = wire.REQUEST_KEY

    def ask(channel, value, body=()):
        call = channel.stream_unary(wire.METHOD)
        return call(iter(body), timeout=10, metadata=() if value is None else ((key, value),))

    try:
        with grpc.insecure_channel(service.address) as channel:
            # Callers that open a call and never finish its body hold no handler thread.
            stalled = threading.Event()

            def never_ends():
                stalled.wait(30)
                yield b""

            held = [channel.stream_unary(wire.METHOD).future(never_ends(), timeout=30) for _ in range(40)]
            refused = []
            for value in (None, "", "x" * 100, "Z" * 64 + ".{}",
                          wire.seal_request("wrong", {"op": "join", "worker": 0, "after": 0, "address": "1.2.3.4:5"})[0],
                          wire.seal_request("s3cret", {"op": "join", "worker": "0", "after": 0, "address": "a:1"})[0],
                          wire.seal_request("s3cret", {"op": "join", "worker": 0, "after": 0, "address": "no port"})[0],
                          wire.seal_request("s3cret", {"op": "join", "worker": 0, "after": 7, "address": "a:1"})[0],
                          wire.seal_request("s3cret", {"op": "drop", "worker": 0})[0]):
                with pytest.raises(grpc.RpcError) as info:
                    ask(channel, value)
                refused.append(info.value.code())
            assert refused[4] == grpc.StatusCode.UNAUTHENTICATED
            assert set(refused) <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT}
            assert all(f.done() for f in held)           # answered from their headers, bodies unread
            stalled.set()
            assert m.waiting() == [] and m.epoch == 0     # nothing a stranger sent changed the membership
            data, nonce = wire.seal_request("s3cret", {"op": "join", "worker": 0, "after": 0,
                                                       "address": "127.0.0.1:9"})
            raw = ask(channel, data)
            reply = wire.open_reply("s3cret", nonce, raw)
            assert reply["state"] == "ready" and reply["addresses"] == ["127.0.0.1:9"]
            with pytest.raises(WireError):   # a reply is good for its own request only
                wire.open_reply("s3cret", "0" * 32, raw)
            with pytest.raises(grpc.RpcError) as info:   # a recorded request sent again
                ask(channel, data)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "replayed" in info.value.details()
        assert service.refusals.count == 40 + 9 + 1
    finally:
        service.stop()
    for bad in ("é" * 64 + ".{}", "ab" * 40 + ".{}", b"\xff" * 64 + b".{}"):   # never an exception but WireError
        with pytest.raises(WireError):
            wire.open_request("s3cret", bad)


# ------------------------------------------------------------------ the example, 2 -> 1 -> 3
def _elastic_files(tmp_path: Path, hosts_text: str) -> tuple[Path, Path, Path]:
    """The marks directory, the hosts file (``hosts_text``) and a discovery script that
    prints it."""
    marks, hosts, discover = tmp_path / "marks", tmp_path / "hosts", tmp_path / "discover.sh"
    marks.mkdir()
    hosts.write_text(hosts_text)
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    return marks, hosts, discover


def _elastic_cmd(discover: Path, script: Path, *args: str) -> list[str]:
    """``hostreduce run -np 2 --min-np 1 --max-np 3 --host-discovery-script D -- python SCRIPT ARGS``."""
    return [sys.executable, "-m", "hostreduce", "run", "-np", "2", "--min-np", "1", "--max-np", "3",
            "--host-discovery-script", str(discover), "--", sys.executable, str(script), *args]


def _assert_one_process_weights(reference: Path, finals: list[Path]) -> None:
    """Every rank's final weights equal one process's (rel <= 1e-6)."""
    import numpy as np

    expected = np.load(reference)
    for path in finals:
        got = np.load(path)
        for key in expected.files:
            err = np.max(np.abs(got[key] - expected[key])) / max(1e-12, np.max(np.abs(expected[key])))
            assert err <= 1e-6, (path.name, key, err)


def _pid_of(job: Job, worker: int) -> int:
    want = {f"{MARKER_VAR}={job.marker}".encode(), f"HOSTREDUCE_ELASTIC_WORKER={worker}".encode()}
    for pid in job.leftovers():
        try:
            env = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if want <= env and b"elastic_workers" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError(f"no process of worker {worker}")


def _kill_one_then_grow_to_three(cmd: list[str], marks: Path, hosts: Path, *, ready: list[str], victim: int,
                                 hold_first: str, alone: str, hold_second: str) -> tuple[str, set[str], list[str]]:
    """Run an elastic example on 2 workers held at ``hold_first``: once ``ready`` are
    marked, SIGKILL worker ``victim`` (the discovery script offers 1 slot), release the
    survivor, wait until it marks ``alone``, offer 3 slots, wait until two workers wait
    to join, release ``hold_second`` and let the job end. Checks that it ended well, with
    the same weights on all 3 ranks; returns the launcher's output, the marks and what
    the job left in ``/dev/shm``."""
    (marks / hold_first).touch()
    (marks / hold_second).touch()
    with Job() as job:
        launcher = job.start(cmd, base_env(HR_ELASTIC_MARKS=str(marks)))
        _wait_marks(launcher, marks, ready)
        pid = _pid_of(job, victim)   # found first: the slot and the worker go together
        hosts.write_text("localhost:1\n")
        os.kill(pid, signal.SIGKILL)
        (marks / hold_first).unlink()
        _wait_marks(launcher, marks, [alone])
        hosts.write_text("localhost:3\n")
        _wait_output(launcher, "worker 2 waits to join")
        _wait_output(launcher, "worker 3 waits to join")
        (marks / hold_second).unlink()
        job.wait(300)
        leftovers = job.leftovers()
    out = launcher.output
    assert launcher.returncode == 0, out[-4000:]
    assert not leftovers
    done = re.findall(r"RESULT rank (\d)/(\d): weights=(\w+)", out)
    assert sorted((r, n) for r, n, _ in done) == [("0", "3"), ("1", "3"), ("2", "3")], out[-4000:]
    assert len({d for _, _, d in done}) == 1, done
    return out, set(os.listdir(marks)), [e for e in os.listdir("/dev/shm") if job.marker in e]


def test_horovods_elastic_example_survives_a_kill_and_grows(tmp_path):
    """``tensorflow2_mnist_elastic.py`` (import changed, local data) on 2 workers: worker 0,
    rank 0, is SIGKILLed mid-epoch and worker 1 goes on alone from its last commit as rank
    0; then the discovery script offers 3 slots, two workers join at a commit, and the job
    ends with the same weights on all 3 ranks, the example's checkpoint written by the
    rank 0 of the last epoch, every process gone."""
    marks, hosts, discover = _elastic_files(tmp_path, "localhost:2\n")
    out, names, shm_left = _kill_one_then_grow_to_three(
        _elastic_cmd(discover, str(EXAMPLE), "90", str(tmp_path / "ckpt")), marks, hosts,
        ready=["commit-w0-b3-s2", "commit-w1-b3-s2"], victim=0, hold_first="hold-b3", alone="commit-w1-b8-s1",
        hold_second="hold-b8")
    assert "worker 0 was killed by SIGKILL" in out
    assert re.search(r"\[1\] DONE worker 1 rank 0/3", out), out[-3000:]   # the chief's role moved to worker 1
    assert (tmp_path / "ckpt-1.index").exists(), sorted(os.listdir(tmp_path))
    # Worker 1 went on alone from its last commit: at most the step in flight was lost.
    alone = sorted(int(m.group(1)) for n in names if (m := re.fullmatch(r"commit-w1-b(\d+)-s1", n)))
    assert alone and alone[0] in (3, 4), alone
    assert any(re.fullmatch(r"commit-w[23]-b\d+-s3", n) for n in names)
    assert not shm_left


KERAS_EXAMPLE = ROOT / "tests" / "elastic_workers" / "tensorflow2_keras_mnist_elastic.py"


def test_horovods_elastic_keras_example_survives_a_kill_and_grows(tmp_path):
    """``tensorflow2_keras_mnist_elastic.py`` (import changed, Keras 3 renames, local data):
    ``fit`` with the commit and state callbacks on 2 workers; worker 1 is SIGKILLed in
    the first epoch, worker 0 resumes from its last commit alone, then two workers join
    in the next epoch and all 3 end with the same weights."""
    marks, hosts, discover = _elastic_files(tmp_path, "localhost:2\n")
    out, names, _ = _kill_one_then_grow_to_three(
        _elastic_cmd(discover, str(KERAS_EXAMPLE), "30", "3", str(tmp_path)), marks, hosts,
        ready=["batch-w0-e0-b4-s2", "batch-w1-e0-b4-s2"], victim=1, hold_first="hold-e0-b4",
        alone="batch-w0-e1-b2-s1", hold_second="hold-e1-b2")
    assert re.findall(r"DONE worker \d rank \d/3 epoch 3", out), out[-3000:]
    assert any(re.fullmatch(r"batch-w[23]-e2-b\d+-s3", n) for n in names), sorted(names)


DETERMINISTIC = ROOT / "tests" / "elastic_workers" / "deterministic.py"


def _wait_marks(launcher, marks, names: list[str], timeout: float = 240.0) -> None:
    """``wait_for_marks``, with what the launcher printed if the events do not come."""
    try:
        wait_for_marks(str(marks), names, timeout=timeout)
    except TimeoutError as e:
        raise AssertionError(f"{e}; the launcher printed:\n{launcher.output[-8000:]}") from None


def _wait_output(worker, text: str, timeout: float = 240.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while text not in worker.output:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{text!r} was not printed within {timeout:g} s")
        time.sleep(0.01)


@contextlib.contextmanager
def _deterministic_job(tmp_path: Path, steps: int, holds: tuple[str, ...], **env: str) -> Iterator[SimpleNamespace]:
    """``deterministic.py STEPS`` under the elastic launcher on 2 slots (its marks held at
    ``holds``), beside the one-process reference run (``tmp_path/ref.npz``). The body
    drives the job (``run.launcher``, ``run.job``, ``run.marks``, ``run.hosts``); on
    leaving, the job is waited for and must have ended well, every process gone."""
    marks, hosts, discover = _elastic_files(tmp_path, "localhost:2\n")
    for hold in holds:
        (marks / hold).touch()
    with Job() as job:
        run = SimpleNamespace(job=job, marks=marks, hosts=hosts, reference_path=tmp_path / "ref.npz")
        run.launcher = job.start(_elastic_cmd(discover, str(DETERMINISTIC), str(steps)),
                                 base_env(HR_ELASTIC_MARKS=str(marks), **env))
        run.reference = job.start([sys.executable, str(DETERMINISTIC), str(steps), "--reference",
                                   str(run.reference_path)], base_env())
        yield run
        job.wait(300)
        leftovers = job.leftovers()
    assert run.launcher.returncode == 0, run.launcher.output[-4000:]
    assert run.reference.returncode == 0, run.reference.output[-2000:]
    assert not leftovers


def test_a_job_going_2_1_3_2_ends_with_the_one_process_weights(tmp_path):
    """2 workers; one is SIGKILLed after the commit of step 4 (the survivor redoes
    nothing twice and loses nothing committed); at step 8 two workers join; at step 11
    the discovery script drops a slot and the newest worker leaves at the next commit;
    after 14 steps both ranks' weights equal one process's on the whole batches
    (rel <= 1e-6)."""
    with _deterministic_job(tmp_path, 14, ("hold-b4", "hold-b8", "hold-b11")) as run:
        launcher, marks, hosts = run.launcher, run.marks, run.hosts
        _wait_marks(launcher, marks, ["commit-w0-b4-s2", "commit-w1-b4-s2"])
        victim = _pid_of(run.job, 1)   # found first: the slot and the worker go together
        hosts.write_text("localhost:1\n")
        os.kill(victim, signal.SIGKILL)
        (marks / "hold-b4").unlink()
        _wait_marks(launcher, marks, ["commit-w0-b8-s1"])
        hosts.write_text("localhost:3\n")
        _wait_output(launcher, "worker 2 waits to join")
        _wait_output(launcher, "worker 3 waits to join")
        (marks / "hold-b8").unlink()
        _wait_marks(launcher, marks, ["commit-w0-b11-s3", "commit-w2-b11-s3", "commit-w3-b11-s3"])
        hosts.write_text("localhost:2\n")
        _wait_output(launcher, "worker 3: its slot left the discovery script's hosts")
        (marks / "hold-b11").unlink()
    names = set(os.listdir(marks))
    assert "commit-w0-b5-s1" in names, sorted(names)
    # Step 12's commit raised HostsUpdatedInterrupt; the 2 ranks went on with step 13, nothing redone.
    assert {"commit-w0-b13-s2", "commit-w2-b13-s2", "commit-w0-b14-s2"} <= names, sorted(names)
    assert not any(re.fullmatch(r"commit-w\d-b12-s\d", n) for n in names), sorted(names)
    assert not any(re.fullmatch(r"commit-w3-b1[234]-s\d", n) for n in names), sorted(names)
    assert "Traceback" not in launcher.output.split("worker 3: its slot")[-1], launcher.output[-3000:]
    _assert_one_process_weights(tmp_path / "ref.npz", [marks / f"final-w{w}.npz" for w in (0, 2)])


# ------------------------------------------------------------------ the launcher's options
def _run_cli(args, capsys):
    from hostreduce.launch.cli import main

    code = main(["run", *args])
    return code, capsys.readouterr().err


def test_elastic_options_are_checked(tmp_path, capsys):
    assert _run_cli(["-np", "2", "--min-np", "3", "--", "true"], capsys)[0] == 2
    code, err = _run_cli(["-np", "2", "--ps", "1", "--min-np", "1", "--", "true"], capsys)
    assert code == 2 and "--ps and --evaluator cannot be combined" in err and "--min-np" in err
    script = tmp_path / "hosts.sh"
    script.write_text("echo localhost:2\n")
    code, err = _run_cli(["-np", "1", "--host-discovery-script", str(script), "--", "true"], capsys)
    assert code == 2 and "executable" in err
    code, err = _run_cli(["-np", "1", "--max-np", "2", "--", "true"], capsys)   # a script that never joins
    assert code == 0, err


def test_an_elastic_job_whose_workers_all_fail_ends_with_their_status(capsys):
    code, err = _run_cli(["-np", "2", "--min-np", "1", "--", sys.executable, "-c", "raise SystemExit(3)"], capsys)
    assert code == 3, err
    assert "worker 0 exited with code 3" in err or "worker 1 exited with code 3" in err


# ------------------------------------------------------------------ workers on other hosts
def _netns():
    from benchmarks import netcluster

    return netcluster


def test_workers_on_other_hosts_start_through_the_agent_fail_and_join(tmp_path):
    """Hosts as network namespaces (``benchmarks/netcluster.py``, its ``rsh`` as the
    remote-shell agent): the launcher runs on the first with one worker; the discovery
    script adds the second host's worker; it is SIGKILLed and worker 0 goes on alone;
    the third host's worker joins; the job ends with one process's weights, and the
    secret never appears on a command line."""
    nc = _netns()
    usable, why = nc.netns_usable()
    if not usable:
        pytest.skip(f"`ip netns` is not usable here: {why}")
    marks, hosts, discover = _elastic_files(tmp_path, "")
    for step in (3, 6):
        (marks / f"hold-b{step}").touch()
    secret = "elastic-test-" + os.urandom(8).hex()
    with nc.NetCluster(3, rate="10gbit") as cluster, Job() as job:
        a = cluster.addresses
        hosts.write_text(f"{a[0]}:1\n{a[1]}:1\n")
        agent = f"{sys.executable} {ROOT / 'benchmarks' / 'netcluster.py'} rsh"
        cmd = cluster.exec_argv(0, [sys.executable, "-m", "hostreduce", "run", "-np", "1", "--min-np", "1",
                                    "--max-np", "3", "--host", a[0], "--ssh-command", agent,
                                    "--host-discovery-script", str(discover), "--", sys.executable,
                                    str(DETERMINISTIC), "9"])
        env = base_env(HR_ELASTIC_MARKS=str(marks), HOSTREDUCE_SECRET=secret, **cluster.hosts_env())
        launcher = job.start(cmd, env)
        reference = job.start([sys.executable, str(DETERMINISTIC), "9", "--reference", str(tmp_path / "ref.npz")],
                              base_env())
        _wait_marks(launcher, marks, ["commit-w0-b3-s2", "commit-w1-b3-s2"])
        lines = [Path(f"/proc/{p}/cmdline").read_bytes() for p in job.leftovers() if Path(f"/proc/{p}").exists()]
        assert lines and not any(secret.encode() in line for line in lines)
        victim = _pid_of(job, 1)
        hosts.write_text(f"{a[0]}:1\n")
        os.kill(victim, signal.SIGKILL)
        (marks / "hold-b3").unlink()
        _wait_marks(launcher, marks, ["commit-w0-b6-s1"])
        hosts.write_text(f"{a[0]}:1\n{a[2]}:1\n")
        _wait_output(launcher, "worker 2 waits to join")
        (marks / "hold-b6").unlink()
        job.wait(300)
        leftovers = job.leftovers()
    assert launcher.returncode == 0, launcher.output[-4000:]
    assert reference.returncode == 0, reference.output[-2000:]
    assert not leftovers
    names = set(os.listdir(marks))
    # Step 7's commit let worker 2 in (HostsUpdatedInterrupt): step 8 ran on 2 ranks.
    assert {"commit-w0-b4-s1", "commit-w0-b8-s2", "commit-w2-b8-s2", "commit-w2-b9-s2"} <= names, sorted(names)
    _assert_one_process_weights(tmp_path / "ref.npz", [marks / f"final-w{w}.npz" for w in (0, 2)])


def test_a_host_whose_workers_keep_failing_is_blacklisted(tmp_path, capsys):
    """Workers that fail at once are started again on their slots until their host has
    failed --blacklist-after times; then none starts there, and with fewer than --min-np
    left the job ends after --elastic-timeout, with the workers' status."""
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\necho localhost:1\n")
    discover.chmod(0o755)
    code, err = _run_cli(["-np", "1", "--min-np", "1", "--max-np", "1", "--host-discovery-script", str(discover),
                          "--blacklist-after", "2", "--elastic-timeout", "2", "--",
                          sys.executable, "-c", "raise SystemExit(5)"], capsys)
    assert code == 5, err
    assert "host 127.0.0.1 is blacklisted: its workers failed 2 times" in err
    assert "fewer than --min-np 1, and none could be started within 2 s" in err
    assert "worker 2 " not in err       # no third start on the blacklisted host


def test_the_reset_limit_ends_a_job_that_keeps_resetting(tmp_path, capsys):
    """Every worker joins an epoch and fails; the discovery script's slots bring new ones,
    forming another epoch: past --reset-limit the job fails, saying so."""
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\necho localhost:2\n")
    discover.chmod(0o755)
    worker = "import sys, hostreduce.horovod as hvd\nhvd.init()\nsys.exit(4)\n"
    code, err = _run_cli(["-np", "2", "--min-np", "1", "--max-np", "2", "--host-discovery-script", str(discover),
                          "--reset-limit", "1", "--blacklist-after", "9", "--", sys.executable, "-c", worker], capsys)
    assert code == 4, err
    assert "more than --reset-limit 1" in err


def test_host_resident_optimizer_slots_are_part_of_the_state():
    """With ``DistributedOptimizer(..., variables_on_host=True)`` the Adam slots live on the
    host; ``KerasState`` saves them at commit and puts them back at restore."""
    np = pytest.importorskip("numpy")
    tf = pytest.importorskip("tensorflow")
    import hostreduce.horovod.keras as hvd

    hvd.init()
    model = tf.keras.Sequential([tf.keras.layers.Dense(3)])
    model.build((None, 4))
    model.compile(loss="mse", optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.01),
                                                                  variables_on_host=True))
    x = np.ones((8, 4), np.float32)
    model.fit(x, np.ones((8, 3), np.float32), epochs=1, verbose=0)
    state = hvd.elastic.KerasState(model, batch=3)
    slots = [v for v in model.optimizer.variables if "momentum" in v.path or "velocity" in v.path]
    assert len(slots) == 4 and all("CPU" in v.value.device for v in slots)
    committed = [v.numpy().copy() for v in model.optimizer.variables + model.variables]
    model.fit(x, np.zeros((8, 3), np.float32), epochs=1, verbose=0)
    state.batch = 4
    assert not all(np.array_equal(a, v.numpy()) for a, v in zip(committed, model.optimizer.variables))
    state.restore()
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(committed, model.optimizer.variables + model.variables))
    assert state.batch == 3


def test_a_member_gone_before_its_epochs_ring_comes_up_costs_a_reset(tmp_path):
    """A joiner gets its place in the next epoch and exits before connecting: the other
    members' ring start-up fails (connect timeout) and they reset without it; the worker
    the launcher starts on the free slot joins later, and the result is one process's."""
    with _deterministic_job(tmp_path, 10, ("hold-b3", "die-after-init-w2"), HOSTREDUCE_CONNECT_TIMEOUT_S="5") as run:
        launcher, marks = run.launcher, run.marks
        _wait_marks(launcher, marks, ["commit-w0-b3-s2", "commit-w1-b3-s2"])
        run.hosts.write_text("localhost:3\n")
        _wait_output(launcher, "worker 2 waits to join")
        (marks / "hold-b3").unlink()
    out = launcher.output
    assert "worker 2 exited with code 3" in out, out[-3000:]
    assert re.search(r"\[[01]\] hvd.elastic: the job lost a worker", out), out[-3000:]
    finals = sorted(marks.glob("final-w*.npz"))
    assert {"final-w0.npz", "final-w1.npz"} <= {p.name for p in finals}, finals
    _assert_one_process_weights(tmp_path / "ref.npz", finals)


def test_a_slot_freed_by_a_death_goes_back_to_the_worker_that_was_leaving(tmp_path):
    """The host's slots drop from 2 to 1, so worker 1 (the newest) is to leave at the next
    commit; worker 0 is SIGKILLed before that commit: worker 1 keeps the freed slot and
    goes on alone from its last commit, no worker is started, and the result is one
    process's."""
    with _deterministic_job(tmp_path, 6, ("hold-b3",)) as run:
        launcher, marks = run.launcher, run.marks
        _wait_marks(launcher, marks, ["commit-w0-b3-s2", "commit-w1-b3-s2"])
        victim = _pid_of(run.job, 0)
        run.hosts.write_text("localhost:1\n")
        _wait_output(launcher, "worker 1: its slot left the discovery script's hosts")
        os.kill(victim, signal.SIGKILL)
        _wait_output(launcher, "worker 1: a slot of")
        (marks / "hold-b3").unlink()
    out = launcher.output
    assert "worker 2" not in out, out[-3000:]
    assert "commit-w1-b6-s1" in set(os.listdir(marks)), sorted(os.listdir(marks))
    _assert_one_process_weights(tmp_path / "ref.npz", [marks / "final-w1.npz"])
