"""``horovod.tensorflow.keras.elastic``: elastic Keras ``fit`` (``KerasState``, the
commit and state callbacks, ``run``) on hostreduce's ring; see
:mod:`hostreduce.horovod.elastic` for what a reset does.

The callbacks are ``keras.callbacks.Callback`` of the Keras the script uses (tf_keras's
under ``TF_USE_LEGACY_KERAS=1``), as the other callbacks of :mod:`.callbacks`.
"""
from __future__ import annotations

from typing import Any

from ...errors import ConfigError
from ..elastic import TensorFlowKerasState, run
from .callbacks import KerasCallback

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]


class KerasState(TensorFlowKerasState):
    """State of a Keras model, its optimizer and keyword values (e.g. ``batch=0, epoch=0``).

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default: the one it was compiled with).
        **kwargs: further values kept as attributes.
    """

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, **kwargs)


class _CommitState:
    """Commit the state every ``batches_per_commit`` batches and at each epoch's end."""

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        if isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, int) or batches_per_commit < 1:
            raise ConfigError(f"`batches_per_commit` must be an integer >= 1. Received: "
                             f"batches_per_commit={batches_per_commit!r}")
        self.state = state
        self.backend = None   # Horovod's attribute (its Keras backend); unused
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        self.batches_remaining = self.batches_per_commit   # alike on every rank after a reset

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.commit()

    def commit(self) -> None:
        self.state.commit()


class _UpdateBatchState:
    """Keep ``state.batch`` at the batch last finished (0 at an epoch's end); after a
    reset, the first epoch runs only the steps it has left."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: int | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        params = self.params if isinstance(self.params, dict) else {}
        if params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = params["steps"]
            params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class _UpdateEpochState:
    """Keep ``state.epoch`` at the number of epochs finished, across resets."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: Any = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1


class CommitStateCallback(_CommitState, KerasCallback):
    """Keras callback: ``state.commit()`` every ``batches_per_commit`` batches and at each
    epoch's end."""


class UpdateBatchStateCallback(_UpdateBatchState, KerasCallback):
    """Keras callback: ``state.batch`` is the batch last finished; after a reset the
    first epoch runs only the steps it has left (with ``steps_per_epoch``)."""


class UpdateEpochStateCallback(_UpdateEpochState, KerasCallback):
    """Keras callback: ``state.epoch`` counts the epochs finished, across resets."""
