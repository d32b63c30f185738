"""A parameter-server job started as users start one, ``hostreduce run -np 2 --ps 2``,
trained while strangers hold 200 calls open on each ps (each on a connection of its own,
their requests never sent) and send 1,000 connections of garbage and calls to unknown
methods to each ps: its final weights equal an undisturbed run's bit for bit, every task
exits 0, no process outlives the job, and each ps's resident memory stays within a bound.

The attack comes between the chief's first and second steps (the chief waits for it),
so the job trains with the held connections open."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.marks import mark, wait_for_marks
from tests.ps_strangers import GARBAGE_PER_PS, HELD_PER_PS, Strangers
from tests.script_jobs import Job, base_env, run_launcher

pytestmark = pytest.mark.timeout(420)

SCRIPT = Path(__file__).resolve().parent / "ps_scripts" / "estimator_ps.py"
STEPS = 6
# What a ps may grow by while strangers hold 200 connections on it and send it 1,000
# more: gRPC's per-connection state (5.5-6.9 MiB in all, measured on 127.0.0.1), never
# a buffered request body.
RSS_BOUND = 48 << 20


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _job(tmp_path: Path, name: str, marks: Path | None = None):
    out = tmp_path / name
    out.mkdir()
    args = ["--optimizer", "adam", "--steps", str(STEPS), "--progress", "--out", str(out)]
    if marks is not None:
        args += ["--marks", str(marks)]
    with Job() as job:
        worker = run_launcher(SCRIPT, args, np=2, timeout=360, job=job, extra=["--ps", "2"],
                              env=base_env(HOSTREDUCE_TIMEOUT_S="60", HOSTREDUCE_CONNECT_TIMEOUT_S="120"))
        left = job.leftovers()
    return worker, left, out


def test_a_launched_ps_job_under_held_connections_and_garbage_trains_as_an_undisturbed_one(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(zip(("worker", "left", "out"),
                                                               _job(tmp_path, "attacked", marks))))
    runner.start()
    strangers = None
    grew: dict[int, int] = {}
    try:
        wait_for_marks(marks, ["ps-0", "ps-1", "chief-step-1"], timeout=240)
        tasks = [json.loads((marks / f"ps-{k}").read_text()) for k in range(2)]
        before = [_rss(t["pid"]) for t in tasks]
        strangers = Strangers([t["address"] for t in tasks])
        strangers.hold(HELD_PER_PS)
        strangers.refused()
        strangers.garbage(GARBAGE_PER_PS)
        grew = {k: _rss(t["pid"]) - before[k] for k, t in enumerate(tasks)}
    finally:
        mark(marks, "resume")  # the chief trains on with the held connections open
        runner.join(400)
    ended = strangers.close() if strangers is not None else {}
    assert not runner.is_alive()
    worker, left, out = result["worker"], result["left"], result["out"]
    assert worker.returncode == 0, worker.output
    assert left == [], left
    for label in ("[ps0]", "[ps1]"):
        assert f"{label} INFO:tensorflow:ps task {label[3]}: the chief ended the job" in worker.output, worker.output
    assert sum(ended.values()) == 2 * HELD_PER_PS and all(" UNAUTHENTICATED" in k or " INVALID_ARGUMENT" in k
                                                          for k in ended), ended
    print(f"ps resident memory grew by {[g / 2**20 for g in grew.values()]} MiB under the strangers")
    assert all(g < RSS_BOUND for g in grew.values()), grew

    calm, calm_left, calm_out = _job(tmp_path, "undisturbed")
    assert calm.returncode == 0, calm.output
    assert calm_left == [], calm_left
    for rank in (0, 1):
        got, expected = np.load(out / f"{rank}.npz"), np.load(calm_out / f"{rank}.npz")
        assert sorted(got.files) == sorted(expected.files)
        for k in expected.files:
            assert got[k].tobytes() == expected[k].tobytes(), (rank, k)
