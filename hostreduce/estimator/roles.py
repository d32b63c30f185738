"""What each task of a parameter-server job does when the script reaches ``train`` or
``train_and_evaluate``, as in TensorFlow's parameter-server mode:

- a ``ps`` task serves until the chief ends the job, then ends its process (status 0;
  1 with the reason when the job failed), so the rest of the script never runs there;
- the ``evaluator`` evaluates each new checkpoint of ``model_dir`` on this host, writes
  its metrics to ``model_dir/eval`` and logs them, and returns the metrics of the final
  checkpoint (the one at ``max_steps``, or the one the chief names as its last);
- training tasks train; with an evaluator in the cluster they leave evaluation to it
  (``train_and_evaluate`` returns ``(None, [])`` there, like TensorFlow's), and the
  chief names its final step in ``model_dir/train-done.json`` for the evaluator.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

from ..errors import ClusterError, ConfigError
from ..progress import logger, progress
from ..ps_training.roles import serve_and_exit
from .checkpoint import CheckpointError
from .summaries import SummaryWriter

__all__ = ["check_can_train", "train_and_evaluate_ps", "DONE_FILE"]

DONE_FILE = "train-done.json"
POLL_S = 0.5


def _role(strategy: Any) -> str:
    return getattr(strategy, "role", "worker") if getattr(strategy, "parameter_servers", False) else "worker"


def check_can_train(strategy: Any) -> None:
    """At the start of ``train``: a ps serves (and never returns); the evaluator may not train."""
    role = _role(strategy)
    if role == "ps":
        serve_and_exit(strategy)
    if role == "evaluator":
        raise ClusterError("The evaluator task does not train: call `train_and_evaluate` (it evaluates each "
                           "checkpoint there) or `evaluate`. Received: train() on task.type='evaluator'")


def train_and_evaluate_ps(estimator: Any, train_spec: Any, eval_spec: Any) -> tuple[Any, list] | None:
    """``train_and_evaluate`` of a parameter-server job on this task; None where the
    usual alternation applies (training tasks of a cluster without an evaluator)."""
    strategy = estimator.strategy
    role = _role(strategy)
    if role == "ps":
        serve_and_exit(strategy)
    if role == "evaluator":
        return evaluate_checkpoints(estimator, eval_spec, train_spec.max_steps), []
    if not strategy.cluster.has_evaluator:
        return None
    estimator.train(train_spec.input_fn, max_steps=train_spec.max_steps, hooks=list(train_spec.hooks))
    if strategy.is_chief and estimator.model_dir:
        _write_done(estimator.model_dir, estimator.global_step)
    return None, []


def _write_done(model_dir: str, step: int) -> None:
    tmp = os.path.join(model_dir, f".{DONE_FILE}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"step": int(step)}, f)
    os.replace(tmp, os.path.join(model_dir, DONE_FILE))


def _done_step(model_dir: str) -> int | None:
    try:
        with open(os.path.join(model_dir, DONE_FILE)) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def evaluate_checkpoints(estimator: Any, eval_spec: Any, max_steps: int | None) -> dict[str, float]:
    """Evaluate every new checkpoint until the final one; its metrics."""
    model_dir = estimator.model_dir
    if not model_dir:
        raise ConfigError("The evaluator evaluates the checkpoints of `model_dir`: give the Estimator a model_dir. "
                          "Received: model_dir=None")
    files = estimator.checkpoints
    writer = SummaryWriter(os.path.join(model_dir, "eval"))
    done_at_start = _done_step(model_dir)
    last, metrics = -1, None
    try:
        while True:
            latest = files.latest()
            if latest is not None and latest[0] > last:
                try:
                    metrics = _evaluate(estimator, eval_spec, latest[1])
                except CheckpointError as e:  # pruned while read: the next one is newer
                    logger.warning("Checkpoint %s vanished while it was read (%s); waiting for the next", latest[1], e)
                    continue
                last = latest[0]
                writer.scalars(last, {k: v for k, v in metrics.items() if k != "global_step"})
                progress("Saving dict for global step %d: %s", last,
                         ", ".join(f"{k} = {v:g}" if isinstance(v, float) else f"{k} = {v}"
                                   for k, v in sorted(metrics.items())))
            done = _done_step(model_dir)
            final = max_steps if max_steps is not None else (done if done != done_at_start else None)
            if metrics is not None and final is not None and last >= final:
                return metrics
            time.sleep(POLL_S)
    finally:
        writer.close()


def _evaluate(estimator: Any, eval_spec: Any, path: str) -> dict[str, float]:
    """The metrics of the checkpoint in directory ``path``."""
    return estimator.evaluate(eval_spec.input_fn, steps=eval_spec.steps, checkpoint_path=path)
