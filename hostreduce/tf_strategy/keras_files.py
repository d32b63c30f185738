"""Keras's file-writing callbacks on a multi-worker hostreduce job.

Keras 3's ``BackupAndRestore`` and ``ModelCheckpoint`` write from every process to the
same paths (they know no multi-worker strategy that runs ``fit``), so two workers of one
job would write one HDF5 file at once, and one worker's ``on_train_end`` could remove
the backup while another still reads it. For a model built in a hostreduce strategy's
scope, every worker holds the same weights, so the chief alone writes (as
``tf_keras`` arranges through ``extended.should_checkpoint``); ``BackupAndRestore``
also waits for every worker before it restores and after the chief removed the backup,
so that no worker sees another fit's backup. Other models are untouched.

The routes are installed on the thread that built the strategy (the thread that calls
``fit``) for as long as the strategy lives (``hostreduce/host/patch.py``).
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from ..host.patch import routed

__all__ = ["install"]


def install(tf_strategy: Any) -> contextlib.ExitStack:
    """Route the callbacks of the Kerases in use; the returned stack removes the routes."""
    stack = contextlib.ExitStack()
    try:
        _keras3(stack, tf_strategy)
    except ImportError:
        pass
    if "tf_keras" in sys.modules or os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true"):
        try:
            _tf_keras(stack, tf_strategy)
        except ImportError:
            pass
    return stack


def _ours(tf_strategy: Any, callback: Any) -> Any:
    strategy = getattr(callback.model, "_distribute_strategy", None) or getattr(
        callback.model, "_distribution_strategy", None)
    return strategy if strategy is tf_strategy else None


def _tf_keras(stack: contextlib.ExitStack, tf_strategy: Any) -> None:
    """tf_keras's ``BackupAndRestore`` writes from the chief alone (through
    ``extended.should_checkpoint``) but accepts only TensorFlow's own strategies, and
    restores without waiting for the chief to have removed an earlier fit's backup."""
    from tf_keras.src import callbacks

    def begin(original: Any, callback: Any, *args: Any, **kwargs: Any) -> Any:
        if _ours(tf_strategy, callback) is None:
            return original(callback, *args, **kwargs)
        callback._supported_strategies = (*callback._supported_strategies, type(tf_strategy))
        tf_strategy.extended.barrier()
        return original(callback, *args, **kwargs)

    def end(original: Any, callback: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(callback, *args, **kwargs)
        if _ours(tf_strategy, callback) is not None:
            tf_strategy.extended.barrier()
        return result

    stack.enter_context(routed(callbacks.BackupAndRestore, "on_train_begin", begin))
    stack.enter_context(routed(callbacks.BackupAndRestore, "on_train_end", end))


def _keras3(stack: contextlib.ExitStack, tf_strategy: Any) -> None:
    from keras.src.callbacks import backup_and_restore, model_checkpoint

    def ours(callback: Any) -> Any:
        return _ours(tf_strategy, callback)

    def chief_only(original: Any, callback: Any, *args: Any, **kwargs: Any) -> Any:
        strategy = ours(callback)
        if strategy is not None and not strategy.extended.should_checkpoint:
            return None
        return original(callback, *args, **kwargs)

    def restore_after_everyone(original: Any, callback: Any, *args: Any, **kwargs: Any) -> Any:
        strategy = ours(callback)
        if strategy is not None:
            strategy.extended.barrier()
        return original(callback, *args, **kwargs)

    def remove_then_wait(original: Any, callback: Any, *args: Any, **kwargs: Any) -> Any:
        strategy = ours(callback)
        if strategy is None:
            return original(callback, *args, **kwargs)
        result = original(callback, *args, **kwargs) if strategy.extended.should_checkpoint else None
        strategy.extended.barrier()
        return result

    backup = backup_and_restore.BackupAndRestore
    stack.enter_context(routed(backup, "_save_model", chief_only))
    stack.enter_context(routed(backup, "on_train_begin", restore_after_everyone))
    stack.enter_context(routed(backup, "on_train_end", remove_then_wait))
    stack.enter_context(routed(model_checkpoint.ModelCheckpoint, "_save_model", chief_only))
