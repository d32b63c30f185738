"""``examples/recommender/train.py`` as a user starts it: 2 ps + 2 workers under
``hostreduce run --ps 2``, at a small table. Every task exits 0, the chief prints the
held-out metrics once, and the model learned the synthetic clicks (AUC well above
chance)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from script_jobs import ROOT, base_env, run_launcher  # noqa: E402

pytestmark = [pytest.mark.tf, pytest.mark.slow]

SCRIPT = ROOT / "examples" / "recommender" / "train.py"


@pytest.mark.timeout(180)
def test_recommender_example_on_two_ps_and_two_workers() -> None:
    worker = run_launcher(SCRIPT, ["--vocab", "8000", "--dim", "8", "--steps", "30", "--log-steps", "10",
                                   "--eval-batches", "4"], env=base_env(), timeout=150, extra=("--ps", "2"))
    out = worker.output
    assert worker.returncode == 0, out
    found = re.findall(r"held-out: loss ([0-9.]+), AUC ([0-9.]+), accuracy ([0-9.]+)", out)
    assert len(found) == 1, out
    loss, auc, accuracy = map(float, found[0])
    assert auc > 0.65, out  # chance is 0.5; 30 steps reach about 0.74
    assert 0 < loss < 0.69, out  # below the loss of a constant 0.5 prediction
    assert "trained to step 30" in out, out
