"""The overlap and end-to-end training benchmarks' smoke modes run end to end and write complete results."""
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

pytestmark = pytest.mark.tf


def _run(script: str, out: Path, timeout: float, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTREDUCE_")}
    proc = subprocess.run([sys.executable, str(BENCH / script), "--quick", "--out", str(out), *extra], cwd=str(ROOT),
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.timeout(200)
def test_overlap_quick_writes_every_field(tmp_path: Path) -> None:
    # Two timed steps per schedule (not three): the median, the spans and the timeline step
    # are all still taken from more than one step. One network: the simulated 1 Gbit/s
    # cluster where this machine can make one (it is what the targets are about), else
    # loopback.
    usable = NC.netns_usable()[0]
    networks = ["1gbit"] if usable else ["loopback"]
    proc = _run("overlap.py", tmp_path, 180, "--steps", "2", "--networks", networks[0])
    result = json.loads((tmp_path / "overlap.json").read_text())
    for key in ("benchmark", "environment", "settings", "runs", "measurements", "targets"):
        assert key in result, key
    env = result["environment"]
    assert env["loadavg_at_start"] and env["loadavg_at_end"] and env["versions"]["tensorflow"]
    assert result["settings"]["networks"] == networks and result["settings"]["np"] == [2]
    assert result["settings"]["model"]["dense_layers"] >= 8
    rows = {r["network"]: r for r in result["measurements"]}
    assert set(rows) == set(networks)
    for network, row in rows.items():
        assert result["runs"][network]["2"]["status"] == "ok"
        assert row["gradient_bytes"] >= 16 << 20 and row["gradient_tensors"] >= 16
        for mode in ("sequential", "apply-once", "streamed"):
            m = row[mode]
            assert m["step_ms"] > 0 and m["forward_ms"] > 0 and m["backward_ms"] > 0
            # Per-gradient apply has no separate apply phase: its updates run inside the wait.
            assert (m["reduce_wait_ms"] if mode == "streamed" else m["apply_ms"]) > 0
            assert set(m["rank_step_ms"]) == {"0", "1"}
        assert row["apply_once_over_streamed"] == pytest.approx(
            row["apply-once"]["step_ms"] / row["streamed"]["step_ms"], rel=1e-3)
        assert row["reduction_ms"] > 0 and row["compute_ms"] > 0
        t_seq, t_str = row["sequential"]["step_ms"], row["streamed"]["step_ms"]
        assert row["hidden_fraction"] == pytest.approx(   # (times rounded to the microsecond)
            (t_seq - t_str) / row["reduction_ms"], abs=1.5e-3 / row["reduction_ms"] + 2e-3)
        assert row["streamed_over_bound"] == pytest.approx(
            t_str / max(row["compute_ms"], row["reduction_ms"]), rel=1e-2)
        assert row["loadavg_before"] and row["loadavg_after"]
        # One step of each schedule per rank, with every kind of span, for the timeline plot.
        tl = result["runs"][network]["2"]["timeline"]
        for mode in ("sequential", "apply-once", "streamed"):
            kinds = {s["row"] for s in tl[mode]["ranks"]["0"]}
            assert {"compute", "hand-off", "reduce", "apply"} <= kinds, kinds
        for r in ("0", "1"):
            # RunConfig(stream_gradients=False) starts no reduction before the backward pass ends;
            # the default starts some while it runs.
            spans = {mode: tl[mode]["ranks"][r] for mode in ("sequential", "streamed")}
            bwd_end = {mode: max(s["start_ms"] + s["dur_ms"] for s in sp if s["name"] == "backward")
                       for mode, sp in spans.items()}
            seq_starts = [s["start_ms"] for s in spans["sequential"] if s["row"] == "reduce"]
            str_starts = [s["start_ms"] for s in spans["streamed"] if s["row"] == "reduce"]
            assert min(seq_starts) >= bwd_end["sequential"] - 0.5
            assert min(str_starts) < bwd_end["streamed"]
        assert (tmp_path / f"overlap.timeline.{network}-np2.png").stat().st_size > 0
    if usable:
        assert rows["1gbit"]["transport"] == "tcp" and rows["1gbit"]["link_rate_bps"] == 1e9
        assert {t["what"] for t in result["targets"]} == {
            "1gbit N=2: hidden fraction", "1gbit N=2: T_streamed / max(T_compute, T_reduction)"}
    assert (tmp_path / "overlap.png").stat().st_size > 0
    assert (tmp_path / "overlap.timeline.png").stat().st_size > 0
    assert "hidden" in proc.stdout


@pytest.fixture(scope="module")
def end_to_end(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, Path]:
    """One quick run of the end-to-end benchmark for both tests below: the Estimator rows
    (ring, tf) and the model.fit rows (keras-ring, keras-tf), on both models. The large
    model's hidden layers narrowed (1792 -> 128, still 8 of them): the smoke run checks
    the pipeline and the results file, not the throughput of 26M parameters."""
    out = tmp_path_factory.mktemp("e2e")
    proc = _run("end_to_end.py", out, 260, "--impl", "ring,tf,keras-ring,keras-scope,keras-tf", "--large-hidden",
                "128")
    return json.loads((out / "end_to_end.json").read_text()), proc.stdout, out


@pytest.mark.timeout(300)
def test_end_to_end_quick_writes_every_field(end_to_end: tuple) -> None:
    result, stdout, out = end_to_end
    for key in ("benchmark", "environment", "settings", "runs", "baselines", "measurements", "ratios", "targets"):
        assert key in result, key
    env = result["environment"]
    assert env["loadavg_at_start"] and env["loadavg_at_end"] and env["versions"]["tensorflow"]
    assert result["settings"]["impls"] == ["ring", "tf", "keras-ring", "keras-scope", "keras-tf"]
    assert result["settings"]["np"] == [2]
    assert result["settings"]["models"] == ["mnist", "large"] and result["settings"]["plan"]["large_hidden"] == 128
    batches = result["settings"]["plan"]["batch"]["loopback"]
    for path in ("estimator", "keras"):
        for model in ("mnist", "large"):
            assert result["baselines"][f"{model}@{batches[model]}"][path]["1"] > 0
    cells = {(r["impl"], r["model"]): r for r in result["measurements"] if r["impl"] in ("ring", "tf")}
    assert set(cells) == {(i, m) for i in ("ring", "tf") for m in ("mnist", "large")}
    for (impl, model), r in cells.items():
        assert r["network"] == "loopback" and r["np"] == 2
        assert r["per_worker_batch"] == batches[model] and r["global_batch"] == 2 * r["per_worker_batch"]
        assert r["examples_per_s"] == pytest.approx(r["global_batch"] / (r["step_ms"] / 1e3), rel=1e-2)
        assert 0 < r["efficiency"] and set(r["rank_step_ms"]) == {"0", "1"}
        assert result["runs"]["loopback"][impl]["2"]["status"] == "ok"
    ratios = {(r["model"], r["what"]) for r in result["ratios"]}
    assert {("mnist", "ring / tf"), ("large", "ring / tf")} <= ratios
    assert any("ring / tf" in t["what"] for t in result["targets"])
    assert (out / "end_to_end.png").stat().st_size > 0
    assert "examples/s" in stdout


@pytest.mark.timeout(300)
def test_end_to_end_quick_keras_fit_rows(end_to_end: tuple) -> None:
    """model.fit under hostreduce's ring (Horovod-style wrapper, and in the strategy's
    scope) and under MultiWorkerMirroredStrategy (Keras 3, or tf_keras where Keras 3's fit
    fails under it): rows, baselines, the ratios, and equal weights on every rank (the
    gradients were reduced)."""
    result, stdout, _ = end_to_end
    paths = result["settings"]["plan"]["paths"]
    assert "fit" in paths and "fit-tf_keras" in paths
    batch = result["settings"]["plan"]["batch"]["loopback"]["mnist"]
    rows = {r["impl"]: r for r in result["measurements"]
            if r["impl"] in ("keras-ring", "keras-scope", "keras-tf") and r["model"] == "mnist"}
    assert set(rows) == {"keras-ring", "keras-scope", "keras-tf"}
    assert rows["keras-scope"]["path"] == "fit" and rows["keras-scope"]["keras"].startswith("keras 3")
    assert rows["keras-ring"]["path"] == "fit" and rows["keras-ring"]["keras"].startswith("keras 3")
    tf_row = rows["keras-tf"]
    # tf_keras only where Keras 3 failed, and then the failure is recorded.
    assert (tf_row["path"] == "fit-tf_keras") == ("keras3_error" in tf_row)
    assert tf_row["keras"].startswith("tf_keras" if tf_row["path"] == "fit-tf_keras" else "keras 3")
    for impl, r in rows.items():
        assert result["runs"]["loopback"][impl]["2"]["status"] == "ok"
        assert r["np"] == 2 and r["per_worker_batch"] == batch
        assert r["examples_per_s"] == pytest.approx(r["global_batch"] / (r["step_ms"] / 1e3), rel=1e-2)
        assert set(r["rank_step_ms"]) == {"0", "1"}
        assert len(r["rank_step_ms"]["0"]) == result["settings"]["plan"]["steps"]["mnist"]
        assert r["weights_agree"] is True
        assert result["baselines"][f"mnist@{batch}"][r["path"]]["1"] > 0 and r["efficiency"] > 0
    (ratio,) = [x for x in result["ratios"] if x["what"].startswith("keras-ring / keras-tf") and x["model"] == "mnist"]
    assert ratio["value"] == pytest.approx(rows["keras-ring"]["examples_per_s"] / tf_row["examples_per_s"], rel=1e-2)
    assert "keras-ring / keras-tf" in stdout
    assert {"keras-scope / keras-ring", "keras-scope / keras-tf"} <= {
        x["what"].split(" (")[0] for x in result["ratios"] if x["model"] == "mnist"}
