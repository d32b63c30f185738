"""The scaling and host-apply benchmarks' smoke modes run end to end and write complete results."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import netcluster as NC

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def _run(script: str, out: Path, timeout: float, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTREDUCE_")}
    proc = subprocess.run([sys.executable, str(BENCH / script), "--quick", *extra, "--out", str(out)], cwd=str(ROOT),
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.timeout(120)
def test_scale_quick_writes_every_field(tmp_path: Path) -> None:
    proc = _run("scale.py", tmp_path, timeout=100)
    result = json.loads((tmp_path / "scale.json").read_text())
    assert (tmp_path / "scale.png").stat().st_size > 0
    for key in ("benchmark", "environment", "settings", "runs", "measurements", "targets"):
        assert key in result, key
    assert result["environment"]["loadavg_at_start"] and result["environment"]["loadavg_at_end"]
    assert result["settings"]["np"] == [2] and result["settings"]["sizes"] == [1 << 20]
    assert result["settings"]["transport"] == "tcp"
    usable = NC.netns_usable()[0]
    networks = ["loopback", "1gbit"] if usable else ["loopback"]
    assert result["settings"]["networks"] == networks
    rows = {r["network"]: r for r in result["measurements"]}
    assert set(rows) == set(networks)
    for network, row in rows.items():
        assert result["runs"][network]["2"]["status"] == "ok"
        assert row["np"] == 2 and row["bytes"] == 1 << 20 and row["correct"]
        assert row["time_ms"] > 0 and row["busbw_GBps"] > 0 and set(row["rank_times_ms"]) == {"0", "1"}
        assert row["loadavg_before"] and row["loadavg_after"]
    if usable:
        row = rows["1gbit"]
        # bound = 2(N-1)/N * S / B; at N=2: S / (125 MB/s).
        assert row["bound_ms"] == pytest.approx((1 << 20) / 125e6 * 1e3, rel=1e-3)
        assert row["ratio_to_bound"] == pytest.approx(row["bound_ms"] / row["time_ms"], rel=1e-2)
        assert 0 < row["ratio_to_bound"] <= 1.05  # the shaped link really limits the ring
        check = result["runs"]["1gbit"]["2"]["tcp_check"]
        assert 0.5 < check["ratio_to_nominal"] <= 1.02
        assert any("bound / time" in t["what"] for t in result["targets"])
    assert "S = 1 MiB" in proc.stdout


@pytest.mark.tf
@pytest.mark.timeout(150)
def test_host_apply_quick_writes_every_field(tmp_path: Path) -> None:
    proc = _run("host_apply.py", tmp_path, timeout=130)
    result = json.loads((tmp_path / "host_apply.json").read_text())
    assert (tmp_path / "host_apply.png").stat().st_size > 0
    for key in ("benchmark", "environment", "settings", "copy_bandwidth", "measurements", "targets"):
        assert key in result, key
    assert result["environment"]["versions"]["tensorflow"]
    assert result["environment"]["loadavg_at_start"] and result["environment"]["loadavg_at_end"]
    assert result["settings"]["tensors"] == {"resnet50": 161, "single": 1}
    assert result["copy_bandwidth"]["bandwidth_GBps"] > 0
    cells = {(r["optimizer"], r["layout"], r["impl"]): r for r in result["measurements"]}
    assert set(cells) == {(o, l, i) for o in ("sgd", "momentum", "adam") for l in ("resnet50", "single")
                          for i in ("hostreduce", "keras")}
    for (opt, layout, impl), r in cells.items():
        assert r["time_ms"] > 0 and r["floor_ms"] > 0 and r["speedup_vs_keras"] > 0
        assert r["ratio_of_medians_to_floor"] == pytest.approx(r["time_ms"] / r["floor_ms"], rel=1e-2)
        assert r["ratio_to_floor"] > 0 and r["ratio_to_parallel_floor"] > 0  # medians of per-step ratios
        assert len(r["copy_times_ms"]) == len(r["copy_parallel_times_ms"]) == len(r["times_ms"])
        assert r["tensors"] == (161 if layout == "resnet50" else 1)
        assert r["reps"] == len(r["times_ms"]) == 6
        # Both implementations compute the same step.
        assert r["max_abs_diff_vs_other_after_one_step"] < 1e-5
        if impl == "hostreduce":
            assert r["fused"] is True
    # The floor scales with the arrays each optimizer touches (3 / 5 / 7 passes).
    f = {o: cells[(o, "single", "keras")]["floor_ms"] / {"sgd": 3, "momentum": 5, "adam": 7}[o]
         for o in ("sgd", "momentum", "adam")}
    assert max(f.values()) < 10 * min(f.values())
    assert {t["what"] for t in result["targets"]} == {"Adam, 161 tensors: hostreduce / floor",
                                                      "Adam, 161 tensors: Keras / hostreduce"}
    assert "speed-up" in proc.stdout


@pytest.mark.tf
@pytest.mark.timeout(150)
def test_host_apply_times_the_overlap_engines_numpy_update_against_the_fused_kernel(tmp_path: Path) -> None:
    _run("host_apply.py", tmp_path, 130, "--optimizers", "adam", "--layouts", "single", "--impl", "hostreduce,numpy")
    result = json.loads((tmp_path / "host_apply.json").read_text())
    rows = {r["impl"]: r for r in result["measurements"]}
    assert set(rows) == {"hostreduce", "numpy"}
    assert rows["hostreduce"]["time_over_hostreduce"] == 1.0
    assert rows["numpy"]["time_ms"] > 0 and rows["numpy"]["time_over_hostreduce"] > 0
    assert rows["numpy"]["max_abs_diff_vs_other_after_one_step"] is None  # timed, not compared
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTREDUCE_")}
    proc = subprocess.run([sys.executable, str(BENCH / "host_apply.py"), "--quick", "--impl", "numpy", "--out",
                           str(tmp_path / "refused")], cwd=str(ROOT), env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "--impl numpy models Adam alone" in proc.stderr


# Stand-ins for Horovod's two synthetic benchmark files (the benchmark runs whatever
# --horovod-src holds): they import horovod.tensorflow, all-reduce once and print the
# files' summary line, so the import alias, the launch and the parsing are exercised.
_STAND_IN = '''
import sys
import numpy as np
import horovod.tensorflow as hvd
hvd.init()
total = float(hvd.allreduce(np.array([2.0 + hvd.rank()], np.float32), op=hvd.Sum).numpy()[0])
print("Total img/sec on %d CPU(s): %.1f +-%.1f" % (hvd.size(), total, 0.5))
'''


@pytest.mark.tf
@pytest.mark.timeout(200)
def test_synthetic_runs_the_given_files_with_the_alias(tmp_path: Path) -> None:
    src = tmp_path / "horovod"
    examples = src / "examples" / "tensorflow2"
    examples.mkdir(parents=True)
    for name in ("tensorflow2_synthetic_benchmark.py", "tensorflow2_keras_synthetic_benchmark.py"):
        (examples / name).write_text(_STAND_IN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTREDUCE_")}
    proc = subprocess.run([sys.executable, str(BENCH / "synthetic.py"), "--horovod-src", str(src), "--impl", "ring",
                           "--np", "2", "--scripts", "tape", "--no-plot", "--out", str(tmp_path)], cwd=str(ROOT),
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "synthetic.json").read_text())
    assert result["runs"]["tape/2/ring"]["status"] == "ok"
    # hostreduce.horovod answered for horovod.tensorflow: the sum over both ranks (2 + 3).
    assert result["measurements"] == [{"script": "tape", "np": 2, "impl": "ring", "img_per_s": 5.0, "conf_95": 0.5,
                                       "seconds": result["runs"]["tape/2/ring"]["seconds"]}]
    bad = subprocess.run([sys.executable, str(BENCH / "synthetic.py"), "--horovod-src", str(tmp_path / "nowhere")],
                         cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--horovod-src must be a checkout of Horovod's source" in bad.stderr


@pytest.mark.timeout(120)
def test_ps_checks_quick_times_both_ps_checks_and_apply(tmp_path: Path) -> None:
    proc = _run("ps_checks.py", tmp_path, timeout=100)
    result = json.loads((tmp_path / "ps_checks.json").read_text())
    assert (tmp_path / "ps_checks.png").stat().st_size > 0
    assert result["vocab"] == 20_000 and result["reps"] == 10
    assert set(result["per_ps"]) == {"ps0", "ps1"}
    for part in result["per_ps"].values():
        assert set(part["median_ms"]) == {"check", "check_finite", "apply"}
        assert all(v > 0 for v in part["median_ms"].values())
        assert part["rows"] and sum(part["rows"].values()) > 0  # each ps holds a share of the looked-up rows
    assert "per sync step of 2 workers" in proc.stdout


@pytest.mark.timeout(240)
def test_step_profile_quick_profiles_a_fit_job_and_the_idle_cost(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTREDUCE_")}
    proc = subprocess.run([sys.executable, str(BENCH / "step_profile.py"), "--quick", "--impl", "hostreduce",
                           "--out", str(tmp_path)], cwd=str(ROOT), env=env, capture_output=True, text=True,
                          timeout=220)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "step_profile.json").read_text())
    assert (tmp_path / "step_profile.png").stat().st_size > 0
    (row,) = result["jobs"]
    assert row["impl"] == "hostreduce" and row["np"] == 2 and row["step_ms"] > 0
    kinds = row["cpu_ms_by_kind"]
    assert set(kinds) == set(result["settings"]["kinds"])
    # The Keras loop, TensorFlow's pools and the ring's threads all work in every step.
    assert kinds["Keras loop (main thread)"] > 0 and kinds["TensorFlow pools"] > 0 and kinds["engine threads"] > 0
    assert 0.5 * row["cpu_ms_per_rank"] <= sum(kinds.values()) <= 2.0 * row["cpu_ms_per_rank"]
    assert row["switches_per_step"]["voluntary"] > 0
    idle = {r["wait"]: r for r in result["idle"]}
    assert set(idle) == {"none", "sleep", "poll"}
    # A step that holds a 1 ms wait, either way, lasts at least that millisecond.
    assert idle["none"]["wait_ms"] == 0 and idle["sleep"]["wait_ms"] == idle["poll"]["wait_ms"] == 1.0
    assert all(r["step_ms"] > 0 and r["cpu_ms"] > 0 for r in idle.values())
    assert idle["sleep"]["step_ms"] >= 1.0 and idle["poll"]["step_ms"] >= 1.0
    assert "idle_cost_ms" in result and "a sleeping wait costs" in proc.stdout


@pytest.mark.timeout(240)
def test_checkpoints_quick_times_training_with_and_without_saves(tmp_path: Path) -> None:
    proc = _run("checkpoints.py", tmp_path, timeout=220)
    result = json.loads((tmp_path / "checkpoints.json").read_text())
    assert (tmp_path / "checkpoints.png").stat().st_size > 0
    assert result["settings"]["rows"] == ["none", "every2"] and result["settings"]["steps"] == 40
    rows = result["rows"]
    assert set(rows) == {"none", "every2"} and all(r["steps_per_s"] > 0 for r in rows.values())
    every2 = rows["every2"]
    # Timed from the hook of step 20, before its save: the saves of steps 20, 22, ..., 60
    # (the end of train() at step 60 saves nothing more); the chief's files are written
    # by the background thread.
    assert every2["saves"] == 21 and every2["write_in_background"] is True
    assert every2["blocking_ms_chief"] > 0 and every2["write_ms"] > 0
    assert every2["checkpoint_bytes"] > every2["input_bytes"] > 0
    assert "saves" not in rows["none"]
    assert all(r["cpu_ms_per_step"] > 0 for r in rows.values())
    assert isinstance(result["cpu_ms_per_save"]["every2"], float) and "old-every2" not in result["cpu_ms_per_save"]
    chief = next(m["ranks"][0] for m in result["measurements"] if m["row"] == "every2")
    assert {"MainThread", "hostreduce-checkpoint"} <= set(chief["cpu_ms_per_step_by_thread"])
    assert "every2" in proc.stdout and "CPU per save" in proc.stdout


@pytest.mark.tf
@pytest.mark.timeout(180)
def test_elastic_quick_times_commits_and_resets(tmp_path: Path) -> None:
    # No random trial here: tests/test_elastic.py runs the same example through kills and joins.
    _run("elastic.py", tmp_path, 160, "--trials", "0")
    result = json.loads((tmp_path / "elastic.json").read_text())
    assert (tmp_path / "elastic.png").stat().st_size > 0
    assert result["runs"]["commit/mnist"]["status"] == "ok"
    m = result["commit"]["mnist"]
    assert set(m["ranks"]) == {"0", "1"} and m["parameters"] > 0
    for r in m["ranks"].values():
        assert r["commits"] == 5 and len(r["raw_ms"]["commit"]) == 5
        assert r["commit"]["median_ms"] >= r["save"]["median_ms"] > 0 and r["check"]["median_ms"] > 0
        assert r["step_ratio"] > 0
    assert m["ranks"]["0"]["ask"]["median_ms"] > 0 and "ask" not in m["ranks"]["1"]   # rank 0 asks the launcher
    assert m["kill"]["kill_to_first_commit_ms"] > m["kill"]["rendezvous_ring_ms"] > 0
    joiners = m["grow"]["joiners"]
    assert set(joiners) == {"2", "3"}
    assert all(j["start_to_commit_at_3_ms"] > j["join_to_commit_at_3_ms"] > 0 for j in joiners.values())
    # Both joins were counted before the epoch of 3 formed: the survivor resets once for them.
    assert m["grow"]["resets_noticed_by_survivor_after_growth"] == 1
    assert m["final"] == {"size": 3, "digests_equal": True, "ranks": [0, 1, 2]}
    assert result["trials"] == []
