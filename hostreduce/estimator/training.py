"""``train_and_evaluate``: alternate training and evaluation until ``max_steps``."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

from ..errors import ConfigError
from ..progress import progress

__all__ = ["TrainSpec", "EvalSpec", "train_and_evaluate"]



class TrainSpec(NamedTuple):
    """The training part of ``train_and_evaluate``.

    Attributes:
        input_fn: as for :meth:`Estimator.train`.
        max_steps: train until the global step reaches this (None: until the data ends).
        hooks: callables ``hook(global_step, loss)`` run after every step.
    """

    input_fn: Callable[..., Any]
    max_steps: int | None = None
    hooks: tuple = ()


class EvalSpec(NamedTuple):
    """The evaluation part of ``train_and_evaluate``; the arguments follow
    ``tf.estimator.EvalSpec``.

    Attributes:
        input_fn: as for :meth:`Estimator.evaluate`.
        steps: batches per evaluation; 100 by default, as in ``tf.estimator``, so an
            ``input_fn`` that repeats its data ends. None evaluates until the data ends.
        name: a label for the evaluation (logged with its results).
        hooks, exporters: TensorFlow session hooks and exporters do not exist here;
            only empty values are accepted.
        start_delay_secs, throttle_secs: accepted for ``tf.estimator`` scripts. With
            ``train_and_evaluate`` evaluation runs after training, and also every
            ``every_n_steps`` steps when that is set.
        every_n_steps: evaluate every this many training steps (None: once, at the end).
    """

    input_fn: Callable[..., Any]
    steps: int | None = 100
    name: str | None = None
    hooks: Any = ()
    exporters: Any = ()
    start_delay_secs: float = 120
    throttle_secs: float = 600
    every_n_steps: int | None = None


def train_and_evaluate(estimator: Any, train_spec: TrainSpec, eval_spec: EvalSpec) -> tuple[dict[str, float], list]:
    """Train to ``train_spec.max_steps``, evaluating every ``eval_spec.every_n_steps``
    steps and at the end. Returns ``(final metrics, [])`` like ``tf.estimator``."""
    if not isinstance(train_spec, TrainSpec):
        raise ConfigError(f"`train_spec` must be a TrainSpec. Received: {type(train_spec).__name__}")
    if not isinstance(eval_spec, EvalSpec):
        raise ConfigError(f"`eval_spec` must be an EvalSpec. Received: {type(eval_spec).__name__}")
    for field in ("hooks", "exporters"):
        if getattr(eval_spec, field):
            raise ConfigError(
                f"`EvalSpec.{field}` is not supported: TensorFlow session hooks and exporters have no place in "
                f"hostreduce's runner. Received: {field}={getattr(eval_spec, field)!r}. Call `estimator.evaluate` "
                "and act on its results instead"
            )
    steps = eval_spec.steps
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise ConfigError(f"`EvalSpec.steps` must be an integer >= 1 or None. Received: steps={steps!r}")
    every = eval_spec.every_n_steps
    if every is not None and (not isinstance(every, int) or every < 1):
        raise ConfigError(f"`every_n_steps` must be an integer >= 1 or None. Received: every_n_steps={every!r}")
    from .roles import train_and_evaluate_ps

    outcome = train_and_evaluate_ps(estimator, train_spec, eval_spec)  # ps, evaluator, ps workers
    if outcome is not None:
        return outcome
    max_steps = train_spec.max_steps
    metrics: dict[str, float] = {}
    while True:
        target = max_steps
        if every is not None:
            target = estimator.global_step + every if max_steps is None else min(max_steps, estimator.global_step + every)
        before = estimator.global_step
        estimator.train(train_spec.input_fn, max_steps=target, hooks=list(train_spec.hooks))
        metrics = estimator.evaluate(eval_spec.input_fn, steps=eval_spec.steps)
        if estimator.strategy.is_chief:
            progress("Saving dict for global step %d: %s", estimator.global_step,
                      ", ".join(f"{k} = {v:g}" if isinstance(v, float) else f"{k} = {v}"
                                for k, v in sorted(metrics.items())))
        if (max_steps is not None and estimator.global_step >= max_steps) or estimator.global_step == before \
                or every is None:
            return metrics, []
