"""Horovod's ``DistributedOptimizer`` for a TensorFlow 1 optimizer
(``tf.compat.v1.train.Optimizer``): ``compute_gradients`` returns the gradients reduced
over the job, ``apply_gradients`` applies them with the wrapped optimizer; ``minimize``
does both. It runs in a TensorFlow 1 graph (a ``Session``, ``MonitoredTrainingSession``),
in ``tf.function`` and eagerly.

With ``backward_passes_per_step`` > 1 each pass's gradients are summed locally and the
sums reduced once per that many passes (:class:`hostreduce.ops.aggregation.LocalAggregation`);
``apply_gradients`` updates the variables only on those passes and otherwise only
increments ``global_step``, as Horovod does. Importing this module imports TensorFlow.
"""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from . import job as _engine
from .aggregation import LocalAggregation, ReduceSpec, reduce_some

__all__ = ["TF1DistributedOptimizer", "is_tf1_optimizer"]

_Base = tf.compat.v1.train.Optimizer


def is_tf1_optimizer(optimizer: Any) -> bool:
    return isinstance(optimizer, _Base)


class TF1DistributedOptimizer(_Base):
    """A ``tf.compat.v1.train.Optimizer`` that reduces the wrapped one's gradients."""

    def __init__(self, optimizer: Any, spec: ReduceSpec, name: str | None = None, use_locking: bool = False,
                 backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False) -> None:
        if name is None:
            name = f"Distributed{type(optimizer).__name__}"
        super().__init__(name=name, use_locking=use_locking)
        _engine.job()
        self._optimizer = optimizer
        self._hvd_spec = spec
        self.process_set = spec.process_set
        self.scale_local_gradients = spec.scale_local_gradients
        # ``_agg_helper``: Horovod's name for it.
        self._agg_helper = None if backward_passes_per_step == 1 else LocalAggregation(
            backward_passes_per_step, average_aggregated_gradients, spec, name=f"{name}_aggregation")

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local to this worker (not reduced; divided by the
        number of ranks when ``scale_local_gradients``)."""
        self._hvd_spec.register_local(var)

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        """The wrapped optimizer's ``compute_gradients``, reduced over the job (summed
        locally over ``backward_passes_per_step`` passes first)."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if self._agg_helper is not None:
            reduced = self._agg_helper.compute_gradients(grads, variables)
        else:
            reduced = reduce_some(self._hvd_spec, grads, variables)
        return list(zip(reduced, variables))

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None, name: str | None = None) -> Any:
        """The wrapped optimizer's ``apply_gradients``; with ``backward_passes_per_step``
        > 1 only on the passes that reduced (the others increment ``global_step``)."""
        pairs = list(grads_and_vars)
        if self._agg_helper is None:
            return self._optimizer.apply_gradients(pairs, global_step=global_step, name=name)

        def apply() -> Any:
            return self._optimizer.apply_gradients(pairs, global_step=global_step, name=name)

        def skip() -> Any:
            if global_step is None:
                return tf.no_op()
            return tf.compat.v1.assign_add(global_step, tf.constant(1, global_step.dtype.base_dtype)).op

        after = [g for g, _ in pairs if isinstance(g, (tf.Tensor, tf.Operation))]
        done = self._agg_helper.apply_gradients(apply, skip, after=after)
        return done if tf.executing_eagerly() else done.op

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)
