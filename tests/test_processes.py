"""The one process library (``hostreduce.processes``): ports, local TF_CONFIGs, exit
statuses, stopping a job's processes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from hostreduce.errors import ConfigError
from hostreduce.processes import alive, exit_code, free_ports, job_tasks, stop_groups

# A process that ignores SIGTERM, starts a grandchild in its own session (outside the
# group), prints both pids and waits.
_STUBBORN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"],
                         start_new_session=True)
print(os.getpid(), child.pid, flush=True)
time.sleep(600)
"""


def test_free_ports_are_distinct_and_arguments_are_checked():
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(0 < p < 65536 for p in ports)
    with pytest.raises(ConfigError, match="`count` must be an integer >= 1. Received: count=0"):
        free_ports(0)
    with pytest.raises(ConfigError, match="`host` must be a local address to bind to"):
        free_ports(1, "192.0.2.1")


def test_job_tasks_describe_one_cluster():
    tasks = job_tasks("127.0.0.1", 2, num_ps=1, evaluator=True)
    assert [label for label, _ in tasks] == ["0", "1", "ps0", "evaluator"]
    configs = [json.loads(raw) for _, raw in tasks]
    assert all(c["cluster"] == configs[0]["cluster"] for c in configs)
    assert [c["task"] for c in configs] == [{"type": "worker", "index": 0}, {"type": "worker", "index": 1},
                                            {"type": "ps", "index": 0}, {"type": "evaluator", "index": 0}]
    with pytest.raises(ConfigError, match="`num_ps` must be an integer >= 0. Received: num_ps=-1"):
        job_tasks("127.0.0.1", 2, num_ps=-1)


def test_exit_code_reads_signals_as_the_shell_does():
    assert (exit_code(0), exit_code(3), exit_code(-signal.SIGKILL)) == (0, 3, 128 + signal.SIGKILL)


@pytest.mark.timeout(60)
def test_stop_groups_ends_a_group_that_ignores_sigterm_and_named_pids_outside_it():
    proc = subprocess.Popen([sys.executable, "-c", _STUBBORN], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    leader, outside = map(int, proc.stdout.readline().split())
    assert alive(leader) and alive(outside)
    stop_groups([proc], pids=[outside], grace_s=0.5)
    assert proc.returncode == -signal.SIGKILL
    assert not alive(leader) and not alive(outside)
    proc.stdout.close()


def test_alive_is_false_for_a_zombie():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    try:
        assert not alive(proc.pid)
    finally:
        proc.wait()
