"""The optimizer update on the host, through TensorFlow's fused kernels where they
compute exactly what the Keras optimizer computes.

Keras 3 and tf_keras build SGD and Adam updates from several element-wise ops per variable;
``ResourceApplyGradientDescent``, ``ResourceApplyKerasMomentum`` and
``ResourceApplyAdam`` do the same arithmetic in one pass over memory. The kernels are
used only for configurations whose math they reproduce (no clipping, weight decay,
EMA, AMSGrad, gradient accumulation, loss scaling or constraints); anything else goes
through ``optimizer.apply_gradients``, as do steps with sparse (``IndexedSlices``)
gradients, whose slots Keras updates differently. A ``hostreduce.horovod`` optimizer
wrapper counts as the class it wraps.

Weights match Keras to float32 rounding (relative error ~3e-7). One difference is
inherent to the Adam kernel: it forms ``1 - beta_2`` in float32, and
``1 - float32(0.999) = 0.00099998713`` where Keras uses 0.001, so the second-moment
slot differs by ~1.3e-5 relative (an Adam with beta_2 = float32(0.999)). Pass
``RunConfig(fused_apply=False)`` for Keras's own arithmetic.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterable, Iterator

from .kerases import keras_of, loaded_kerases, underlying_variable
from .patch import routed

__all__ = ["apply_gradients", "fused_apply_supported", "fused_optimizer_scope", "fused_updates"]

_FLOAT_DTYPES = ("float32", "float64")


def _keras_kind(optimizer: Any) -> str | None:
    """"adam" or "sgd" for exactly Keras 3's or tf_keras's Adam/SGD (not subclasses)."""
    package = keras_of(optimizer)
    if package is None:
        return None
    # A hostreduce.horovod wrapper is a subclass made for the user's class: its update
    # is that class's.
    cls = getattr(type(optimizer), "_hostreduce_base", type(optimizer))
    if cls is package.optimizers.Adam:
        return "adam"
    if cls is package.optimizers.SGD:
        return "sgd"
    return None


def fused_apply_supported(optimizer: Any, variables: Iterable[Any] = ()) -> bool:
    """Whether :func:`apply_gradients` can use a fused kernel for ``optimizer``."""
    kind = _keras_kind(optimizer)
    if kind is None:
        return False
    if kind == "adam" and optimizer.amsgrad:
        return False
    if any(
        getattr(optimizer, attr, None)
        for attr in ("clipnorm", "clipvalue", "global_clipnorm", "weight_decay", "use_ema",
                     "gradient_accumulation_steps", "loss_scale_factor")
    ):
        return False
    for v in variables:
        if getattr(v, "constraint", None) is not None or getattr(v, "overwrite_with_gradient", False):
            return False
        dtype = getattr(v, "dtype", "")
        if str(getattr(dtype, "name", dtype)) not in _FLOAT_DTYPES:  # tf.DType (tf_keras) or str (Keras 3)
            return False
    return True


def _handle(variable: Any) -> Any:
    return underlying_variable(variable).handle


def _prepare(optimizer: Any, variables: list[Any]) -> Any:
    """Build ``optimizer``'s slots for ``variables`` if needed; return the learning
    rate of this step (before ``iterations`` is incremented)."""
    import tensorflow as tf

    if keras_of(optimizer).__name__ == "tf_keras":
        with tf.init_scope():
            optimizer.build(variables)  # a no-op once built
        optimizer._compute_current_learning_rate()  # schedules: lr(iterations)
        return optimizer.learning_rate
    if not optimizer.built:
        with keras_of(optimizer).name_scope(optimizer.name, caller=optimizer):
            optimizer.build(variables)
        optimizer.built = True
    return optimizer._get_current_learning_rate()


def _slot_index(optimizer: Any, variable: Any) -> int:
    if keras_of(optimizer).__name__ == "tf_keras":
        return optimizer._index_dict[optimizer._var_key(variable)]
    return optimizer._get_variable_index(variable)


def apply_gradients(optimizer: Any, grads_and_vars: Iterable[tuple[Any, Any]]) -> None:
    """``optimizer.apply_gradients(grads_and_vars)``, fused where the math allows.

    Keeps ``optimizer.iterations`` in step exactly as Keras does (one increment per
    call). Works eagerly and inside ``tf.function``, for Keras 3 and tf_keras.
    """
    import tensorflow as tf

    pairs = [(g, v) for g, v in grads_and_vars]
    variables = [v for _, v in pairs]
    # Keras updates the slots of a sparse (IndexedSlices) gradient differently from a
    # dense one; the fused kernels take dense gradients, so such steps keep Keras's path.
    if not fused_apply_supported(optimizer, variables) or any(isinstance(g, tf.IndexedSlices) for g, _ in pairs):
        _original_apply(optimizer, pairs)
        return

    fused_updates(optimizer, pairs, _prepare(optimizer, variables))
    optimizer.iterations.assign_add(1)


def fused_updates(optimizer: Any, pairs: list[tuple[Any, Any]], lr_value: Any) -> None:
    """The fused kernels' updates of ``pairs`` (dense gradients) at learning rate
    ``lr_value``, for an optimizer :func:`fused_apply_supported` accepts and has built;
    ``optimizer.iterations`` (the step before this one) is left to the caller."""
    import tensorflow as tf

    kind = _keras_kind(optimizer)
    step = tf.cast(optimizer.iterations + 1, tf.float32)
    for grad, var in pairs:
        if grad is None:
            continue
        dtype = var.dtype
        grad = tf.cast(grad, dtype)
        lr = tf.cast(lr_value, dtype)
        index = _slot_index(optimizer, var)
        if kind == "adam":
            beta_1 = tf.cast(optimizer.beta_1, dtype)
            beta_2 = tf.cast(optimizer.beta_2, dtype)
            local_step = tf.cast(step, dtype)
            tf.raw_ops.ResourceApplyAdam(
                var=_handle(var), m=_handle(optimizer._momentums[index]), v=_handle(optimizer._velocities[index]),
                beta1_power=tf.pow(beta_1, local_step), beta2_power=tf.pow(beta_2, local_step),
                lr=lr, beta1=beta_1, beta2=beta_2, epsilon=tf.cast(optimizer.epsilon, dtype), grad=grad,
                use_locking=False, use_nesterov=False,
            )
        elif optimizer.momentum != 0:
            tf.raw_ops.ResourceApplyKerasMomentum(
                var=_handle(var), accum=_handle(optimizer.momentums[index]), lr=lr, grad=grad,
                momentum=tf.cast(optimizer.momentum, dtype), use_locking=False, use_nesterov=bool(optimizer.nesterov),
            )
        else:
            tf.raw_ops.ResourceApplyGradientDescent(var=_handle(var), alpha=lr, delta=grad, use_locking=False)


# While tracing the host step, Keras SGD/Adam ``apply_gradients`` calls made by a
# user's ``host_call`` function are routed to the fused path (per thread, only inside
# ``fused_optimizer_scope``).
_local = threading.local()


def _original_apply(optimizer: Any, pairs: list[tuple[Any, Any]]) -> None:
    original = getattr(_local, "original", None)
    if original is not None:
        original(optimizer, pairs)
    else:
        optimizer.apply_gradients(pairs)


def _routed_apply(original: Any, self: Any, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
    if args or kwargs:  # name=..., skip_gradients_aggregation=...: Keras's own path
        return original(self, grads_and_vars, *args, **kwargs)
    previous, _local.original = getattr(_local, "original", None), original
    try:
        apply_gradients(self, grads_and_vars)
    finally:
        _local.original = previous
    return self.iterations


@contextlib.contextmanager
def fused_optimizer_scope(enabled: bool = True) -> Iterator[None]:
    """Inside this block, ``SGD``/``Adam`` ``apply_gradients`` (Keras 3 and tf_keras,
    whichever are imported) use the fused kernels."""
    with contextlib.ExitStack() as stack:
        if enabled:
            for package in loaded_kerases():
                stack.enter_context(routed(package.optimizers.Optimizer, "apply_gradients", _routed_apply))
        yield
