"""With parameter servers a worker never holds a whole copy of an embedding table the
ps shard by rows: 2 ps + 2 workers train a 1M x 64 float32 table (256 MiB) with Adam,
and each worker's resident memory stays far below one table, while it trains and while
it evaluates afterwards, as each ps holds its half of the table and its Adam slots."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.script_jobs import base_env, run_ps_by_hand

pytestmark = [pytest.mark.tf, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parent / "ps_scripts" / "memory_ps.py"
ROWS, DIM = 1_000_000, 64
TABLE = ROWS * DIM * 4
MIB = 1 << 20


@pytest.mark.timeout(300)
def test_workers_hold_no_full_copy_of_a_sharded_table(tmp_path: Path) -> None:
    tasks = run_ps_by_hand(SCRIPT, ["--rows", str(ROWS), "--dim", str(DIM), "--out", str(tmp_path)], timeout=240,
                           env=base_env(HOSTREDUCE_TIMEOUT_S="60"))
    output = "\n".join(f"--- {name} ---\n{w.output[-3000:]}" for name, w in tasks.items())
    assert {name: w.returncode for name, w in tasks.items()} == dict.fromkeys(tasks, 0), output
    seen = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("chief0", "worker0", "ps0", "ps1")}
    report = {name: {k: (v // MIB if k != "samples" else v) for k, v in m.items()} for name, m in seen.items()}
    print("resident memory in MiB:", report)
    bound = TABLE // 4
    for name in ("chief0", "worker0"):
        m = seen[name]
        assert m["samples"] > 10, report  # sampled while it trained and evaluated
        assert m["training"] - m["baseline"] < bound, (name, report)
    # The chief computes the table's initial value once, to register it on the ps;
    # the other worker never does, so its peak is honest for the whole run.
    assert seen["worker0"]["hwm"] - seen["worker0"]["baseline"] < bound, report
    for name in ("ps0", "ps1"):  # half the table's rows, and Adam's two slots for them
        assert seen[name]["last"] - seen[name]["baseline"] > 0.9 * 3 * TABLE // 2, (name, report)
