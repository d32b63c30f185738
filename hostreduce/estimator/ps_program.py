"""The training step with parameter servers: ``model_fn`` traced as for the ring, but its
``host_call`` is not run here; the ps apply its gradients.

``host_call`` is read once (``ps_training/capture.py``): which variable each of its tensors
updates and with which optimizer; the chief registers those variables, with their
values, and that optimizer on the ps. Each step then:

1. pulls the variables into this worker's TF variables: dense ones whole; a variable
   whose gradient is an ``IndexedSlices`` (an embedding table) only at the rows the
   batch looks up, found by a second traced function that computes just the lookup's
   indices from the batch (its outputs do not depend on the rest of the step), or read
   from the batch with numpy when they are features as they are (``ps_training/direct_ids.py``);
   all in one call per ps;
2. runs forward and backward on the device;
3. pushes the gradients, an embedding's as (indices, rows), and waits (sync) until the
   ps applied the step.

A table the ps shard by rows is, on a worker, a row cache (``ps_training/rowcache.py``) that
holds the batch's rows only: step 1 fills it, the lookups in the step read it, and the
gradient's cache slots are turned back into global row ids before the push; evaluation
and prediction on a worker fill it the same way (:meth:`PSTrainProgram.feed`). Its
initial value is computed once, on the chief, to register it; no worker holds it whole
unless ``get_variables()`` asks for it.

The worker's other TF variables are a copy: checkpoints and the end of ``train()`` pull
them whole first, so evaluation, prediction and the chief's checkpoint see the ps's
values. The ps shards (values, slots) are saved with the chief's checkpoint: shards
first, then the checkpoint, then the ps index, so a restore finds both of one step;
the sharded tables are in the ps shards only.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import SpecError
from ..ps_training.capture import capture_updates, host_optimizer_config
from ..host.gradients import recording, sparse_gradients
from ..ps_training.direct_ids import feature_sources, read_ids
from ..ps_training.rowcache import row_caches, shard_tables
from ..progress import logger, progress
from .mode_keys import ModeKeys
from .programs import as_output, ProgramBase
from .spec import check_host_call

__all__ = ["PSTrainProgram", "PS_DIR"]

PS_DIR = "ps"  # the ps shards' checkpoints, under model_dir


class PSTrainProgram(ProgramBase):
    """One worker's training step against the parameter servers of ``strategy``."""

    mode = ModeKeys.TRAIN

    def __init__(self, *args: Any, strategy: Any) -> None:
        super().__init__(*args)
        self.strategy = strategy
        self.keys: list[str] = []          # per host_call tensor: the variable's store key
        self.sparse: list[bool] = []       # per host_call tensor: an IndexedSlices (rows)
        self.optimizer_config: dict[str, Any] = {}
        self.step = 0                      # the ps's step (sync); this worker's (async)
        self._vars: dict[str, Any] = {}
        self._model_dir: str | None = None
        self._keep = 3
        self._optimizers: list[Any] = []
        self._direct: dict[str, Any] | None = None  # lookup ids read from the batch (ps_training/direct_ids.py)
        shard_tables(self.store, len(strategy.cluster.ps_addresses), strategy.shard_bytes)
        self.function = self._trace(self._step)
        self.caches = row_caches(self.store)
        self._check_caches()
        self.ids_function = self._trace(self._ids) if any(self.sparse) else None
        self.optimizer_config = host_optimizer_config(self._optimizers, strategy.sparse)

    def _check_caches(self) -> None:
        sparse = {k for k, s in zip(self.keys, self.sparse) if s}
        for key, cache in self.caches.items():
            if key not in sparse:
                how = "is not trained through `host_call`" if key not in self.keys else "receives a dense gradient"
                raise SpecError(
                    f"Variable {key!r} of shape {list(cache.full_shape)} is split by rows over the parameter servers "
                    f"(it has at least shard_bytes={self.strategy.shard_bytes} bytes), so a worker reads only its "
                    f"rows, through row lookups (tf.gather, tf.nn.embedding_lookup, Embedding layers); it {how}. "
                    "Raise `shard_bytes` of ParameterServerStrategy to keep it whole")

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
            outputs["train_op"] = as_output(spec.train_op)
        for i, t in enumerate(tensors):
            if isinstance(t, tf.IndexedSlices):
                outputs[f"ids{i}"], outputs[f"rows{i}"] = t.indices, t.values
            else:
                outputs[f"grad{i}"] = tf.convert_to_tensor(t)
        return outputs

    def _ids(self, features: Any, labels: Any) -> dict[str, Any]:
        import tensorflow as tf

        caches = list(self.caches.values())
        for cache in caches:
            cache.looked_up = []
        _, tensors = self._model(features, labels)
        out = {f"ids{i}": tensors[i].indices for i, (key, s) in enumerate(zip(self.keys, self.sparse))
               if s and key not in self.caches}
        for j, cache in enumerate(caches):  # the global ids the row caches were asked for
            if cache.looked_up:
                out[f"lookups{j}"] = tf.concat([tf.reshape(ids, [-1]) for ids in cache.looked_up], axis=0)
        return out

    def _lookup_ids(self, features: Any, labels: Any) -> dict[str, Any]:
        """The step's lookup ids by output name: read from the batch when they are
        features as they are (``ps_training/direct_ids.py``), else from ``ids_function``."""
        import tensorflow as tf

        if self._direct is None:
            outputs = list(self.ids_function.get_concrete_function().structured_outputs)
            self._direct = feature_sources(self.ids_function, outputs) or {}
        if self._direct:
            return read_ids(self._direct, tf.nest.flatten([features, labels] if self.has_labels else [features]))
        return self._call(self.ids_function, features, labels)

    def _call(self, function: Any, features: Any, labels: Any) -> Any:
        return function(features, labels) if self.has_labels else function(features)

    # -- the job ---------------------------------------------------------------------
    def connect(self, global_step: int, model_dir: str | None, keep: int) -> int:
        """Register the variables on the ps (the chief, restoring the ps shards of the
        checkpoint at ``global_step`` before it opens them to the other workers); return
        the ps's step, which every worker starts from."""
        strategy = self.strategy
        self._vars = dict(self.store.items())
        self._model_dir, self._keep = model_dir, keep
        client = strategy.job.client
        if strategy.is_chief:
            values = {key: self.caches[key].initial_value_numpy() if key in self.caches else self._vars[key].numpy()
                      for key in self.keys}
            client.register(values, self.optimizer_config, shard_bytes=strategy.shard_bytes, step=global_step,
                            hold=True, model_dir=model_dir)
            del values
            if global_step and model_dir:
                self._restore_shards(global_step)
            client.open()
        for cache in self.caches.values():
            cache.initial = None  # the ps hold the table now
        client.wait_ready()
        self.step = int(client.info()["step"])
        return self.step

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
        """Every variable on the ps but the sharded tables, whole, into this worker's TF
        variables."""
        values = self.strategy.job.client.pull([k for k in self.keys if k not in self.caches])
        for key, value in values.items():
            self._vars[key].assign(value)

    def pull_tables(self) -> dict[str, np.ndarray]:
        """The sharded tables, whole, from the ps (a full copy each: asked for explicitly)."""
        return self.strategy.job.client.pull(list(self.caches)) if self.caches else {}

    def feed(self, program: Any, features: Any, labels: Any) -> None:
        """Before ``program`` (evaluation, prediction) runs on a batch: the rows it looks up
        into the row caches, pulled from the ps as a training step does."""
        if self.caches:
            found = program.lookups(list(self.caches.values()))(features, labels)
            self._fill({key: np.unique(np.asarray(found[f"lookups{j}"], np.int64))
                        for j, key in enumerate(self.caches)})

    def _fill(self, ids: dict[str, np.ndarray], rows: dict[str, np.ndarray] | None = None) -> None:
        """The rows at ``ids`` (sorted, distinct), pulled from the ps unless given as
        ``rows``, into the row caches, or into the worker's variable of a table it holds
        whole."""
        import tensorflow as tf

        if rows is None:
            rows = self.strategy.job.client.pull_rows(ids)
        for key, value in rows.items():
            if key in self.caches:
                self.caches[key].fill(ids[key], value)
            else:
                self._vars[key].scatter_update(tf.IndexedSlices(value, ids[key]))

    def finish(self) -> None:
        """End of ``train()``: this worker's variables hold the ps's values; in sync mode
        every worker has ended its steps before any goes on. (The chief ends the job only
        once the other workers' processes have ended: ``hostreduce.ps.job``.)"""
        self.pull_all()
        if self.strategy.sync and self.strategy.size > 1:
            self.strategy.reducer.barrier()

    def before_save(self, step: int) -> None:
        """The chief, before its checkpoint of ``step``: the ps write their shards, and
        the TF variables take the ps's values (what the checkpoint holds), both of one
        consistent point of every ps (``PSClient.cut``: in async mode the applies pause
        while the values are pulled and the shards snapshot)."""
        if not self._model_dir:
            self.pull_all()
            return
        client = self.strategy.job.client
        values = client.cut(step, [k for k in self.keys if k not in self.caches])
        for key, value in values.items():
            self._vars[key].assign(value)
        client.save(os.path.join(self._model_dir, PS_DIR), step, publish=False)

    def after_save(self, step: int) -> None:
        if self._model_dir:
            self.strategy.job.client.publish(os.path.join(self._model_dir, PS_DIR), step, keep=self._keep)

    # -- one step --------------------------------------------------------------------
    def run(self, features: Any, labels: Any, timeout: float | None = None) -> float:
        """One training step; returns this worker's loss."""
        client = self.strategy.job.client
        ids: dict[str, np.ndarray] = {}
        if self.ids_function is not None:
            found = self._lookup_ids(features, labels)
            for name, key in [(f"ids{i}", k) for i, (k, s) in enumerate(zip(self.keys, self.sparse)) if s] + \
                    [(f"lookups{j}", k) for j, k in enumerate(self.caches)]:
                if name in found:
                    ids[key] = np.unique(np.concatenate([ids.get(key, np.zeros(0, np.int64)),
                                                         np.asarray(found[name], np.int64).reshape(-1)]))
        dense = [k for k, s in zip(self.keys, self.sparse) if not s]
        if ids:
            rows, values = client.pull_step(ids, dense)  # one round trip for both
            self._fill(ids, rows)
        else:
            values = client.pull(dense) if dense else {}
        for key, value in values.items():
            self._vars[key].assign(value)
        outputs = self._call(self.function, features, labels)
        grads = {self.keys[i]: outputs[f"grad{i}"].numpy() for i, s in enumerate(self.sparse) if not s}
        slices = {}
        for i, key in enumerate(self.keys):
            if self.sparse[i]:
                ids = outputs[f"ids{i}"].numpy()
                slices[key] = (self.caches[key].to_global(ids) if key in self.caches else ids,
                               outputs[f"rows{i}"].numpy())
        # Async too: the step tells the ps how far the job got (the chief saves only there).
        client.push(grads, slices, step=self.step + 1)
        self.step += 1
        return float(outputs["loss"])
