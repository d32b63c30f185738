"""Gradients of the collectives, as Horovod defines them, so that a loss computed from
a collective's result can be differentiated (eagerly, in ``tf.function`` and in TF1
graphs):

* all-reduce: the upstream gradient all-reduced with the same op and scale factors;
* all-gather: the upstream gradient averaged over the set, then this rank's rows;
* broadcast: the upstream gradient averaged over the set on the root, zeros elsewhere;
* all-to-all: the upstream gradient sent back along the received splits;
* reduce-scatter: the upstream gradient all-gathered (times the set's size for Sum,
  times the scale factors).

The gradient's own collectives are named like any unnamed collective: every rank builds
(or runs) the backward pass in the same order.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

__all__ = ["differentiable", "differentiable_group"]


def _floating(tensor: Any) -> bool:
    import tensorflow as tf

    return isinstance(tensor, (tf.Tensor, tf.Variable)) and tensor.dtype.is_floating


def differentiable(tensor: Any, forward: Callable[[Any], Any], backward: Callable[[Any, Any], Any]) -> Any:
    """``forward(tensor)`` with ``backward(x, upstream) -> gradient of x`` as its gradient
    (only floating-point tensors are differentiable; others run ``forward`` as is)."""
    import tensorflow as tf

    if not _floating(tensor):
        return forward(tensor)

    @tf.custom_gradient
    def run(x: Any) -> Any:
        @tf.autograph.experimental.do_not_convert
        def grad(upstream: Any) -> Any:
            return backward(x, upstream)

        return forward(x), grad

    return run(tf.convert_to_tensor(tensor) if isinstance(tensor, tf.Variable) else tensor)


def differentiable_group(tensors: Sequence[Any], forward: Callable[[list[Any]], list[Any]],
                         backward: Callable[[list[Any]], list[Any]]) -> list[Any]:
    """``forward(tensors)`` with ``backward(upstreams)`` as the gradient of the whole group
    (when every tensor is a floating-point tensor; otherwise ``forward`` as is)."""
    import tensorflow as tf

    tensors = list(tensors)
    if not tensors or not all(_floating(t) for t in tensors):
        return forward(tensors)

    @tf.custom_gradient
    def run(*xs: Any) -> Any:
        @tf.autograph.experimental.do_not_convert
        def grad(*upstreams: Any) -> Any:
            return backward(list(upstreams))

        return forward(list(xs)), grad

    return list(run(*[tf.convert_to_tensor(t) if isinstance(t, tf.Variable) else t for t in tensors]))
