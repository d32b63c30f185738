"""TF1 optimizers (``tf.compat.v1.train.*Optimizer``) inside the functions hostreduce
traces: ``model_fn`` on the device and ``host_call`` on the host.

A TF1 optimizer cannot take Keras 3 variables as they are: it reaches into
``tf.Variable`` internals that a Keras 3 variable (a wrapper around a ``tf.Variable``)
does not have, and its ``compute_gradients`` would build ``tf.gradients`` of the loss
instead of using the tape that records ``model_fn``. Inside :func:`tf1_optimizer_scope`
the optimizer's public methods are routed through this module:

- ``compute_gradients`` takes the gradients from the recording tape, exactly like
  :func:`hostreduce.compute_gradients` (so each is handed off as the backward pass
  produces it), and pairs them with the caller's own variable objects.
- ``apply_gradients`` gives TensorFlow's implementation the ``tf.Variable`` behind each
  variable. Slots (and Adam's beta powers) are created by TensorFlow's code under the
  variable creator in scope, the Estimator's ``VariableStore``: they live on the host
  with ``variables_on_host``, and are checkpointed and restored with the model.
- ``get_global_step``/``get_or_create_global_step`` give one ``global_step`` variable
  held like the others (TensorFlow's own cannot be made inside a traced function).
- ``minimize`` is the two together. Inside ``model_fn`` with several workers, as under
  ``tf.estimator`` with a multi-worker ``train_distribute``, the update is not made
  there: ``apply_gradients`` (and so ``minimize``) leaves it, with its gradients, in the
  block's context (``host_call``), and the Estimator hands the gradients off as the
  backward pass produces them, averages them over the workers and runs the update on
  the host, as for an explicit ``EstimatorSpec(host_call=...)``. (An Estimator without
  ``train_distribute`` trains alone: there they run in place, and an optimizer wrapped
  in ``hvd.DistributedOptimizer`` averages over the Horovod job by itself.)

Outside the block every call reaches TensorFlow unchanged.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from ..errors import ConfigError, SpecError
from .kerases import loaded_kerases, underlying_variable
from .patch import routed
from .gradients import gradients_or_none, recorded_variables

__all__ = ["tf1_optimizer_scope", "MODEL_FN", "HOST_CALL"]

MODEL_FN = "model_fn"
HOST_CALL = "host_call"

_local = threading.local()

_HOST_CALL_HINT = (
    "Take the gradients in `model_fn` with `grads_and_vars = optimizer.compute_gradients(loss, var_list=variables)` "
    "and apply them on the host: `EstimatorSpec(..., host_call=(lambda *grads: "
    "optimizer.apply_gradients(zip(grads, variables)), [g for g, _ in grads_and_vars]))`. (An optimizer "
    "wrapped in hostreduce.horovod.DistributedOptimizer averages by itself: with it, leave RunConfig's "
    "train_distribute unset, as Horovod's Estimator example does)"
)


@contextlib.contextmanager
def tf1_optimizer_scope(place: str, workers: int = 1) -> Iterator[_Context]:
    """Route ``tf.compat.v1.train.Optimizer`` methods through this module in this block.

    Args:
        place: ``"model_fn"`` (the device step, where the recording tape is) or
            ``"host_call"`` (the host step, after the all-reduce).
        workers: how many workers train together; above 1, updates inside
            ``model_fn`` are refused.
    """
    import tensorflow as tf

    if place not in (MODEL_FN, HOST_CALL):
        raise ConfigError(f"`place` must be {MODEL_FN!r} or {HOST_CALL!r}. Received: place={place!r}")
    train = tf.compat.v1.train
    previous = getattr(_local, "context", None)
    context = _local.context = _Context(place, workers)
    try:
        with contextlib.ExitStack() as stack:
            for name, route in _ROUTES.items():
                stack.enter_context(routed(train.Optimizer, name, route))
            for name in ("get_global_step", "get_or_create_global_step", "create_global_step"):
                stack.enter_context(routed(train, name, _global_step))
            if place == MODEL_FN and workers > 1:  # a Keras optimizer's update, too, runs on the host
                for package in loaded_kerases():
                    stack.enter_context(routed(package.optimizers.Optimizer, "apply_gradients", _keras_apply))
            yield context
    finally:
        _local.context = previous


class _Context:
    """What the block saw: with several workers, ``host_call`` is the update that
    ``model_fn`` asked for (``minimize``/``apply_gradients``), to run on the host after
    the all-reduce, as ``(fn, gradients)``."""

    def __init__(self, place: str, workers: int) -> None:
        self.place, self.workers = place, workers
        self.global_step: Any = None
        self.host_call: tuple[Any, list[Any]] | None = None


def _context() -> _Context:
    return getattr(_local, "context", None) or _Context(HOST_CALL, 1)


def _workers_updating_in_model_fn() -> int:
    """How many workers would each update with their own gradients: the number of
    workers inside ``model_fn`` with more than one, else 0 (an update is fine)."""
    context = _context()
    return context.workers if context.place == MODEL_FN and context.workers > 1 else 0


def _global_step(original: Any, graph: Any = None) -> Any:
    """``tf.compat.v1.train.get_global_step()`` and friends: one int64 variable named
    ``global_step``, made by the variable creator in scope, so model_fn and host_call
    share it and checkpoints hold it. As in TF1 it counts the ``apply_gradients`` /
    ``minimize`` calls that are given it as ``global_step``."""
    import tensorflow as tf

    context = _context()
    if context.global_step is None:
        with tf.compat.v1.get_default_graph().name_scope(None):  # the same key wherever it is asked for
            context.global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
    return context.global_step


def _tf_variable(variable: Any, argument: str) -> Any:
    target = underlying_variable(variable)
    if target is None:
        raise SpecError(
            f"`{argument}` must hold variables (tf.Variable or Keras variables). "
            f"Received: {type(variable).__name__} {variable!r:.80}"
        )
    return target


def _compute_gradients(original: Any, self: Any, loss: Any, var_list: Any = None, gate_gradients: Any = None,
                       aggregation_method: Any = None, colocate_gradients_with_ops: bool = False,
                       grad_loss: Any = None) -> list[tuple[Any, Any]]:
    # gate_gradients, aggregation_method and colocate_gradients_with_ops shape a TF1
    # graph's gradient ops; a tape's gradients are already gated per op.
    import tensorflow as tf

    if callable(loss):
        loss = loss()
    if var_list is None:
        var_list = recorded_variables()
        if var_list is None:
            raise SpecError(
                "`compute_gradients(loss)` without `var_list` means every trainable variable the loss read, which "
                "is known only inside `model_fn` in training mode. Pass `var_list=model.trainable_variables`"
            )
    else:
        var_list = tf.nest.flatten(var_list)
    if not var_list:
        raise SpecError("`var_list` must be a non-empty list of variables. Received: var_list=[]")
    for variable in var_list:
        _tf_variable(variable, "var_list")
    grads = gradients_or_none(loss, var_list, output_gradients=grad_loss)
    return list(zip(grads, var_list))


def _apply_gradients(original: Any, self: Any, grads_and_vars: Any, global_step: Any = None, name: Any = None,
                     *args: Any, **kwargs: Any) -> Any:
    if _workers_updating_in_model_fn():
        return _apply_on_host(self, grads_and_vars, global_step, name, args, kwargs)
    pairs = [(grad, _tf_variable(var, "grads_and_vars")) for grad, var in grads_and_vars]
    if global_step is not None:
        global_step = _tf_variable(global_step, "global_step")
    return original(self, pairs, global_step, name, *args, **kwargs)


def _apply_on_host(optimizer: Any, grads_and_vars: Any, global_step: Any, name: Any, args: Any, kwargs: Any) -> Any:
    """``apply_gradients`` inside ``model_fn`` with several workers, as ``tf.estimator``
    ran it under a multi-worker strategy: the gradients are handed off as the backward
    pass produces them, averaged over the workers, and the update runs on the host, as
    an explicit ``host_call`` would (the Estimator takes this one when ``model_fn``
    gave none). What ``model_fn`` gets back is a no-op standing for the update."""
    variables, grads = _left_for_host(optimizer, grads_and_vars)

    def apply(*reduced: Any) -> Any:
        return optimizer.apply_gradients(list(zip(reduced, variables)), global_step, name, *args, **kwargs)

    return _record(apply, grads)


def _keras_apply(original: Any, self: Any, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
    """A Keras optimizer's ``apply_gradients`` inside ``model_fn`` with several workers:
    left for the host as :func:`_apply_on_host` does (its other arguments go with it)."""
    variables, grads = _left_for_host(self, grads_and_vars)

    def apply(*reduced: Any) -> Any:
        return self.apply_gradients(list(zip(reduced, variables)), *args, **kwargs)

    return _record(apply, grads)


def _left_for_host(optimizer: Any, grads_and_vars: Any) -> tuple[list[Any], list[Any]]:
    import tensorflow as tf

    if _context().host_call is not None:
        raise SpecError(f"`{type(optimizer).__name__}.apply_gradients` (or `minimize`) was called twice inside "
                        f"`model_fn`: with several workers one update per step can run on the host. {_HOST_CALL_HINT}")
    pairs = [(grad, var) for grad, var in grads_and_vars if grad is not None]
    if not pairs:
        raise SpecError("`grads_and_vars` has no gradient: no variable is connected to the loss.")
    for _, variable in pairs:
        _tf_variable(variable, "grads_and_vars")
    return [var for _, var in pairs], [tf.convert_to_tensor(grad) for grad, _ in pairs]  # IndexedSlices: dense


def _record(apply: Any, grads: list[Any]) -> Any:
    import tensorflow as tf

    _context().host_call = (apply, grads)
    return tf.no_op(name="update_on_host")


def _minimize(original: Any, self: Any, loss: Any, *args: Any, **kwargs: Any) -> Any:
    # TensorFlow's minimize calls self.compute_gradients and self.apply_gradients,
    # which this block routes (with several workers, the update then runs on the host).
    return original(self, loss, *args, **kwargs)


def _get_slot(original: Any, self: Any, var: Any, name: str) -> Any:
    target = underlying_variable(var)
    return original(self, var if target is None else target, name)


_ROUTES = {
    "compute_gradients": _compute_gradients,
    "apply_gradients": _apply_gradients,
    "minimize": _minimize,
    "get_slot": _get_slot,
}
