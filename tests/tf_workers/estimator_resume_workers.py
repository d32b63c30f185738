"""Entry points for the Estimator checkpoint tests (run by ``run_ranks``): a run stopped
halfway and resumed in a new Estimator against one that never stopped, on shuffled,
repeated, sharded data."""
from __future__ import annotations

import os
import shutil
from typing import Any

import numpy as np

from tests.tf_workers import tf_common as common

EXAMPLES = 96  # 6 global batches of 16 per epoch: the halfway point falls mid-epoch


def shuffled_input_fn(mode: str, input_context: Any = None) -> Any:
    """Each worker's shard, shuffled with a fixed seed and reshuffled every epoch."""
    import tensorflow as tf

    x, y = common.dataset_arrays(EXAMPLES)
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    batch = common.GLOBAL_BATCH
    if input_context is not None and input_context.num_input_pipelines > 1:
        ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        batch = input_context.get_per_replica_batch_size(common.GLOBAL_BATCH)
    return ds.shuffle(32, seed=7).batch(batch, drop_remainder=True).repeat()


def _train(model_dir: str, max_steps: int, **config: Any) -> dict[str, np.ndarray]:
    import keras

    from hostreduce.estimator import Estimator, RunConfig
    from hostreduce.strategies import MultiWorkerStrategy

    keras.utils.set_random_seed(1234)
    run_config = RunConfig(train_distribute=MultiWorkerStrategy(), model_dir=model_dir, log_step_count_steps=None,
                           save_summary_steps=None, **config)
    est = Estimator(common.mlp_model_fn, config=run_config, params={"optimizer": "adam"})
    est.train(shuffled_input_fn, max_steps=max_steps)
    weights = est.get_variables()
    weights["__global_step__"] = np.array(est.global_step)
    est.close()
    return weights


def resume_rank(rank: int, world_size: int, root: str, steps: int) -> dict[str, Any]:
    """Train ``steps`` straight; train ``steps // 2``, then resume to ``steps`` in a new
    Estimator; and the same resume from a copy whose input positions were removed."""
    from hostreduce.estimator.checkpoint import CheckpointManager

    half = steps // 2
    straight = _train(os.path.join(root, f"straight-{rank}"), steps)
    stopped = os.path.join(root, "stopped")  # the chief's model_dir; other workers have none
    # The chief saves every step (save_checkpoints_secs: its clock decides for all) and
    # keeps two checkpoints.
    _train(stopped if rank == 0 else None, half, save_checkpoints_secs=1e-6, keep_checkpoint_max=2)
    kept = [s for s, _ in CheckpointManager(stopped).checkpoints()] if rank == 0 else None
    control = os.path.join(root, "control")
    if rank == 0:
        shutil.copytree(stopped, control)
        for name in os.listdir(os.path.join(control, f"ckpt-{half:09d}")):
            if name.startswith("input-"):
                os.remove(os.path.join(control, f"ckpt-{half:09d}", name))
    resumed = _train(stopped if rank == 0 else None, steps)
    without_input = _train(control if rank == 0 else None, steps)
    return {"straight": straight, "resumed": resumed, "without_input": without_input, "kept": kept}


def late_chief_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Rank 1 saves first and goes on; the chief reaches the same save only once rank 1's
    save has returned (a file tells it), so a save that waited for the gather of input
    positions would never return."""
    import time

    import tensorflow as tf

    from hostreduce.estimator.checkpoint import CheckpointManager
    from hostreduce.estimator.checkpointing import Checkpointing
    from hostreduce.strategies import MultiWorkerStrategy

    strategy = MultiWorkerStrategy()
    model_dir, signal = os.path.join(root, "model_dir"), os.path.join(root, "rank1-saved")
    ckpt = Checkpointing(strategy, CheckpointManager(model_dir) if rank == 0 else None, 1, None)
    ckpt.policy()
    dataset = tf.data.Dataset.range(100).shuffle(10, seed=rank).batch(2)
    iterator = ckpt.iterator = iter(dataset)
    taken = [next(iterator).numpy().tolist() for _ in range(3)]
    if rank == 1:
        ckpt.save(3, dict)
        with open(signal, "w"):
            pass
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(signal):
            assert time.monotonic() < deadline, "rank 1's save did not return before the chief's"
            time.sleep(0.01)
        ckpt.save(3, lambda: {"w": np.arange(3.0)})
    ckpt.flush()
    after = next(iterator).numpy().tolist()
    resume = Checkpointing(strategy, CheckpointManager(model_dir) if rank == 0 else None, None, None)
    resume.policy()
    resumed = next(resume.restore_input(dataset, iter(dataset), 3)).numpy().tolist()
    if rank != 0:
        return {"taken": taken, "after": after, "resumed": resumed}
    manager = CheckpointManager(model_dir)
    step, arrays, meta = manager.load()
    return {"taken": taken, "after": after, "resumed": resumed, "step": step, "w": arrays["w"].tolist(), "meta": meta,
            "inputs": sorted(manager.load_inputs(manager.find(3)))}
