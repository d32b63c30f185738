"""Train on shuffled, repeated data with a checkpoint every 3 steps and die hard mid-run:
``resume_worker.py MODEL_DIR KILL_AT STEPS``."""
import sys

from tests.tf_workers import tf_common as common

if __name__ == "__main__":
    model_dir, kill_at, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    common.train_weights(None, "adam", steps, model_dir=model_dir, save_every=3, kill_at=kill_at, n=64, shuffle=True)
    sys.exit("the run was expected to die before finishing")
