"""The training step with parameter servers: ``model_fn`` traced as for the ring, but its
``host_call`` is not run here; the ps apply its gradients.

``host_call`` is read once (``host/capture.py``): which variable each of its tensors
updates and with which optimizer; the chief registers those variables, with their
values, and that optimizer on the ps. Each step then:

1. pulls the variables into this worker's TF variables: dense ones whole; a variable
   whose gradient is an ``IndexedSlices`` (an embedding table) only at the rows the
   batch looks up, found by a second traced function that computes just the lookup's
   indices from the batch (the rest of the step is pruned from it);
2. runs forward and backward on the device;
3. pushes the gradients, an embedding's as (indices, rows), and waits (sync) until the
   ps applied the step.

The worker's TF variables are a cache: checkpoints and the end of ``train()`` pull every
variable whole first, so evaluation, prediction and the chief's checkpoint see the ps's
values. The ps shards (values, slots) are saved with the chief's checkpoint: shards
first, then the checkpoint, then the ps index, so a restore finds both of one step.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import SpecError
from ..host.capture import capture_updates, host_optimizer_config
from ..host.gradients import recording, sparse_gradients
from .mode_keys import ModeKeys
from .programs import _as_output, _ProgramBase
from .progress import logger, progress
from .spec import check_host_call

__all__ = ["PSTrainProgram", "PS_DIR"]

PS_DIR = "ps"  # the ps shards' checkpoints, under model_dir


class PSTrainProgram(_ProgramBase):
    """One worker's training step against the parameter servers of ``strategy``."""

    mode = ModeKeys.TRAIN

    def __init__(self, *args: Any, strategy: Any) -> None:
        super().__init__(*args)
        self.strategy = strategy
        self.keys: list[str] = []          # per host_call tensor: the variable's store key
        self.sparse: list[bool] = []       # per host_call tensor: an IndexedSlices (rows)
        self.optimizer_config: dict[str, Any] = {}
        self.step = 0                      # the ps's step (sync)
        self._vars: dict[str, Any] = {}
        self._model_dir: str | None = None
        self._keep = 3
        self._optimizers: list[Any] = []
        self.function = self._trace(self._step)
        self.ids_function = self._trace(self._ids) if any(self.sparse) else None
        self.optimizer_config = host_optimizer_config(self._optimizers, strategy.sparse)

    # -- tracing ---------------------------------------------------------------------
    def _model(self, features: Any, labels: Any) -> tuple[Any, list[Any]]:
        import tensorflow as tf

        with self.store.scope(), tf.GradientTape() as tape, recording(tape), sparse_gradients():
            spec = self._call_model_fn(features, labels)
        if spec.host_call is None:
            raise SpecError("EstimatorSpec in mode 'train' needs `host_call` with parameter servers: its gradients "
                            "are what the ps apply. Received: host_call=None")
        fn, tensors = check_host_call(spec.host_call)
        sparse = [isinstance(t, tf.IndexedSlices) for t in tensors]
        if not self.keys:
            updates = capture_updates(fn, len(tensors))
            for i in range(len(tensors)):
                key = self.store.key_of(updates.variables[i])
                if key is None:
                    raise SpecError(f"`host_call` tensor #{i} updates {updates.variables[i].name!r}, a variable "
                                    "`model_fn` did not create")
                self.keys.append(key)
            self.sparse = sparse
            self._optimizers = updates.optimizers  # read once the trace initialised their variables
        elif sparse != self.sparse:
            raise SpecError(f"`host_call` tensors changed between traces ({len(self.sparse)} -> {len(tensors)})")
        return spec, tensors

    def _step(self, features: Any, labels: Any) -> dict[str, Any]:
        import tensorflow as tf

        spec, tensors = self._model(features, labels)
        outputs = {"loss": tf.convert_to_tensor(spec.loss)}
        if spec.train_op is not None:
            outputs["train_op"] = _as_output(spec.train_op)
        for i, t in enumerate(tensors):
            if isinstance(t, tf.IndexedSlices):
                outputs[f"ids{i}"], outputs[f"rows{i}"] = t.indices, t.values
            else:
                outputs[f"grad{i}"] = tf.convert_to_tensor(t)
        return outputs

    def _ids(self, features: Any, labels: Any) -> dict[str, Any]:
        _, tensors = self._model(features, labels)
        return {f"ids{i}": tensors[i].indices for i, s in enumerate(self.sparse) if s}

    def _call(self, function: Any, features: Any, labels: Any) -> Any:
        return function(features, labels) if self.has_labels else function(features)

    # -- the job ---------------------------------------------------------------------
    def connect(self, global_step: int, model_dir: str | None, keep: int) -> None:
        """Register the variables on the ps (the chief, restoring the ps shards of the
        checkpoint at ``global_step``) and agree with every worker on the ps's step."""
        strategy = self.strategy
        self._vars = dict(self.store.items())
        self._model_dir, self._keep = model_dir, keep
        client = strategy.job.client
        if strategy.is_chief:
            values = {key: self._vars[key].numpy() for key in self.keys}
            client.register(values, self.optimizer_config, shard_bytes=strategy.shard_bytes, step=global_step)
            if global_step and model_dir:
                self._restore_shards(global_step)
        step = np.array([client.info()["step"] if strategy.is_chief else 0], np.int64)
        if strategy.size > 1:
            step = strategy.reducer.broadcast("hostreduce.ps.step", step, root=0)
        client.wait_ready()
        self.step = int(step[0])

    def _restore_shards(self, step: int) -> None:
        from ..ps import checkpoint

        client = self.strategy.job.client
        directory = os.path.join(self._model_dir or "", PS_DIR)
        index = checkpoint.read_index(directory)
        num_ps = client.placement.num_ps
        if (index is None or index["step"] != step) and all(
                os.path.exists(checkpoint.shard_path(directory, step, m, num_ps)) for m in range(num_ps)):
            client.publish(directory, step, keep=self._keep)  # the chief stopped before publishing them
            index = checkpoint.read_index(directory)
        if index is not None and index["step"] == step:
            client.restore(directory)
            progress("Restored the parameter servers' shards (values and optimizer slots) of step %d", step)
        else:
            logger.warning("No parameter-server checkpoint of step %d in %s: the ps start from the checkpoint's "
                           "variables with fresh optimizer slots", step, directory)

    def pull_all(self) -> None:
        """Every variable on the ps, whole, into this worker's TF variables."""
        values = self.strategy.job.client.pull(self.keys)
        for key, value in values.items():
            self._vars[key].assign(value)

    def finish(self) -> None:
        """End of ``train()``: this worker's variables hold the ps's values, and every
        worker is done with the ps before any goes on (the chief may end the job)."""
        self.pull_all()
        if self.strategy.size > 1:
            self.strategy.reducer.barrier()

    def before_save(self, step: int) -> None:
        """The chief, before its checkpoint of ``step``: the ps write their shards, and
        the TF variables take the ps's values (what the checkpoint holds)."""
        if self._model_dir:
            self.strategy.job.client.save(os.path.join(self._model_dir, PS_DIR), step, publish=False)
        self.pull_all()

    def after_save(self, step: int) -> None:
        if self._model_dir:
            self.strategy.job.client.publish(os.path.join(self._model_dir, PS_DIR), step, keep=self._keep)

    # -- one step --------------------------------------------------------------------
    def run(self, features: Any, labels: Any, timeout: float | None = None) -> float:
        """One training step; returns this worker's loss."""
        import tensorflow as tf

        client = self.strategy.job.client
        if self.ids_function is not None:
            found = self._call(self.ids_function, features, labels)
            ids = {}
            for i, sparse in enumerate(self.sparse):
                if sparse:
                    key = self.keys[i]
                    ids[key] = np.unique(np.concatenate([ids.get(key, np.zeros(0, np.int64)),
                                                         np.asarray(found[f"ids{i}"], np.int64).reshape(-1)]))
            rows = client.pull_rows(ids)
            for key, value in rows.items():
                self._vars[key].scatter_update(tf.IndexedSlices(value, ids[key]))
        dense = [k for k, s in zip(self.keys, self.sparse) if not s]
        if dense:
            for key, value in client.pull(dense).items():
                self._vars[key].assign(value)
        outputs = self._call(self.function, features, labels)
        grads = {self.keys[i]: outputs[f"grad{i}"].numpy() for i, s in enumerate(self.sparse) if not s}
        slices = {self.keys[i]: (outputs[f"ids{i}"].numpy(), outputs[f"rows{i}"].numpy())
                  for i, s in enumerate(self.sparse) if s}
        if self.strategy.sync:
            client.push(grads, slices, step=self.step + 1)
            self.step += 1
        else:
            client.push(grads, slices)
        return float(outputs["loss"])
