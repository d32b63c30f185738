"""``train_and_evaluate``: alternate training and evaluation until ``max_steps``."""
from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple

from ..errors import ConfigError

__all__ = ["TrainSpec", "EvalSpec", "train_and_evaluate"]

logger = logging.getLogger("hostreduce.estimator")


class TrainSpec(NamedTuple):
    """``input_fn`` and ``max_steps`` of the training part of ``train_and_evaluate``."""

    input_fn: Callable[..., Any]
    max_steps: int | None = None
    hooks: tuple = ()


class EvalSpec(NamedTuple):
    """``input_fn`` of the evaluation part; evaluate every ``every_n_steps`` steps
    (default: once, after training)."""

    input_fn: Callable[..., Any]
    steps: int | None = None
    every_n_steps: int | None = None
    name: str | None = None


def train_and_evaluate(estimator: Any, train_spec: TrainSpec, eval_spec: EvalSpec) -> tuple[dict[str, float], list]:
    """Train to ``train_spec.max_steps``, evaluating every ``eval_spec.every_n_steps``
    steps and at the end. Returns ``(final metrics, [])`` like ``tf.estimator``."""
    if not isinstance(train_spec, TrainSpec):
        raise ConfigError(f"`train_spec` must be a TrainSpec. Received: {type(train_spec).__name__}")
    if not isinstance(eval_spec, EvalSpec):
        raise ConfigError(f"`eval_spec` must be an EvalSpec. Received: {type(eval_spec).__name__}")
    every = eval_spec.every_n_steps
    if every is not None and (not isinstance(every, int) or every < 1):
        raise ConfigError(f"`every_n_steps` must be an integer >= 1 or None. Received: every_n_steps={every!r}")
    max_steps = train_spec.max_steps
    metrics: dict[str, float] = {}
    while True:
        target = max_steps
        if every is not None:
            target = estimator.global_step + every if max_steps is None else min(max_steps, estimator.global_step + every)
        before = estimator.global_step
        estimator.train(train_spec.input_fn, max_steps=target, hooks=list(train_spec.hooks))
        metrics = estimator.evaluate(eval_spec.input_fn, steps=eval_spec.steps)
        logger.info("Evaluation at step %d: %s", estimator.global_step, metrics)
        if (max_steps is not None and estimator.global_step >= max_steps) or estimator.global_step == before \
                or every is None:
            return metrics, []
