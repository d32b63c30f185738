"""Keras's file-writing callbacks on a multi-worker hostreduce job.

Keras 3's ``BackupAndRestore`` and ``ModelCheckpoint`` write from every process to the
same paths (they know no multi-worker strategy that runs ``fit``), so two workers of one
job would write one HDF5 file at once, and one worker's ``on_train_end`` could remove
the backup while another still reads it. For a model a hostreduce job trains, every
worker holds the same weights, so the chief alone writes (as ``tf_keras`` arranges
through ``extended.should_checkpoint``); ``BackupAndRestore`` also waits for every
worker before it restores and after the chief removed the backup, so that no worker sees
another fit's backup. tf_keras's ``BackupAndRestore`` writes from the chief alone but
accepts only TensorFlow's strategies and restores without that wait: it gets both.
Other models are untouched.

The routes are installed on the calling thread (the thread that calls ``fit``) until the
returned stack is closed (``hostreduce/host/patch.py``).
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable

from .patch import routed

__all__ = ["install", "model_classes", "tf_keras_wanted"]


def tf_keras_wanted() -> bool:
    """Whether tf_keras is (to be) the Keras of this process's `tf.keras`."""
    return "tf_keras" in sys.modules or os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true")


def model_classes() -> list[type]:
    """The classes whose ``fit``/``evaluate``/``predict`` a script's models use: Keras 3's
    TensorFlow trainer, and tf_keras's ``Model`` where tf_keras is (to be) used."""
    found: list[type] = []
    try:
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

        found.append(TensorFlowTrainer)
    except ImportError:
        pass
    if tf_keras_wanted():
        try:
            import tf_keras

            found.append(tf_keras.Model)
        except ImportError:
            pass
    return found


def install(owns: Callable[[Any], bool], is_chief: Callable[[], bool], barrier: Callable[[], None],
            tf_keras_strategy: type | None = None, tf_keras_chief_only: bool = False) -> contextlib.ExitStack:
    """Route the callbacks of the Kerases in use for the models ``owns(model)`` accepts;
    ``is_chief()``: whether this worker writes; ``barrier()``: wait for every worker;
    ``tf_keras_strategy``: the ``tf.distribute`` strategy class tf_keras's models carry;
    ``tf_keras_chief_only``: tf_keras's models carry TensorFlow's default strategy (every
    worker would write), so its callbacks write from the chief alone as Keras 3's do
    (neither: leave tf_keras alone)."""
    stack = contextlib.ExitStack()
    try:
        _keras3(stack, owns, is_chief, barrier)
    except ImportError:
        pass
    if (tf_keras_strategy is not None or tf_keras_chief_only) and tf_keras_wanted():
        try:
            if tf_keras_chief_only:
                _tf_keras_chief_only(stack, owns, is_chief, barrier)
            else:
                _tf_keras(stack, owns, barrier, tf_keras_strategy)
        except ImportError:
            pass
    return stack


def _tf_keras(stack: contextlib.ExitStack, owns: Callable[[Any], bool], barrier: Callable[[], None],
              strategy_type: type) -> None:
    from tf_keras.src import callbacks

    def begin(original: Any, callback: Any, *args: Any, **kwargs: Any) -> Any:
        if owns(callback.model):
            callback._supported_strategies = (*callback._supported_strategies, strategy_type)
            barrier()
        return original(callback, *args, **kwargs)

    def end(original: Any, callback: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(callback, *args, **kwargs)
        if owns(callback.model):
            barrier()
        return result

    stack.enter_context(routed(callbacks.BackupAndRestore, "on_train_begin", begin))
    stack.enter_context(routed(callbacks.BackupAndRestore, "on_train_end", end))


def _chief_routes(owns: Callable[[Any], bool], is_chief: Callable[[], bool],
                  barrier: Callable[[], None]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Routes for the callbacks of the models ``owns`` accepts: a write the chief alone
    makes, and a restore made once every worker got there."""
    def chief_only(original: Any, callback: Any, *args: Any, **kwargs: Any) -> Any:
        if owns(callback.model) and not is_chief():
            return None
        return original(callback, *args, **kwargs)

    def restore_after_everyone(original: Any, callback: Any, *args: Any, **kwargs: Any) -> Any:
        if owns(callback.model):
            barrier()
        return original(callback, *args, **kwargs)

    return chief_only, restore_after_everyone


def _tf_keras_chief_only(stack: contextlib.ExitStack, owns: Callable[[Any], bool], is_chief: Callable[[], bool],
                         barrier: Callable[[], None]) -> None:
    from tf_keras.src import callbacks

    chief_only, restore_after_everyone = _chief_routes(owns, is_chief, barrier)

    def remove_then_wait(original: Any, callback: Any, *args: Any, **kwargs: Any) -> Any:
        if not owns(callback.model):
            return original(callback, *args, **kwargs)
        delete = callback.delete_checkpoint
        callback.delete_checkpoint = delete and is_chief()
        try:
            result = original(callback, *args, **kwargs)
        finally:
            callback.delete_checkpoint = delete
        barrier()
        return result

    stack.enter_context(routed(callbacks.BackupAndRestore, "_backup", chief_only))
    stack.enter_context(routed(callbacks.BackupAndRestore, "on_train_begin", restore_after_everyone))
    stack.enter_context(routed(callbacks.BackupAndRestore, "on_train_end", remove_then_wait))
    stack.enter_context(routed(callbacks.ModelCheckpoint, "_save_model", chief_only))


def _keras3(stack: contextlib.ExitStack, owns: Callable[[Any], bool], is_chief: Callable[[], bool],
            barrier: Callable[[], None]) -> None:
    from keras.src.callbacks import backup_and_restore, model_checkpoint

    chief_only, restore_after_everyone = _chief_routes(owns, is_chief, barrier)

    def remove_then_wait(original: Any, callback: Any, *args: Any, **kwargs: Any) -> Any:
        if not owns(callback.model):
            return original(callback, *args, **kwargs)
        result = original(callback, *args, **kwargs) if is_chief() else None
        barrier()
        return result

    backup = backup_and_restore.BackupAndRestore
    stack.enter_context(routed(backup, "_save_model", chief_only))
    stack.enter_context(routed(backup, "on_train_begin", restore_after_everyone))
    stack.enter_context(routed(backup, "on_train_end", remove_then_wait))
    stack.enter_context(routed(model_checkpoint.ModelCheckpoint, "_save_model", chief_only))
