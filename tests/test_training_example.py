"""The MNIST example end to end: two workers over the ring reach >= 0.95 test accuracy
on scikit-learn's digits, and a restart resumes every worker from the chief's
checkpoint."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.tf, pytest.mark.slow]


def _run(*args: str, workers: int = 2) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TF_CONFIG", None)
    cmd = [sys.executable, "-m", "hostreduce", "run", "-np", str(workers), "--",
           sys.executable, str(ROOT / "examples" / "mnist" / "train.py"), *args]
    proc = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def _accuracy(out: str) -> float:
    found = re.findall(r"test accuracy: ([0-9.]+)", out)
    assert len(found) == 1, out  # printed by rank 0 only
    return float(found[0])


def _steps_with_the_first_handoff_in_backward(timeline: Path) -> float:
    """The fraction of steps whose backward span is non-empty and holds the step's first
    gradient hand-off (the forward/backward boundary is where the loss is ready)."""
    events = [e for e in json.loads(timeline.read_text())["traceEvents"] if e.get("ph") == "X"]
    backward = sorted((e for e in events if e["name"] == "backward"), key=lambda e: e["ts"])
    handoffs = sorted(e["ts"] for e in events if e["cat"] == "handoff")
    per_step = len(handoffs) // len(backward)
    good = sum(1 for k, span in enumerate(backward)
               if span["dur"] > 0 and span["ts"] <= handoffs[k * per_step] <= span["ts"] + span["dur"])
    return good / len(backward)


def test_two_workers_reach_accuracy_and_resume(tmp_path: Path) -> None:
    model_dir, timeline = tmp_path / "model", tmp_path / "timeline"
    out = _run("--model-dir", str(model_dir), "--timeline-dir", str(timeline))
    assert "scikit-learn" in out and "step 50: loss" in out
    first = _accuracy(out)
    assert first >= 0.95, out
    assert sorted(p.name for p in timeline.iterdir()) == ["timeline-rank0.json", "timeline-rank1.json"]
    for trace in timeline.iterdir():
        assert _steps_with_the_first_handoff_in_backward(trace) >= 0.95, trace.name
    assert [p.name for p in model_dir.iterdir() if p.name.startswith("ckpt-")] == ["ckpt-000000179"]
    # Restarting finds training complete: both workers restore the chief's weights, so
    # the evaluation (each worker scores its half of the test set) is unchanged.
    again = _run("--model-dir", str(model_dir))
    assert "step 50: loss" not in again
    assert "trained 0 steps" in again and "resumed at step 179" in again, again
    assert _accuracy(again) == first


def test_any_number_of_workers_trains_with_the_default_batch() -> None:
    out = _run("--epochs", "1", workers=3)
    assert "using a global batch of 63 (21 per worker)" in out, out
    assert "trained 22 steps" in out, out
    assert _accuracy(out) > 0.5


@pytest.mark.parametrize("workers", [1, 2])
def test_the_examples_input_position_is_small_and_resumes_the_same_batches(workers: int) -> None:
    """The example's training input (index shuffle, symbolic checkpointing): the
    position a checkpoint saves is its counters, not the prefetched batches, and an
    iterator restored from it yields exactly the batches the saved one went on to."""
    import importlib.util

    import tensorflow as tf

    from hostreduce.estimator.input_state import restore_iterator, save_iterator

    spec = importlib.util.spec_from_file_location("mnist_example_train", ROOT / "examples" / "mnist" / "train.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    x = np.arange(50 * 4, dtype=np.float32).reshape(50, 4)
    y = np.arange(50, dtype=np.int64)
    context = tf.distribute.InputContext(num_input_pipelines=workers, input_pipeline_id=workers - 1,
                                         num_replicas_in_sync=workers)
    dataset = example.make_input_fn(x, y, 8, True, 0)("train", context)
    assert dataset.options().experimental_symbolic_checkpoint
    iterator = iter(dataset)
    for _ in range(9):  # past the first epoch of the shard
        next(iterator)
    position = save_iterator(iterator)
    assert sum(len(v) for v in position.values()) < 1024, {k: len(v) for k, v in position.items()}
    after = [next(iterator)[1].numpy().tolist() for _ in range(6)]
    restored = iter(dataset)
    restore_iterator(restored, position)
    assert [next(restored)[1].numpy().tolist() for _ in range(6)] == after
    assert len({tuple(b) for b in after}) == 6  # not the same batch over and over
