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

    Attributes:
        mode: a :class:`ModeKeys` value.
        loss: scalar loss of this worker's local batch (required in TRAIN and EVAL).
        train_op: a tensor evaluated every training step (e.g. ``tf.identity(loss)``).
        host_call: ``(fn, tensors)``: ``tensors`` (typically gradients) are averaged
            across workers on the host, then ``fn(*tensors)`` runs on the host (e.g.
            ``optimizer.apply_gradients``). Required in TRAIN mode with several workers.
        predictions: a tensor or dict of tensors (required in PREDICT mode).
        eval_metric_ops: dict of name -> Keras metric object (updated inside
            ``model_fn``) or scalar tensor; averaged across workers.
    """

    mode: str
    loss: Any = None
    train_op: Any = None
    host_call: Any = None
    predictions: Any = None
    eval_metric_ops: Any = None

    def validate(self) -> "EstimatorSpec":
        """Raise ``SpecError`` if the spec cannot run in its mode; return it otherwise."""
        mode = ModeKeys.check(self.mode)
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
