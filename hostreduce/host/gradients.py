"""Device-side gradients for ``model_fn``: :func:`compute_gradients`.

The runner records the forward pass of ``model_fn`` on a ``tf.GradientTape`` and
installs it here for the duration of the call, so a ``model_fn`` written in the
TF1 style (``loss`` first, gradients afterwards) needs no tape of its own.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Sequence

from ..errors import SpecError

__all__ = ["compute_gradients", "recording", "gradient_labels"]

_state = threading.local()


@contextlib.contextmanager
def recording(tape: Any) -> Iterator[None]:
    """Make ``tape`` the one :func:`compute_gradients` uses inside this block."""
    previous = getattr(_state, "tape", None), getattr(_state, "labels", None)
    _state.tape, _state.labels = tape, {}
    try:
        yield
    finally:
        _state.tape, _state.labels = previous


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
    if loss is None:
        raise SpecError("`loss` must be a scalar tensor. Received: loss=None")
    tape = getattr(_state, "tape", None)
    if tape is not None:
        with tape.stop_recording():
            grads = tape.gradient(loss, variables)
    elif tf.inside_function():
        grads = tf.gradients(loss, [getattr(v, "value", v) for v in variables])
    else:
        raise SpecError(
            "`compute_gradients` must be called inside a `model_fn` run by an Estimator "
            "(or inside a tf.function). Received: a call in eager mode without a tape"
        )
    out = []
    for grad, var in zip(grads, variables):
        if grad is None:
            if unconnected == "error":
                raise SpecError(
                    f"No gradient for variable {variable_name(var)!r}: it does not affect the loss. "
                    "Remove it from `variables` or pass `unconnected='zero'`"
                )
            grad = tf.zeros(var.shape, dtype=var.dtype)
        if isinstance(grad, tf.IndexedSlices):
            grad = tf.convert_to_tensor(grad)
        out.append(grad)
    labels = getattr(_state, "labels", None)
    if labels is not None:
        labels.update({id(g): variable_name(v) for g, v in zip(out, variables)})
    return out
