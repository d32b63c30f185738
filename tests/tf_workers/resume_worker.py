"""Train on shuffled, repeated data with a checkpoint every 3 steps and die hard mid-run:
``resume_worker.py MODEL_DIR KILL_AT STEPS [HOLD]``. With ``HOLD`` (a step), the
background write of that step's checkpoint stops before the rename that publishes it,
so the kill lands in the middle of that write."""
import os
import sys
import threading

from tests.tf_workers import tf_common as common

if __name__ == "__main__":
    model_dir, kill_at, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if len(sys.argv) > 4:
        from hostreduce.estimator import checkpoint as checkpoint_module

        held, rename = f".tmp-ckpt-{int(sys.argv[4])}-", os.rename

        def held_rename(src, dst, *args, **kwargs):
            if os.path.basename(src).startswith(held):
                threading.Event().wait(120)  # until the process is killed
            return rename(src, dst, *args, **kwargs)

        checkpoint_module.os = type(sys)("os_with_a_held_rename")
        checkpoint_module.os.__dict__.update(os.__dict__, rename=held_rename)
    common.train_weights(None, "adam", steps, model_dir=model_dir, save_every=3, kill_at=kill_at, n=64, shuffle=True)
    sys.exit("the run was expected to die before finishing")
