"""``EstimatorSpec``: what ``model_fn`` returns, validated with messages that say what
was expected and what was received."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from ..errors import SpecError
from .mode_keys import ModeKeys

__all__ = ["EstimatorSpec", "host_train_spec", "check_host_call"]


class EstimatorSpec(NamedTuple):
    """Ops and objects returned by ``model_fn``.

    The first five fields are in the order of ``tf.estimator.EstimatorSpec`` and
    Graphcore's ``IPUEstimatorSpec``; pass the others by keyword.

    Attributes:
        mode: a :class:`ModeKeys` value.
        predictions: a tensor or dict of tensors (required in PREDICT mode).
        loss: scalar loss of this worker's local batch (required in TRAIN and EVAL).
        train_op: a tensor evaluated every training step (e.g. ``tf.identity(loss)``).
        eval_metric_ops: dict of name -> Keras metric object (updated inside
            ``model_fn``), a ``tf.compat.v1.metrics`` ``(value, update_op)`` pair, or a
            scalar tensor; combined across workers (see ``Estimator.evaluate``).
        host_call: ``(fn, tensors)``: ``tensors`` (typically gradients) are averaged
            across workers on the host, then ``fn(*tensors)`` runs on the host (e.g.
            ``optimizer.apply_gradients``). Required in TRAIN mode with several workers.
        eval_metrics: ``(metric_fn, tensors)`` as in ``IPUEstimatorSpec``:
            ``metric_fn(*tensors)`` (or ``metric_fn(**tensors)`` for a dict) returns
            more ``eval_metric_ops``.
        export_outputs: kept for ``tf.estimator`` scripts; not used by the runner.
        training_chief_hooks, training_hooks, scaffold, evaluation_hooks,
        prediction_hooks: TensorFlow session objects; only None or empty is accepted
            (``Estimator.train(hooks=...)`` takes ``SessionRunHook`` objects).
    """

    mode: str
    predictions: Any = None
    loss: Any = None
    train_op: Any = None
    eval_metric_ops: Any = None
    host_call: Any = None
    eval_metrics: Any = None
    export_outputs: Any = None
    training_chief_hooks: Any = None
    training_hooks: Any = None
    scaffold: Any = None
    evaluation_hooks: Any = None
    prediction_hooks: Any = None

    def validate(self) -> "EstimatorSpec":
        """Raise ``SpecError`` if the spec cannot run in its mode; return it otherwise."""
        mode = ModeKeys.check(self.mode)
        for field in ("training_chief_hooks", "training_hooks", "scaffold", "evaluation_hooks", "prediction_hooks"):
            if getattr(self, field):
                raise SpecError(
                    f"`{field}` is not supported: TensorFlow session hooks and scaffolds have no place in "
                    f"hostreduce's runner (it runs TensorFlow 2 functions, not a session). Received: {field}="
                    f"{_short(getattr(self, field))}. Pass hooks to `Estimator.train(..., hooks=[...])` instead: "
                    "SessionRunHook objects or `fn(global_step, loss)` callables"
                )
        if self.eval_metrics is not None:
            self = self._replace(eval_metric_ops=_merged_metrics(self.eval_metric_ops, self.eval_metrics),
                                 eval_metrics=None)
        if mode in (ModeKeys.TRAIN, ModeKeys.EVAL) and self.loss is None:
            raise SpecError(f"EstimatorSpec in mode {mode!r} requires `loss`. Received: loss=None")
        if mode == ModeKeys.TRAIN and self.train_op is None and self.host_call is None:
            raise SpecError(
                "EstimatorSpec in mode 'train' requires `train_op` or `host_call`. "
                "Received: train_op=None, host_call=None"
            )
        if mode == ModeKeys.PREDICT and self.predictions is None:
            raise SpecError("EstimatorSpec in mode 'infer' requires `predictions`. Received: predictions=None")
        if self.host_call is not None:
            check_host_call(self.host_call)
        if self.eval_metric_ops is not None and not isinstance(self.eval_metric_ops, Mapping):
            raise SpecError(
                "`eval_metric_ops` must be a dict of name -> metric. "
                f"Received: eval_metric_ops of type {type(self.eval_metric_ops).__name__}"
            )
        return self


def _merged_metrics(eval_metric_ops: Any, eval_metrics: Any) -> dict[str, Any]:
    """``eval_metric_ops`` plus what ``metric_fn`` of ``eval_metrics=(metric_fn, tensors)`` returns."""
    if not isinstance(eval_metrics, (tuple, list)) or len(eval_metrics) != 2 or not callable(eval_metrics[0]):
        raise SpecError(
            "`eval_metrics` must be a pair (metric_fn, tensors) with `tensors` a list or dict. "
            f"Received: eval_metrics={_short(eval_metrics)}"
        )
    fn, tensors = eval_metrics
    more = fn(**tensors) if isinstance(tensors, Mapping) else fn(*tensors)
    if not isinstance(more, Mapping):
        raise SpecError(
            f"`eval_metrics` function {getattr(fn, '__name__', fn)!r} must return a dict of name -> metric. "
            f"Received: {type(more).__name__}"
        )
    merged = dict(eval_metric_ops or {})
    merged.update(more)
    return merged


def check_host_call(host_call: Any) -> tuple[Callable[..., Any], list[Any]]:
    """Validate ``host_call`` and return it as ``(fn, list_of_tensors)``."""
    if not isinstance(host_call, (tuple, list)) or len(host_call) != 2:
        raise SpecError(
            "`host_call` must be a pair (fn, tensors) with `fn` callable and `tensors` a list or tuple. "
            f"Received: host_call={_short(host_call)}"
        )
    fn, tensors = host_call
    if not callable(fn):
        raise SpecError(f"`host_call[0]` must be callable. Received: {type(fn).__name__} {_short(fn)}")
    if not isinstance(tensors, (list, tuple)):
        raise SpecError(
            f"`host_call[1]` must be a list or tuple of tensors. Received: {type(tensors).__name__}"
        )
    for i, t in enumerate(tensors):
        if t is None:
            raise SpecError(
                f"`host_call` tensor #{i} is None. A gradient is None when its variable does not "
                "affect the loss; `compute_gradients` names such variables"
            )
    try:
        inspect.signature(fn).bind(*range(len(tensors)))
    except TypeError:
        raise SpecError(
            f"`host_call` function {getattr(fn, '__name__', fn)!r} cannot take {len(tensors)} positional "
            f"arguments (one per tensor). Received: signature {_signature(fn)} with {len(tensors)} tensors"
        ) from None
    except ValueError:  # builtins without a signature: trust the caller
        pass
    return fn, list(tensors)


def _signature(fn: Any) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(?)"


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def host_train_spec(mode: str, loss: Any, optimizer: Any, variables: Sequence[Any], *, predictions: Any = None,
                    eval_metric_ops: Mapping[str, Any] | None = None) -> EstimatorSpec:
    """The ``EstimatorSpec`` of the usual host-offloaded training step, in one call.

    In TRAIN mode the gradients of ``loss`` are computed on the device, averaged across
    workers on the host and applied there by ``optimizer`` (fused kernels for Keras SGD
    and Adam). In other modes a plain spec with ``loss``/``predictions``/metrics.

    Args:
        mode: the ``mode`` passed to ``model_fn``.
        loss: scalar loss of the local batch.
        optimizer: a Keras optimizer.
        variables: the variables to train (e.g. ``model.trainable_variables``).
    """
    from ..host.apply import apply_gradients
    from ..host.gradients import compute_gradients

    mode = ModeKeys.check(mode)
    if mode != ModeKeys.TRAIN:
        return EstimatorSpec(mode, loss=loss, predictions=predictions, eval_metric_ops=eval_metric_ops)
    if loss is None:
        raise SpecError("EstimatorSpec in mode 'train' requires `loss`. Received: loss=None")
    import tensorflow as tf

    variables = list(variables)
    grads = compute_gradients(loss, variables)

    def host_apply(*reduced: Any) -> None:
        apply_gradients(optimizer, zip(reduced, variables))

    return EstimatorSpec(mode, loss=loss, train_op=tf.identity(loss), host_call=(host_apply, grads),
                         predictions=predictions, eval_metric_ops=eval_metric_ops)
