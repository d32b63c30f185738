"""``RunConfig``: where an Estimator keeps its state and how it distributes training."""
from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import ConfigError

__all__ = ["RunConfig"]


def _positive_int_or_none(name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"`{name}` must be an integer >= 1 or None. Received: {name}={value!r}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Settings of an :class:`Estimator` run.

    Attributes:
        train_distribute: a strategy (``MultiWorkerStrategy``, ``HorovodStrategy``);
            None trains in this process alone. Also used by ``evaluate``.
        model_dir: directory for checkpoints (written by the chief, rank 0).
        save_checkpoints_steps: save every this many steps (and always at the end of
            ``train``); None saves only at the end.
        keep_checkpoint_max: number of most recent checkpoints kept.
        log_step_count_steps: the chief logs step, loss and examples/s this often.
        timeline_dir: write a Chrome-trace timeline per rank here (default: the
            ``HOSTREDUCE_TIMELINE`` variable; unset writes none).
        collective_timeout_s: longest wait for a step's reductions before failing.
        fused_apply: run Keras SGD/Adam updates in ``host_call`` through fused kernels.
        stream_gradients: hand each gradient to the reducer the moment the backward
            pass produces it, so reductions overlap the rest of the backward pass
            (default). False copies the gradients to the host as they come but starts
            the reductions only after the whole backward pass, all at once: the
            sequential schedule, useful to measure what the overlap gains.
    """

    train_distribute: Any = None
    model_dir: str | None = None
    save_checkpoints_steps: int | None = None
    keep_checkpoint_max: int = 5
    log_step_count_steps: int | None = 100
    timeline_dir: str | None = None
    collective_timeout_s: float | None = None
    fused_apply: bool = True
    stream_gradients: bool = True

    def __post_init__(self) -> None:
        _positive_int_or_none("save_checkpoints_steps", self.save_checkpoints_steps)
        _positive_int_or_none("log_step_count_steps", self.log_step_count_steps)
        if not isinstance(self.keep_checkpoint_max, int) or self.keep_checkpoint_max < 1:
            raise ConfigError(
                f"`keep_checkpoint_max` must be an integer >= 1. Received: keep_checkpoint_max={self.keep_checkpoint_max!r}"
            )
        if self.model_dir is not None and not isinstance(self.model_dir, str):
            object.__setattr__(self, "model_dir", str(self.model_dir))
        if self.timeline_dir is not None and not isinstance(self.timeline_dir, str):
            object.__setattr__(self, "timeline_dir", str(self.timeline_dir))
        if not isinstance(self.stream_gradients, bool):
            raise ConfigError(
                f"`stream_gradients` must be a bool. Received: stream_gradients={self.stream_gradients!r}"
            )
        value = self.train_distribute
        if value is not None and not hasattr(type(value), "reducer"):
            raise ConfigError(
                "`train_distribute` must be a hostreduce strategy (MultiWorkerStrategy, HorovodStrategy) or None. "
                f"Received: train_distribute={value!r}"
            )

    def replace(self, **changes: Any) -> "RunConfig":
        return dataclasses.replace(self, **changes)
