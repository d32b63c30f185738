"""``examples/recommender/train.py`` (the Estimator) and ``train_keras.py`` (Keras
``fit``) as a user starts them: 2 ps + 2 workers under ``hostreduce run --ps 2``, at a
small table. Every task exits 0, the chief prints the held-out metrics once, and the
model learned the synthetic clicks (AUC well above chance)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.script_jobs import ROOT, base_env, run_launcher

pytestmark = [pytest.mark.tf, pytest.mark.slow]

SCRIPT = ROOT / "examples" / "recommender" / "train.py"


def _run_and_check_learned(script: Path, args: list[str]) -> str:
    """Run ``script`` on 2 ps + 2 workers under the launcher; its output, once every task
    exited 0 and the chief printed held-out metrics once, well above chance."""
    worker = run_launcher(script, ["--vocab", "8000", "--dim", "8", "--steps", "30", "--eval-batches", "4", *args],
                          env=base_env(), timeout=150, extra=("--ps", "2"))
    out = worker.output
    assert worker.returncode == 0, out
    found = re.findall(r"held-out: loss ([0-9.]+), AUC ([0-9.]+), accuracy ([0-9.]+)", out)
    assert len(found) == 1, out
    loss, auc, _ = map(float, found[0])
    assert auc > 0.65, out  # chance is 0.5; 30 steps reach about 0.74
    assert 0 < loss < 0.69, out  # below the loss of a constant 0.5 prediction
    return out


@pytest.mark.timeout(180)
def test_recommender_example_on_two_ps_and_two_workers() -> None:
    out = _run_and_check_learned(SCRIPT, ["--log-steps", "10"])
    assert "trained to step 30" in out, out


@pytest.mark.timeout(180)
def test_recommender_keras_fit_on_two_ps_and_two_workers() -> None:
    # shard_bytes 200 kB: the deep table (256 kB) is split by rows, so each worker holds
    # a row cache of it; the wide table and the dense layers stay whole.
    out = _run_and_check_learned(ROOT / "examples" / "recommender" / "train_keras.py", ["--shard-bytes", "200000"])
    assert not re.search(r"\[ps\d\] worker \d+ holds", out), out  # the ps served at keras_optimizer, no further
    for rank in (0, 1):
        held = re.search(rf"worker {rank} holds deep_embedding/embeddings: (\d+) of 8000 rows", out)
        assert held and int(held.group(1)) <= 512 * 8 + 1, out
