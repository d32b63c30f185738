"""``Estimator``: trains, evaluates and predicts with a TF1-style ``model_fn`` on top
of a hostreduce strategy."""
from __future__ import annotations

import copy
import os
import time
from typing import Any, Callable, Iterator

import numpy as np

from ..errors import ConfigError
from ..host.variables import VariableStore
from ..timeline import Timeline, timeline_dir_from_env
from ..progress import logger, progress
from .checkpoint import CheckpointManager
from .checkpointing import Checkpointing, with_ps_tables
from .export import features_spec, write_saved_model
from .inputs import batch_size, call_input_fn, check_model_fn, check_steps, split_element, without_autotune_thread
from .mode_keys import ModeKeys
from .programs import EvalProgram, PredictProgram, TrainProgram
from .ps_program import PSTrainProgram
from .roles import check_can_train
from .run_config import RunConfig, set_random_seed
from .session_hooks import SessionHooks, split_hooks
from .summaries import SummaryWriter
from .team import training_team

__all__ = ["Estimator"]


class Estimator:
    """Runs ``model_fn`` for training, evaluation and prediction.

    Args:
        model_fn: ``model_fn(features, labels, mode, params)`` (``labels``, ``mode``,
            ``params`` and ``config`` are passed only if named) returning an
            :class:`EstimatorSpec`. It builds its Keras layers and optimizer itself;
            it runs while its mode's step function is traced.
        model_dir: checkpoint directory (overrides ``config.model_dir``).
        config: a :class:`RunConfig`.
        params: passed to ``model_fn`` and ``input_fn`` as ``params``.
    """

    def __init__(self, model_fn: Callable[..., Any], model_dir: str | None = None,
                 config: RunConfig | None = None, params: dict[str, Any] | None = None) -> None:
        check_model_fn(model_fn)
        _run_eagerly_outside_functions()
        if config is None:
            config = RunConfig()
        if not isinstance(config, RunConfig):
            raise ConfigError(f"`config` must be a RunConfig. Received: config={config!r}")
        if model_dir is not None:
            config = config.replace(model_dir=str(model_dir))
        if params is not None and not isinstance(params, dict):
            raise ConfigError(f"`params` must be a dict or None. Received: params={params!r}")
        self.model_fn = model_fn
        self.config = config
        self.params = copy.deepcopy(params) if params is not None else {}
        self._strategy = config.train_distribute
        if self._strategy is None:
            from ..strategies import SingleProcessStrategy

            self._strategy = SingleProcessStrategy()
        self._store = VariableStore(on_host=self._strategy.variables_on_host)
        self._timeline = Timeline(config.timeline_dir or timeline_dir_from_env(), rank=self._strategy.rank)
        self._checkpoints = CheckpointManager(config.model_dir, config.keep_checkpoint_max) if config.model_dir else None
        summaries = config.model_dir if config.model_dir and config.save_summary_steps else None
        self._summaries = SummaryWriter(summaries if self._strategy.is_chief else None)
        self._eval_summaries = SummaryWriter(os.path.join(summaries, "eval") if summaries and self._strategy.is_chief
                                             else None)
        self._programs: dict[str, Any] = {}
        self._excluded_keys: set[str] = set()
        self._global_step = 0
        self._step_synced = False
        self._seeded = False
        self._team = training_team(self._strategy)  # who the Estimator's own collectives span
        self._ckpt = Checkpointing(self._team, self._checkpoints, config.save_checkpoints_steps,
                                   config.save_checkpoints_secs)
        self._features_spec: Any = None  # of the last input_fn, for export_saved_model

    # -- properties ------------------------------------------------------------
    @property
    def model_dir(self) -> str | None:
        return self.config.model_dir

    @property
    def strategy(self) -> Any:
        return self._strategy

    @property
    def global_step(self) -> int:
        return self._global_step

    def get_variable_names(self) -> list[str]:
        return [k for k, _ in self._store.items() if k not in self._excluded_keys]

    def get_variable_value(self, name: str) -> np.ndarray:
        for key, var in self._store.items():
            if key == name:
                return var.numpy()
        raise ConfigError(f"`name` must be one of get_variable_names(). Received: name={name!r}")

    def get_variables(self) -> dict[str, np.ndarray]:
        """Every model and optimizer variable (not evaluation metrics) by name; with
        parameter servers, the tables they shard are pulled from them whole (call it
        while the job runs)."""
        return {**self._own_variables(), **(self._ckpt.ps.pull_tables() if self._ckpt.ps else {})}

    def _own_keys(self) -> list[str]:
        return [k for k, _ in self._store.items() if k not in self._excluded_keys]

    def _own_variables(self) -> dict[str, np.ndarray]:
        keys = self._own_keys()
        return dict(zip(keys, self._store.values(keys)))

    def _own_tensors(self) -> dict[str, Any]:
        """:meth:`_own_variables` as tensors (what a checkpoint writes: no copy)."""
        keys = self._own_keys()
        return dict(zip(keys, self._store.tensors(keys)))

    @property
    def checkpoints(self) -> CheckpointManager | None:
        """The checkpoint files of ``model_dir`` (None without one)."""
        return self._checkpoints

    def latest_checkpoint(self) -> str | None:
        """The prefix of the latest checkpoint in ``model_dir`` (``.../ckpt-N/variables``,
        what ``tf.train.latest_checkpoint(model_dir)`` returns), or None; a checkpoint
        being written in the background is waited for."""
        self._ckpt.flush()
        latest = self._checkpoints.latest() if self._checkpoints else None
        return CheckpointManager.prefix(latest[1]) if latest else None

    # -- building --------------------------------------------------------------
    def _program(self, mode: str, element_spec: Any) -> Any:
        from .programs import relaxed_signature

        self._features_spec = relaxed_signature(element_spec)[0]
        signature = repr(relaxed_signature(element_spec))
        cached = self._programs.get(mode)
        if cached is not None and cached[0] == signature:
            return cached[1]
        args = (self.model_fn, self.params, self.config, self._store, element_spec, self._timeline)
        if self.config.tf_random_seed is not None and not self._seeded:
            set_random_seed(self.config.tf_random_seed)
            self._seeded = True
        if mode == ModeKeys.TRAIN and getattr(self._strategy, "parameter_servers", False):
            program = PSTrainProgram(*args, strategy=self._strategy)
        elif mode == ModeKeys.TRAIN:
            program = TrainProgram(*args, strategy=self._strategy, fused_apply=self.config.fused_apply,
                                   stream_gradients=self.config.stream_gradients, host_apply=self.config.host_apply)
        elif mode == ModeKeys.EVAL:
            program = EvalProgram(*args)
            for metric in program.keras_metrics().values():
                self._excluded_keys.update(filter(None, (self._store.key_of(v) for v in metric.variables)))
        else:
            program = PredictProgram(*args)
        self._excluded_keys.update(self._store.local_keys(), self._store.made_by_factory())  # the ps hold the tables (row caches)
        program.feeder = self._ckpt.ps.feed if self._ckpt.ps is not None and mode != ModeKeys.TRAIN else None
        self._programs[mode] = (signature, program)
        self._sync_variables()
        if isinstance(program, PSTrainProgram):  # the variables now live on the ps
            step = program.connect(self._global_step, self.config.model_dir, self.config.keep_checkpoint_max)
            self._global_step = step if self._team is not self._strategy else self._global_step
            self._ckpt.ps = program
        return program

    def _sync_variables(self) -> None:
        """Give variables created since the last sync their starting values: the
        latest checkpoint's where it has them, then the chief's everywhere."""
        strategy = self._team
        new = [(k, v) for k, v in self._store.unsynced() if k not in self._excluded_keys]
        if strategy.is_chief:
            step = self._ckpt.restore_latest(new)
            if step is not None and not self._step_synced:
                self._global_step = step
        if strategy.size > 1:
            reducer = strategy.reducer
            if not self._step_synced:
                step = reducer.broadcast("hostreduce.sync.step", np.array([self._global_step], np.int64), root=0)
                self._global_step = int(step[0])
            handles = [reducer.broadcast_async(f"hostreduce.sync.{i}", var.numpy(), root=0)
                       for i, (_, var) in enumerate(sorted(new, key=lambda kv: kv[0]))]
            for handle, (_, var) in zip(handles, sorted(new, key=lambda kv: kv[0])):
                var.assign(np.reshape(handle.wait(), var.shape))
        self._step_synced = True
        self._store.mark_synced(k for k, _ in self._store.unsynced())

    def _dataset(self, input_fn: Callable[..., Any], mode: str) -> Any:
        dataset = call_input_fn(input_fn, mode, self._strategy.input_context(), self.params, self.config)
        return without_autotune_thread(dataset)

    # -- checkpoints -----------------------------------------------------------
    def _save(self, input_ended: bool = False) -> None:
        """Checkpoint the current step (every worker calls this at the same steps)."""
        self._ckpt.save(self._global_step, self._own_tensors, input_ended)

    # -- train -----------------------------------------------------------------
    def train(self, input_fn: Callable[..., Any], steps: int | None = None, max_steps: int | None = None,
              hooks: list[Any] | None = None) -> "Estimator":
        """Train on ``input_fn``'s data.

        Args:
            input_fn: ``input_fn(mode, input_context)`` (both optional) returning a
                ``tf.data.Dataset`` of ``(features, labels)``; shard it with
                ``input_context`` for multi-worker training.
            steps: train this many more steps (or until the data ends).
            max_steps: train until the global step reaches this value.
            hooks: callables ``hook(global_step, loss)`` run after every step, and
                TensorFlow ``SessionRunHook`` objects (``tf.compat.v1.train.LoggingTensorHook``,
                ``hvd.BroadcastGlobalVariablesHook``, ...), called as ``tf.estimator`` called
                them, on a graph of their own (``session_hooks.py``).

        With neither ``steps`` nor ``max_steps``, training runs until the data ends;
        with several workers they agree every step, so all stop when the first runs
        out. With ``steps``/``max_steps`` every worker must have enough batches.
        Training resumes from the latest checkpoint in ``model_dir``: variables, step
        and, where the checkpoint of the current step holds them, every worker's input
        position, so a resumed run sees the batches an uninterrupted one would
        (``input_fn`` must build the same pipeline). The chief logs progress on the
        ``hostreduce.estimator`` logger (level INFO).
        """
        check_steps("steps", steps)
        check_steps("max_steps", max_steps)
        if steps is not None and max_steps is not None:
            raise ConfigError(f"Give `steps` or `max_steps`, not both. Received: steps={steps}, max_steps={max_steps}")
        plain_hooks, session_hooks = split_hooks(hooks)
        check_can_train(self._strategy)  # a ps task serves here instead
        self._team.reducer  # connect before the first step, not inside it
        dataset = self._dataset(input_fn, ModeKeys.TRAIN)
        program = self._program(ModeKeys.TRAIN, dataset.element_spec)
        start = self._global_step
        target = max_steps if max_steps is not None else (start + steps if steps is not None else None)
        if target is not None and start >= target:
            return self
        strategy, config = self._strategy, self.config
        must_agree = target is None and self._team.size > 1
        log_every = config.log_step_count_steps
        save_every, save_secs = self._ckpt.policy()
        timeout = config.collective_timeout_s
        window_start, window_examples = time.perf_counter(), 0
        summary_every = config.save_summary_steps if config.model_dir else None
        summary_start, summary_examples = time.perf_counter(), 0
        iterator = self._ckpt.iterator = self._ckpt.restore_input(dataset, iter(dataset), self._global_step)
        session = self._session_hooks(session_hooks, program)
        loss = float("nan")
        has_data = 1
        stop = False
        while (target is None or self._global_step < target) and not stop:
            try:
                features, labels = split_element(next(iterator), ModeKeys.TRAIN)
                has_data = 1
            except StopIteration:
                has_data = 0
            if must_agree:
                has_data = int(self._team.reducer.allreduce("hostreduce.more", np.array([has_data], np.int32), op="min")[0])
            if not has_data:
                break
            if session is not None:
                context, fetched = session.before_run(features, labels)
            loss = program.run(features, labels, timeout)
            self._global_step += 1
            step = self._global_step
            window_examples += batch_size(features) * strategy.size
            summary_examples += batch_size(features) * strategy.size
            if session is not None:
                stop = session.after_run(context, fetched)
                if self._team.size > 1:  # every worker stops at the same step
                    stop = bool(self._team.reducer.allreduce("hostreduce.hooks.stop", np.array([stop], np.int32),
                                                             op="max")[0])
            for hook in plain_hooks:
                hook(step, loss)
            if log_every and step % log_every == 0:
                mean_loss = self._mean_across_workers("hostreduce.loss", loss)
                elapsed = time.perf_counter() - window_start
                if strategy.is_chief:
                    progress("step %d: loss = %.5f (%.1f examples/s)", step, mean_loss,
                              window_examples / max(elapsed, 1e-9))
                window_start, window_examples = time.perf_counter(), 0
            if summary_every and step % summary_every == 0:
                # The chief's own loss, as tf.estimator wrote it: no collective, so workers
                # need not agree on model_dir (a script may give it to the chief alone).
                elapsed = max(time.perf_counter() - summary_start, 1e-9)
                self._summaries.scalars(step, {"loss": loss, "global_step/sec": summary_every / elapsed,
                                               "examples/sec": summary_examples / elapsed})
                summary_start, summary_examples = time.perf_counter(), 0
            if self._ckpt.due(step, save_every, save_secs):
                self._save()
                self._timeline.flush()
        self._save(input_ended=not has_data)
        self._ckpt.flush()  # the last checkpoint is on disk when train() returns
        if session is not None:
            session.end()
        if isinstance(program, PSTrainProgram):
            program.finish()
        self._ckpt.iterator = None
        self._timeline.flush()
        if strategy.is_chief and self._global_step > start:
            progress("Loss for final step: %s.", loss)
        return self

    def _session_hooks(self, hooks: list[Any], program: Any) -> SessionHooks | None:
        """The ``SessionRunHook`` objects of a ``train`` call, begun and given their
        session (after the variables were restored and synchronized)."""
        if not hooks:
            return None
        if isinstance(program, PSTrainProgram):
            raise ConfigError("SessionRunHook objects in `hooks` are not supported with parameter servers: use "
                              f"callables hook(global_step, loss). Received: hooks={hooks!r:.200}")
        variables = dict((k, v) for k, v in self._store.items() if k not in self._excluded_keys)
        return SessionHooks(hooks, program, list(variables.values()), variables.get("global_step"),
                            lambda: self._global_step)

    def _mean_across_workers(self, name: str, value: float) -> float:
        if self._team.size == 1:
            return value
        out = self._team.reducer.allreduce(name, np.array([value], np.float64), op="mean")
        return float(out[0])

    # -- evaluate --------------------------------------------------------------
    def evaluate(self, input_fn: Callable[..., Any], steps: int | None = None,
                 checkpoint_path: str | None = None) -> dict[str, float]:
        """Evaluate on ``input_fn``'s data (``steps`` batches, or until it ends).

        With ``checkpoint_path`` (a checkpoint directory of ``model_dir``, or its prefix
        as :meth:`latest_checkpoint` gives it), the variables are first set from that
        checkpoint, and ``global_step`` is its step; without it, the variables as they are.

        Returns a dict with ``loss`` (mean over batches), every entry of
        ``eval_metric_ops`` and ``global_step``. Metrics start from zero at every call.
        With several workers, every worker evaluates its shard and the results are
        combined: Keras metrics and TF1 ``tf.compat.v1.metrics`` pairs by summing their
        state (so they equal the metric over all batches of all workers), plain tensors
        by averaging over all batches of all workers.
        """
        check_steps("steps", steps)
        strategy = self._strategy
        dataset = self._dataset(input_fn, ModeKeys.EVAL)
        program = self._program(ModeKeys.EVAL, dataset.element_spec)
        if checkpoint_path is not None:
            self._assign_checkpoint(checkpoint_path)
        keras_metrics = program.keras_metrics()
        for metric in keras_metrics.values():
            metric.reset_state()
        local_keys = self._store.local_keys()
        local_vars = [(k, v) for k, v in self._store.items() if k in local_keys]
        for _, var in local_vars:  # TF1 metrics' totals and counts start at zero
            var.assign(np.zeros(var.shape, var.dtype.as_numpy_dtype))
        streaming = program.streaming_metric_names()
        names = ["loss"] + [f"metric/{n}" for n in program.tensor_metric_names() if n not in streaming]
        sums = np.zeros(len(names) + 1, np.float64)
        latest: dict[str, float] = {}
        for i, element in enumerate(dataset):
            if steps is not None and i >= steps:
                break
            features, labels = split_element(element, ModeKeys.EVAL)
            outputs = program.call(features, labels)
            sums[:-1] += [float(outputs[n]) for n in names]
            sums[-1] += 1
            latest = {n: float(outputs[f"metric/{n}"]) for n in streaming}
        if strategy.size > 1:
            reducer = strategy.reducer
            sums = reducer.allreduce("hostreduce.eval.sums", sums, op="sum")
            for i, name in enumerate(sorted(keras_metrics)):
                for j, var in enumerate(keras_metrics[name].variables):
                    value = var.numpy()
                    if np.issubdtype(value.dtype, np.number):
                        total = reducer.allreduce(f"hostreduce.eval.m{i}.{j}", value, op="sum")
                        var.assign(np.reshape(total, value.shape))
            for key, var in sorted(local_vars, key=lambda kv: kv[0]):
                value = var.numpy()
                if np.issubdtype(value.dtype, np.number):
                    total = reducer.allreduce(f"hostreduce.eval.local.{key}", value, op="sum")
                    var.assign(np.reshape(total, value.shape))
        if streaming and (strategy.size > 1 or not latest):
            # Every worker now holds the state of all workers' batches: a step on an
            # empty batch changes no state and returns the metrics' values for it.
            outputs = program.call(*program.empty_batch())
            latest = {n: float(outputs[f"metric/{n}"]) for n in streaming}
        count = max(sums[-1], 1.0)
        results = {n.split("/", 1)[-1]: float(sums[k] / count) for k, n in enumerate(names)}
        results.update(latest)
        for name, metric in keras_metrics.items():
            results[name] = float(np.asarray(metric.result()))
        results["global_step"] = self._global_step
        self._eval_summaries.scalars(self._global_step, {k: v for k, v in results.items() if k != "global_step"})
        return results

    # -- predict ---------------------------------------------------------------
    def _assign_checkpoint(self, path: str) -> None:
        """Set the variables (and ``global_step``) from the checkpoint at ``path``."""
        if self._checkpoints is None:
            raise ConfigError("`checkpoint_path` names a checkpoint of `model_dir`: give the Estimator a model_dir. "
                              f"Received: checkpoint_path={path!r}, model_dir=None")
        directory = os.path.dirname(path) if os.path.basename(path) == "variables" else path
        step, arrays, _ = self._checkpoints.load(directory)
        arrays = with_ps_tables(self._checkpoints, step, arrays, [k for k, _ in self._store.items()])
        for key, var in self._store.items():
            if key in arrays:
                var.assign(arrays[key])
        self._global_step = step
        progress("Evaluating checkpoint %s (step %d)", directory, step)

    def predict(self, input_fn: Callable[..., Any], predict_keys: list[str] | None = None,
                yield_single_examples: bool = True) -> Iterator[Any]:
        """Yield predictions for ``input_fn``'s data (this worker's shard), one example at
        a time (or one batch at a time with ``yield_single_examples=False``)."""
        dataset = self._dataset(input_fn, ModeKeys.PREDICT)
        program = self._program(ModeKeys.PREDICT, dataset.element_spec)
        for element in dataset:
            features, labels = split_element(element, ModeKeys.PREDICT)
            out = program.call(features, labels)
            if isinstance(out, dict):
                out = {k: np.asarray(v) for k, v in out.items() if predict_keys is None or k in predict_keys}
                if not yield_single_examples:
                    yield out
                    continue
                n = len(next(iter(out.values())))
                for i in range(n):
                    yield {k: v[i] for k, v in out.items()}
            else:
                out = np.asarray(out)
                yield from (out if yield_single_examples else [out])

    # -- export ----------------------------------------------------------------
    def export_saved_model(self, export_dir_base: str, serving_input_receiver_fn: Callable[[], Any] | None = None
                           ) -> str | None:
        """Write a SavedModel serving ``model_fn``'s predictions; return its path.

        As ``tf.estimator.Estimator.export_saved_model``, the export goes to a new
        ``export_dir_base/<timestamp>`` directory, with the current variables (a fresh
        Estimator takes those of the latest checkpoint in ``model_dir``) and one
        signature, ``serving_default``: ``model_fn`` in ``PREDICT`` mode, returning its
        ``predictions`` (a dict, or one tensor under the key ``output``). Its inputs
        are named after the features' keys (one tensor: ``features``).

        Args:
            export_dir_base: the directory that receives the timestamped export.
            serving_input_receiver_fn: a callable with no arguments returning the
                features' ``tf.TensorSpec`` (or a flat dict of them; batch dimension
                None). TensorFlow 2 has no placeholders, so this replaces
                ``tf.estimator``'s ``ServingInputReceiver``. None: the features of the
                last ``input_fn`` this Estimator ran, with the batch dimension free.

        Only the chief writes (other workers return None); no collective is involved.
        """
        if not self._strategy.is_chief:
            return None
        spec = features_spec(serving_input_receiver_fn, self._features_spec)
        program = PredictProgram(self.model_fn, self.params, self.config, self._store, (spec, None), self._timeline)
        self._excluded_keys.update(self._store.local_keys())
        new = [(k, v) for k, v in self._store.unsynced() if k not in self._excluded_keys]
        if new:
            self._ckpt.restore_latest(new)  # left unsynced: a later train() broadcasts them
        variables = [v for k, v in self._store.items() if k not in self._excluded_keys]
        path = write_saved_model(program.function, spec, variables, export_dir_base)
        progress("Exported a SavedModel to %s", path)
        return path

    def close(self) -> None:
        """Flush the timeline and summaries and release the strategy's reducer."""
        self._ckpt.flush()
        self._timeline.flush()
        self._summaries.close()
        self._eval_summaries.close()
        self._strategy.close()


def _run_eagerly_outside_functions() -> None:
    """Scripts written for ``tf.estimator`` often begin with
    ``tf.compat.v1.disable_eager_execution()``: ``tf.estimator`` built ``model_fn`` into
    a TF1 graph and ran it in a session. This Estimator traces ``model_fn`` into a
    ``tf.function`` (graph semantics all the same) and drives it eagerly, so it turns
    eager execution back on, which TensorFlow allows while no TF1 graph was built."""
    import tensorflow as tf

    if tf.executing_eagerly():  # (asking about outer contexts would build the global TF1 graph)
        return
    try:
        tf.compat.v1.enable_eager_execution()
    except ValueError as exc:
        raise ConfigError(
            "hostreduce's Estimator runs model_fn as a tf.function, with eager execution on outside it; "
            "tf.compat.v1.disable_eager_execution() was called and a TF1 graph was built since, so it cannot be "
            "turned back on. Remove the disable_eager_execution() call, or make the Estimator before building any "
            f"graph. Received: eager execution disabled ({exc})") from None
    logger.info("Eager execution was disabled (tf.compat.v1.disable_eager_execution()); the Estimator turned it "
                "back on: model_fn still runs as a graph, inside a tf.function")

