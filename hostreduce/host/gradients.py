"""Device-side gradients for ``model_fn``: :func:`compute_gradients`.

The runner records the forward pass of ``model_fn`` on a ``tf.GradientTape`` and
installs it here for the duration of the call, so a ``model_fn`` written in the
TF1 style (``loss`` first, gradients afterwards) needs no tape of its own.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Sequence

from ..errors import SpecError
from .kerases import underlying_variable

__all__ = ["compute_gradients", "gradients_or_none", "gradient_labels", "recorded_variables", "recording",
           "sparse_gradients"]

_state = threading.local()


@contextlib.contextmanager
def recording(tape: Any, loss_ready: Callable[[Any], Any] | None = None) -> Iterator[None]:
    """Make ``tape`` the one :func:`compute_gradients` uses inside this block.

    ``loss_ready(loss)``, when given, returns the backward pass's seed (ones like
    ``loss``) from an op that runs once the loss is computed: the timeline's boundary
    between the forward and backward passes. Without it, the backward pass starts from
    a constant seed and needs only the forward pass's activations, so it can begin
    before the loss itself is ready and no point in time separates the two passes.
    """
    previous = (getattr(_state, "tape", None), getattr(_state, "labels", None),
                getattr(_state, "loss_ready", None))
    _state.tape, _state.labels, _state.loss_ready = tape, {}, loss_ready
    try:
        yield
    finally:
        _state.tape, _state.labels, _state.loss_ready = previous


@contextlib.contextmanager
def sparse_gradients() -> Iterator[None]:
    """Inside this block gradients keep their ``tf.IndexedSlices`` form (an embedding
    lookup's rows) instead of being made dense: parameter servers take the rows."""
    previous = getattr(_state, "keep_sparse", False)
    _state.keep_sparse = True
    try:
        yield
    finally:
        _state.keep_sparse = previous


def gradient_labels() -> dict[int, str]:
    """``id(gradient) -> variable name`` for gradients made in the current recording
    (used to label the hand-off of each tensor in timelines)."""
    return dict(getattr(_state, "labels", None) or {})


def variable_name(variable: Any) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", None) or variable)


def compute_gradients(loss: Any, variables: Sequence[Any], unconnected: str = "error") -> list[Any]:
    """Gradients of ``loss`` with respect to ``variables``, computed on the device.

    Call it inside a ``model_fn`` run by :class:`hostreduce.estimator.Estimator`; hand
    the result to ``EstimatorSpec(host_call=(fn, grads))``.

    Args:
        loss: scalar loss tensor of this worker's local batch.
        variables: the variables to differentiate (e.g. ``model.trainable_variables``).
        unconnected: ``"error"`` raises ``SpecError`` naming a variable that does not
            affect ``loss``; ``"zero"`` returns zeros for it.

    Returns:
        One gradient tensor per variable, in the same order.
    """
    import tensorflow as tf

    if unconnected not in ("error", "zero"):
        raise SpecError(f"`unconnected` must be 'error' or 'zero'. Received: unconnected={unconnected!r}")
    variables = list(variables)
    if not variables:
        raise SpecError("`variables` must be a non-empty list of variables. Received: variables=[]")
    grads = gradients_or_none(loss, variables)
    out = []
    for grad, var in zip(grads, variables):
        if grad is None:
            if unconnected == "error":
                raise SpecError(
                    f"No gradient for variable {variable_name(var)!r}: it does not affect the loss. "
                    "Remove it from `variables` or pass `unconnected='zero'`"
                )
            grad = tf.zeros(var.shape, dtype=var.dtype)
            _label(grad, var)
        out.append(grad)
    return out


def recorded_variables() -> list[Any] | None:
    """The trainable variables the forward pass read so far (None without a tape):
    what TF1's ``var_list=None`` (all trainable variables) means inside ``model_fn``."""
    tape = getattr(_state, "tape", None)
    return None if tape is None else list(tape.watched_variables())


def gradients_or_none(loss: Any, variables: Sequence[Any], output_gradients: Any = None) -> list[Any]:
    """Dense gradients of ``loss`` for ``variables`` (None for a variable ``loss`` does
    not depend on), from the recording tape so each can be handed off as the backward
    pass produces it; labelled for the timeline."""
    import tensorflow as tf

    if loss is None:
        raise SpecError("`loss` must be a scalar tensor. Received: loss=None")
    variables = list(variables)
    tape = getattr(_state, "tape", None)
    loss_ready = getattr(_state, "loss_ready", None)
    if tape is not None:
        with tape.stop_recording():
            if loss_ready is not None and output_gradients is None:
                output_gradients = loss_ready(loss)
            grads = tape.gradient(loss, variables, output_gradients=output_gradients)
    elif tf.inside_function():
        sources = [v if underlying_variable(v) is None else underlying_variable(v) for v in variables]
        grads = tf.gradients(loss, sources, grad_ys=output_gradients)
    else:
        raise SpecError(
            "`compute_gradients` must be called inside a `model_fn` run by an Estimator "
            "(or inside a tf.function). Received: a call in eager mode without a tape"
        )
    if not getattr(_state, "keep_sparse", False):
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    for grad, var in zip(grads, variables):
        if grad is not None:
            _label(grad, var)
    return grads


def _label(grad: Any, variable: Any) -> None:
    labels = getattr(_state, "labels", None)
    if labels is not None:
        labels[id(grad)] = variable_name(variable)
