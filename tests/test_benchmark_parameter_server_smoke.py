"""The parameter-server benchmark's smoke mode runs hostreduce's sync ps and TensorFlow's
ParameterServerStrategy end to end on tiny tables and writes a complete result."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "parameter_server.py"

pytestmark = [pytest.mark.tf, pytest.mark.slow]


@pytest.mark.timeout(240)
def test_parameter_server_quick_writes_every_field(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTREDUCE_")}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--modes", "sync,tf", "--steps", "4",
                           "--out", str(tmp_path)], cwd=str(ROOT), env=env, capture_output=True, text=True,
                          timeout=220)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "parameter_server.json").read_text())
    assert (tmp_path / "parameter_server.png").stat().st_size > 0
    for key in ("benchmark", "environment", "settings", "runs", "measurements", "ratios", "targets"):
        assert key in result, key
    settings = result["settings"]
    assert settings["steps"] == 4 and settings["batch"] == 512 and settings["vocab"] == 20_000
    assert settings["table_bytes"] == 20_000 * (settings["dim"] + 1) * 4
    rows = {r["mode"]: r for r in result["measurements"]}
    assert set(rows) == {"sync", "tf"} and all(run["status"] == "ok" for run in result["runs"].values())
    for mode, row in rows.items():
        assert row["examples_per_s"] > 0 and row["step_ms"] > 0
        assert row["steps_timed"] == 4 * settings["workers"]
        assert row["socket_bytes_per_step"] > 0, mode
        # every process of the job was sampled: 2 ps + 2 workers (+ TF's coordinator)
        assert len(row["peak_rss_mb"]) == 4 + (mode == "tf"), row["peak_rss_mb"]
        assert row["loss_first_last"][1] < row["loss_first_last"][0] + 0.2  # training, not diverging
    sync = rows["sync"]
    # The ps client's own counters: per step one PullRows and one Push per ps, sent and answered.
    methods = sync["client_bytes_per_step_by_method"]
    assert {"PullRows sent", "PullRows received", "Push sent", "PullDense received"} <= set(methods)
    assert sync["client_bytes_per_step"] == pytest.approx(sum(methods.values()), abs=len(methods))
    # The sockets carry what the client packed, plus gRPC's framing (under 10% here).
    assert sync["client_bytes_per_step"] <= sync["socket_bytes_per_step"] <= 1.1 * sync["client_bytes_per_step"]
    # The rows pulled at batch 512 x 8 lookups: at most the batch's distinct ids of both tables.
    dim = settings["dim"]
    assert 0 < methods["PullRows received"] <= 512 * 8 * (dim + 1) * 4 * 1.05
    assert rows["tf"]["placement"]["tables"][0] == ["/job:ps/replica:0/task:0/device:CPU:0",
                                                    "/job:ps/replica:0/task:1/device:CPU:0"]
    whats = {r["what"] for r in result["ratios"]}
    assert {"sync / tf examples/s", "sync / tf bytes per step (sockets)"} <= whats
    ratio = next(r["value"] for r in result["ratios"] if r["what"] == "sync / tf examples/s")
    assert ratio == pytest.approx(sync["examples_per_s"] / rows["tf"]["examples_per_s"], rel=1e-2)
    assert any("sync / tf" in t["what"] for t in result["targets"])
    assert "sync / tf examples/s" in proc.stdout
