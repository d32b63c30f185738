"""``hostreduce.ParameterServerStrategy`` under the Estimator, every task its own
process started by hand with ``TF_CONFIG`` (the same script on ps and workers): sync
training of a dense layer and an embedding on 2 ps + 2 workers equals one process
training on the global batch (SGD; Adam through a resumed job, whose second half also
needs the ps's slots back from the checkpoint), so does evaluating afterwards, and every
process ends with status 0."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests.ps_helpers import max_rel
from tests.script_jobs import base_env, run_ps_by_hand, run_reference

pytestmark = [pytest.mark.tf, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parent / "ps_scripts" / "estimator_ps.py"
PS_SCRIPT = Path(__file__).resolve().parent / "ps_scripts" / "serve_ps.py"  # a ps without TensorFlow
STEPS = "6"


@pytest.mark.timeout(300)
def test_sync_ps_training_equals_global_batch_training(tmp_path: Path) -> None:
    optimizer = "sgd"  # Adam: the resumed job below
    args = ["--out", str(tmp_path), "--optimizer", optimizer, "--steps", STEPS, "--model-dir", str(tmp_path / "m"),
            "--evaluate", "--train-and-evaluate"]
    tasks = run_ps_by_hand(SCRIPT, args, timeout=200, env=base_env(HOSTREDUCE_TIMEOUT_S="30"), evaluator=True)
    output = "\n".join(f"--- {name} ---\n{w.output}" for name, w in tasks.items())
    assert {name: w.returncode for name, w in tasks.items()} == dict.fromkeys(tasks, 0), output
    reference = run_reference(SCRIPT, ["--reference", "--out", str(tmp_path), "--optimizer", optimizer,
                                       "--steps", STEPS, "--evaluate"], timeout=120)
    assert reference.returncode == 0, reference.stderr[-3000:]
    # evaluation after training reads the ps's table (the workers hold only rows of it)
    want = re.search(r"EVAL rank 0: loss (\S+) mse (\S+)", reference.stdout)
    assert want is not None, reference.stdout[-2000:]
    # the evaluator task evaluated the final checkpoint, reading the table from the ps shards
    evaluator = re.search(rf"EVALUATOR step {STEPS}: loss (\S+) mse (\S+)", tasks["evaluator"].output)
    for name, rank in (("chief", 0), ("worker1", 1), ("evaluator", None)):
        got = evaluator if rank is None else re.search(rf"EVAL rank {rank}: loss (\S+) mse (\S+)", tasks[name].output)
        assert got is not None, output
        for g, w in zip(got.groups(), want.groups()):
            assert abs(float(g) - float(w)) <= 1e-5 * abs(float(w)), (name, got.groups(), want.groups())
    ref = np.load(tmp_path / "ref.npz")  # also holds the reference's optimizer slots
    for rank in (0, 1):
        got = np.load(tmp_path / f"{rank}.npz")
        assert sorted(got.files) == ["emb/embeddings", "out/bias", "out/kernel"]
        for name in got.files:
            assert max_rel(got[name], ref[name]) <= 1e-5, (rank, name, max_rel(got[name], ref[name]))
    for name in ("chief", "worker1"):  # the embedding's rows of each batch, not the whole table
        assert "('PullRows', " in tasks[name].output, output
    # the chief's checkpoint holds the ps's values, and the ps shards (slots too) beside it
    from hostreduce.ps import checkpoint

    index = checkpoint.read_index(str(tmp_path / "m" / "ps"))
    assert index is not None and index["step"] == int(STEPS), output
    assert index["optimizer"]["name"] == optimizer
    # one process without ps restoring that checkpoint finds the table in the ps shards
    restored = tmp_path / "restored"
    restored.mkdir()
    again = run_reference(SCRIPT, ["--reference", "--out", str(restored), "--steps", STEPS,
                                   "--model-dir", str(tmp_path / "m")], timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    got, want = np.load(restored / "ref.npz"), np.load(tmp_path / "0.npz")
    for name in want.files:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.timeout(400)
def test_a_resumed_job_restores_the_ps_shards_with_the_checkpoint(tmp_path: Path) -> None:
    """3 steps, then a new job on the same model_dir to step 6, equals 6 steps at once
    (Adam: the ps's slots and step count come back with the chief's checkpoint). The ps
    tasks serve without TensorFlow (the test above runs the script on them)."""
    model_dir = str(tmp_path / "m")
    for steps in ("3", "6"):
        args = ["--out", str(tmp_path), "--optimizer", "adam", "--steps", steps, "--model-dir", model_dir]
        tasks = run_ps_by_hand(SCRIPT, args, timeout=200, env=base_env(HOSTREDUCE_TIMEOUT_S="30"), ps_script=PS_SCRIPT)
        output = "\n".join(f"--- {name} ---\n{w.output}" for name, w in tasks.items())
        assert {name: w.returncode for name, w in tasks.items()} == dict.fromkeys(tasks, 0), output
        assert f"DONE rank 0: step {steps}" in tasks["chief"].output, output
        for name in ("chief", "worker1"):  # the embedding's rows of each batch, not the whole table
            assert "('PullRows', " in tasks[name].output, output
    reference = run_reference(SCRIPT, ["--reference", "--out", str(tmp_path), "--optimizer", "adam", "--steps", "6"],
                              timeout=120)
    assert reference.returncode == 0, reference.stderr[-3000:]
    ref = np.load(tmp_path / "ref.npz")
    for rank in (0, 1):
        got = np.load(tmp_path / f"{rank}.npz")
        assert sorted(got.files) == ["emb/embeddings", "out/bias", "out/kernel"]
        for name in got.files:
            assert max_rel(got[name], ref[name]) <= 1e-5, (rank, name, max_rel(got[name], ref[name]))
    from hostreduce.ps import checkpoint

    index = checkpoint.read_index(str(tmp_path / "m" / "ps"))
    assert index is not None and index["step"] == 6 and index["optimizer"]["name"] == "adam"


@pytest.mark.timeout(500)
def test_async_checkpoints_of_a_restarted_job_hold_the_ps_shards_values(tmp_path: Path) -> None:
    """An async job saving every 2 steps, then restarted on the same model_dir: in every
    checkpoint the chief's variables equal the ps shard of the same step bit for bit (the
    chief pulls them in the same pause of the applies as the shards' snapshot), and each
    variable has been applied as often as every other (one consistent point)."""
    from hostreduce.estimator.checkpoint import CheckpointManager
    from hostreduce.ps import Placement, checkpoint

    model_dir = tmp_path / "m"
    for steps in ("10", "20"):
        args = ["--out", str(tmp_path), "--async", "--steps", steps, "--save-steps", "2", "--keep", "20",
                "--model-dir", str(model_dir)]
        tasks = run_ps_by_hand(SCRIPT, args, timeout=240, env=base_env(HOSTREDUCE_TIMEOUT_S="30"))
        output = "\n".join(f"--- {name} ---\n{w.output[-3000:]}" for name, w in tasks.items())
        assert {name: w.returncode for name, w in tasks.items()} == dict.fromkeys(tasks, 0), output
    ps_dir = str(model_dir / "ps")
    placement = Placement.from_json(checkpoint.read_index(ps_dir)["placement"])
    manager = CheckpointManager(str(model_dir), keep_checkpoint_max=20)
    checked = 0
    for step, path in manager.checkpoints():
        _, arrays, _ = manager.load(path)
        paths = [checkpoint.shard_path(ps_dir, step, m, placement.num_ps) for m in range(placement.num_ps)]
        if not all(Path(p).exists() for p in paths):
            continue  # pruned (keep) or the step the job started from
        shards = [dict(np.load(p)) for p in paths]
        counts = set()
        for name in ("out/kernel", "out/bias"):
            held = shards[placement[name].ps]
            assert arrays[name].tobytes() == held[name].tobytes(), (step, name)
            counts.add(int(held[f"{name}/@iterations"]))
        assert len(counts) == 1, (step, counts)
        checked += 1
    assert checked >= 4, manager.checkpoints()
