"""Checkpoints: atomic writes, pruning, and resuming after a crash."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hostreduce.estimator.checkpoint import CheckpointManager

WORKERS = Path(__file__).resolve().parent / "tf_workers"


def test_save_load_and_prune(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path), keep_checkpoint_max=2)
    for step in (1, 2, 3):
        manager.save(step, {"a/b": np.full(3, step, np.float32), "n": np.int64(step)}, {"world_size": 1})
    assert [s for s, _ in manager.checkpoints()] == [2, 3]
    step, arrays, meta = manager.load()
    assert step == 3 and meta["world_size"] == 1
    np.testing.assert_array_equal(arrays["a/b"], np.full(3, 3, np.float32))


def test_crash_mid_write_keeps_latest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = CheckpointManager(str(tmp_path))
    manager.save(4, {"w": np.ones(2)})

    def crash(*args, **kwargs):
        raise OSError("disk died")

    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(OSError):
        manager.save(8, {"w": np.zeros(2)})
    monkeypatch.undo()
    # A temporary left by a killed writer is never taken for a checkpoint.
    (tmp_path / ".tmp-ckpt-12-999-abc").mkdir()
    (tmp_path / "ckpt-000000016").mkdir()  # no meta.json: incomplete
    assert manager.latest()[0] == 4
    np.testing.assert_array_equal(manager.load()[1]["w"], np.ones(2))
    manager.save(20, {"w": np.zeros(2)})
    assert not (tmp_path / ".tmp-ckpt-12-999-abc").exists()


def test_repair_index_points_tensorflow_at_the_newest(tmp_path: Path) -> None:
    import tensorflow as tf

    manager = CheckpointManager(str(tmp_path))
    assert not manager.repair_index()  # nothing saved: nothing to name
    for step in (4, 8):
        manager.save(step, {"w": np.full(2, step, np.float32)})
    assert not manager.repair_index()
    # What a crash between ckpt-8's rename and the index's replacement leaves behind.
    tf.compat.v1.train.update_checkpoint_state(str(tmp_path), str(tmp_path / "ckpt-000000004" / "variables"))
    assert tf_latest_step(tmp_path) == 4
    assert manager.repair_index()
    assert tf_latest_step(tmp_path) == 8
    assert tf.train.get_checkpoint_state(str(tmp_path)).all_model_checkpoint_paths[-1].endswith(
        os.path.join("ckpt-000000008", "variables"))


@pytest.mark.tf
@pytest.mark.slow
@pytest.mark.parametrize("hold", [False, True], ids=["plain", "killed-mid-write"])
def test_resume_after_kill_matches_uninterrupted(tmp_path: Path, hold: bool) -> None:
    """The chief dies one step after the checkpoint of step 9 was saved. Checkpoints are
    written in the background, so that one is on disk only if its write finished before
    the kill (with ``hold`` it never does): either way every checkpoint listed is whole,
    none is partial, and the run resumed from the newest equals an uninterrupted one."""
    from tests.tf_workers import tf_common as common

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(WORKERS.parents[1]), os.environ.get("PYTHONPATH", "")]))
    env.pop("TF_CONFIG", None)
    killed = tmp_path / "killed"
    proc = subprocess.run([sys.executable, str(WORKERS / "resume_worker.py"), str(killed), "10", "16",
                           *(["9"] if hold else [])], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 17, proc.stdout + proc.stderr
    manager = CheckpointManager(str(killed))
    listed = [s for s, _ in manager.checkpoints()]
    assert listed == [3, 6] if hold else listed in ([3, 6], [3, 6, 9])
    if hold:  # the kill landed in the write of step 9: its files were never published
        assert [p.name for p in killed.iterdir() if p.name.startswith(".tmp-ckpt-9-")]
    for step, path in manager.checkpoints():  # whole: variables, step and every input position
        assert manager.load(path)[0] == step
        # Steps 6 and 9 are mid-epoch (4 batches per epoch, reshuffled every epoch): the
        # checkpoint holds the input's position, and the resumed run goes on from it.
        assert manager.load_inputs(path)[0]
    latest = listed[-1]
    # TensorFlow's index names the newest whole one, or the one before when the kill fell
    # between the newest one's rename and the index's replacement: the resumed run's
    # chief points it at the newest before it restores (checked below on a forced case).
    assert tf_latest_step(killed) in listed[-2:]
    resumed = common.train_weights(None, "adam", 16, model_dir=str(killed), save_every=3, n=64, shuffle=True)
    straight = common.train_weights(None, "adam", 16, model_dir=str(tmp_path / "straight"), save_every=3, n=64,
                                    shuffle=True)
    assert int(resumed.pop("__steps_run__")) == 16 - latest and int(straight.pop("__steps_run__")) == 16
    assert sorted(resumed) == sorted(straight)
    assert int(resumed["adam/iteration"]) == 16
    for key in straight:
        np.testing.assert_allclose(resumed[key], straight[key], rtol=1e-6, atol=1e-7, err_msg=key)
    assert CheckpointManager(str(killed)).latest()[0] == 16


def tf_latest_step(model_dir: Path) -> int:
    import tensorflow as tf

    from hostreduce.estimator.checkpoint import GLOBAL_STEP

    return int(tf.train.load_checkpoint(str(model_dir)).get_tensor(GLOBAL_STEP))
