"""The all-reduce benchmark's smoke mode runs end to end and writes a complete result."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "allreduce.py"
IMPLS = ("ring-grpc", "ring-shm", "mpi", "tf-ring", "grpc-floor")

pytestmark = [pytest.mark.mpi, pytest.mark.tf]


@pytest.mark.timeout(120)
def test_allreduce_quick_writes_every_field(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTREDUCE_")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--impl", ",".join(IMPLS), "--out", str(tmp_path)],
        cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=90,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "allreduce.json").read_text())
    assert (tmp_path / "allreduce.png").stat().st_size > 0

    for key in ("benchmark", "environment", "settings", "implementations", "measurements", "ratios",
                "latency_1KiB_ms", "targets", "grpc_floor"):
        assert key in result, key
    env_rec = result["environment"]
    for key in ("cpu_count", "date", "command_line", "versions", "python"):
        assert env_rec[key], key
    assert env_rec["versions"]["tensorflow"] and env_rec["versions"]["mpi4py"]
    assert result["settings"]["np"] == [2] and result["settings"]["sizes"] == [1024, 1 << 20]

    for impl in IMPLS:
        run = result["implementations"][impl]["runs"]["2"]
        assert run["status"] == "ok", (impl, run)
        rows = [m for m in result["measurements"] if m["impl"] == impl]
        assert [m["bytes"] for m in rows] == [1024, 1 << 20], impl
        for m in rows:
            assert m["np"] == 2 and m["correct"], (impl, m)
            assert m["time_ms"] > 0 and m["busbw_GBps"] > 0
            assert m["busbw_GBps"] == pytest.approx(m["algbw_GBps"], rel=1e-3)  # 2(N-1)/N = 1 at N=2
            assert set(m["rank_times_ms"]) == {"0", "1"}
            assert all(len(t) == m["reps"] == 2 for t in m["rank_times_ms"].values())
            assert m["time_ms"] == pytest.approx(max(m["rank_median_ms"].values()), rel=1e-3)

    pairs = {(q["ring"], q["peer"], q["bytes"]) for q in result["ratios"]}
    assert pairs == {(r, p, s) for r in ("ring-grpc", "ring-shm") for p in ("mpi", "tf-ring")
                     for s in (1024, 1 << 20)}
    assert set(result["latency_1KiB_ms"]) == {f"{i} N=2" for i in IMPLS}
    assert "N = 2" in proc.stdout and "ring-shm / mpi" in proc.stdout
    floor = {q["bytes"]: q for q in result["grpc_floor"]}
    assert set(floor) == {1 << 20}  # reported from 1 MiB, where the ratio to TF is held to a goal
    for q in floor.values():
        assert q["tf_over_floor"] > 0 and q["floor_over_ring_grpc"] > 0
    assert "grpcio floor" in proc.stdout
