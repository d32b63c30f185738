"""Horovod's Keras callbacks (``horovod.tensorflow.keras.callbacks``) for ``model.fit``.

They are Keras callbacks of whichever Keras the model comes from (Keras 3 or tf_keras):
the class is chosen when the callback is handed to ``fit``, so this module imports no
Keras. Collectives go through :mod:`hostreduce.horovod`, eagerly, between steps.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np

from ...errors import ConfigError
from ...host.kerases import loaded_kerases, optimizer_variables
from ...ops import job as _engine
from ...ops.tensors import Min, allreduce, broadcast_variables, grouped_allreduce

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "BestModelCheckpoint"]

logger = logging.getLogger("hostreduce.horovod")


def _callback_base() -> type:
    """``keras.callbacks.Callback`` of the Keras the user's ``tf.keras`` is (tf_keras with
    ``TF_USE_LEGACY_KERAS=1``, else Keras 3)."""
    import tensorflow as tf

    return tf.keras.callbacks.Callback


class KerasCallback:
    """A Keras callback whose Keras base class is picked at construction."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        base = _callback_base()
        concrete = _concrete.get((cls, base))
        if concrete is None:
            concrete = _concrete[(cls, base)] = type(cls.__name__, (cls, base), {"__module__": cls.__module__})
        return object.__new__(concrete)

    def __init__(self) -> None:
        _callback_base().__init__(self)


_concrete: dict[tuple[type, type], type] = {}


def _is_variable(value: Any) -> bool:
    import tensorflow as tf

    if isinstance(value, tf.Variable):
        return True
    return any(getattr(k, "Variable", None) is not None and isinstance(value, k.Variable)
               for k in loaded_kerases())


def _optimizer_ready(model: Any) -> bool:
    """Whether the model's and its optimizer's variables exist (or could be made to)
    before the first batch; builds an optimizer not built yet."""
    optimizer = getattr(model, "optimizer", None)
    # Not ``model.variables``: an unbuilt model may already hold its Dropout layers' seeds.
    if optimizer is None or not getattr(model, "built", False) or not model.trainable_variables:
        return False
    if getattr(optimizer, "built", False) or getattr(optimizer, "_built", False):
        return True
    build = getattr(optimizer, "build", None)
    if build is None:  # e.g. a legacy tf_keras optimizer: slots appear at its first update
        return False
    build(list(model.trainable_variables))
    return True


class BroadcastGlobalVariablesCallback(KerasCallback):
    """Make every rank start from ``root_rank``'s model and optimizer state: its weights,
    iteration count and slots (e.g. Adam's moments), as restored from a checkpoint.

    The broadcast runs when training begins, before the first step, where the model's
    variables exist by then (any model Keras 3 trains, built tf_keras models): an
    optimizer not built yet is built first, so that its slots exist on every rank to
    receive ``root_rank``'s. A job resumed from a checkpoint that only ``root_rank``
    loaded thus continues exactly where the saved one stopped. Otherwise (on every rank
    alike: the ranks agree on it first) it runs after the first batch, as in Horovod,
    whose first update then mixes gradients taken at different weights.
    Args: ``root_rank``; ``device`` is accepted (collectives run on the host).
    """

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._local_vars: list[Any] = []
        if local_variables is None:
            local_variables = []
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        else:
            local_variables = list(local_variables)
            if not all(_is_variable(v) for v in local_variables):
                raise ConfigError("`local_variables` must be a variable or a list of variables (tf.Variable or "
                                  f"Keras variables). Received: local_variables={local_variables!r}")
        for variable in local_variables:
            self.register_local_var(variable)

    def register_local_var(self, var: Any) -> None:
        """Leave ``var`` as it is on every rank: it is not broadcast."""
        self._local_vars.append(var)

    def _is_local(self, var: Any) -> bool:
        return any(var is v for v in self._local_vars)

    def _broadcast(self) -> None:
        broadcast_variables([v for v in self.model.variables if not self._is_local(v)], root_rank=self.root_rank)
        broadcast_variables(optimizer_variables(self.model.optimizer), root_rank=self.root_rank)
        self.broadcast_done = True

    def on_train_begin(self, logs: Any = None) -> None:
        if self.broadcast_done:
            return
        ready = _optimizer_ready(self.model)
        if _engine.size() > 1:
            # A rank whose model is built only by its first batch (while another loaded
            # a built one) must not leave the others waiting in a broadcast.
            import tensorflow as tf

            ready = bool(allreduce(tf.constant([int(ready)], tf.int32), op=Min).numpy()[0])
        if ready:
            self._broadcast()

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        if not self.broadcast_done:
            self._broadcast()


class MetricAverageCallback(KerasCallback):
    """Replace every metric in the epoch's logs with its average over the ranks, so
    rank 0's progress bar, ``History`` and later callbacks see job-wide values.

    Put it before callbacks that read the metrics (e.g. ``ModelCheckpoint``).
    ``device`` is accepted.
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if not logs or _engine.size() == 1:
            return
        import tensorflow as tf

        # Sorted: every rank reduces the same metrics in the same order.
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = [tf.constant(float(logs[k]), tf.float64) for k in names]
        for name, value in zip(names, grouped_allreduce(values)):
            logs[name] = float(value.numpy())


def _get_value(variable: Any) -> float:
    return float(np.asarray(variable.numpy() if hasattr(variable, "numpy") else variable))


class LearningRateScheduleCallback(KerasCallback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` in epochs
    ``[start_epoch, end_epoch)``, as Horovod does.

    Args:
        initial_lr: the learning rate that ``multiplier`` scales (required).
        multiplier: a function of the epoch (fractional when ``staircase=False``), or a
            number ``m``, meaning ``m ** epoch``.
        start_epoch, end_epoch: the epochs the schedule applies to (``end_epoch=None``:
            to the end).
        staircase: adjust at the first batch of each epoch; otherwise at every batch,
            with ``epoch + batch / steps_per_epoch``.
        momentum_correction: scale the optimizer's momentum by ``new_lr / old_lr`` for
            the adjusted batch, where the momentum is a variable (Keras 3 and tf_keras
            optimizers keep it as a constant of the traced step: then it is left alone).
        steps_per_epoch: batches per epoch (default: ``fit``'s).
    """

    def __init__(self, initial_lr: float, multiplier: Any, start_epoch: int = 0, end_epoch: int | None = None,
                 staircase: bool = True, momentum_correction: bool = True, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise ConfigError("`initial_lr` is required. Received: initial_lr=None")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch: int | None = None
        self.restore_momentum: float | None = None
        self._warned_momentum = False
        self.multiplier: Callable[[float], float] = (
            multiplier if callable(multiplier) else (lambda epoch, m=multiplier: m ** epoch))

    def _autodetect_steps_per_epoch(self) -> int:
        params = self.params or {}
        if params.get("steps"):
            return int(params["steps"])
        if params.get("samples") and params.get("batch_size"):
            return int(params["samples"]) // int(params["batch_size"])
        raise ConfigError(f"Could not find the number of steps per epoch from fit(); pass `steps_per_epoch` to "
                          f"{type(self).__name__}(). Received: steps_per_epoch=None")

    def _adjust_learning_rate(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old_lr = _get_value(optimizer.learning_rate)
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        momentum = getattr(optimizer, "momentum", None)
        if momentum is None or not self.momentum_correction:
            return
        if hasattr(momentum, "assign"):
            self.restore_momentum = _get_value(momentum)
            momentum.assign(self.restore_momentum * new_lr / old_lr)
        elif momentum and not self._warned_momentum:
            self._warned_momentum = True
            logger.warning("%s: momentum correction skipped: the optimizer's momentum is a constant of the traced "
                           "train step. Pass momentum_correction=False to silence this.", type(self).__name__)

    def _restore_momentum_if_needed(self) -> None:
        if self.restore_momentum is not None:
            self.model.optimizer.momentum.assign(self.restore_momentum)
            self.restore_momentum = None

    def on_train_begin(self, logs: Any = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current_epoch = epoch

    def on_batch_begin(self, batch: int, logs: Any = None) -> None:
        epoch = self.current_epoch
        assert epoch is not None
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust_learning_rate(epoch)
        else:
            self._adjust_learning_rate(epoch + float(batch) / self.steps_per_epoch)  # type: ignore[operator]

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if logs is not None:
            logs["lr"] = _get_value(self.model.optimizer.learning_rate)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size()`` to ``initial_lr`` over
    ``warmup_epochs`` epochs, batch by batch (Goyal et al., as Horovod does).

    ``verbose > 0``: rank 0 prints when the warmup ends.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            # Shifted by one batch so the rate reaches round values at epoch ends.
            epoch += 1.0 / self.steps_per_epoch  # type: ignore[operator]
            world = _engine.size()
            return 1.0 / world * (epoch * (world - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and _engine.rank() == 0:  # type: ignore[operator]
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_get_value(self.model.optimizer.learning_rate):g}.")


def BestModelCheckpoint(monitor: str = "val_loss", verbose: int = 0, save_weights_only: bool = False,
                        mode: str = "auto", save_freq: Any = "epoch") -> Any:
    """Horovod's ``BestModelCheckpoint``: a Keras ``ModelCheckpoint`` with
    ``save_best_only=True`` and no file path yet (Horovod's estimators set it).

    Keras 3's ``ModelCheckpoint`` needs its path when it is made: this raises there,
    naming ``keras.callbacks.ModelCheckpoint(filepath, save_best_only=True)`` to use instead.
    """
    import tensorflow as tf

    checkpoint = tf.keras.callbacks.ModelCheckpoint
    try:
        return checkpoint(filepath=None, monitor=monitor, verbose=verbose, save_best_only=True,
                          save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
    except (TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(
            "BestModelCheckpoint() makes a ModelCheckpoint without a file path, which this Keras does not accept "
            f"({type(exc).__name__}: {exc}). Use tf.keras.callbacks.ModelCheckpoint(filepath, monitor={monitor!r}, "
            f"save_best_only=True) on rank 0. Received: monitor={monitor!r}, mode={mode!r}"
        ) from exc
