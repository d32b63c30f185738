"""The optimizer update on the host, through TensorFlow's fused kernels where they
compute exactly what the Keras optimizer computes.

Keras 3 builds SGD and Adam updates from several element-wise ops per variable;
``ResourceApplyGradientDescent``, ``ResourceApplyKerasMomentum`` and
``ResourceApplyAdam`` do the same arithmetic in one pass over memory. The kernels are
used only for configurations whose math they reproduce (no clipping, weight decay,
EMA, AMSGrad, gradient accumulation, loss scaling or constraints); anything else goes
through ``optimizer.apply_gradients``.

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

__all__ = ["apply_gradients", "fused_apply_supported", "fused_optimizer_scope"]

_FLOAT_DTYPES = ("float32", "float64")


def _keras_kind(optimizer: Any) -> str | None:
    import keras

    cls = type(optimizer)
    if cls is keras.optimizers.Adam:
        return "adam"
    if cls is keras.optimizers.SGD:
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
        if str(getattr(v, "dtype", "")) not in _FLOAT_DTYPES:
            return False
    return True


def _handle(variable: Any) -> Any:
    return getattr(variable, "value", variable).handle


def apply_gradients(optimizer: Any, grads_and_vars: Iterable[tuple[Any, Any]]) -> None:
    """``optimizer.apply_gradients(grads_and_vars)``, fused where the math allows.

    Keeps ``optimizer.iterations`` in step exactly as Keras does (one increment per
    call). Works eagerly and inside ``tf.function``.
    """
    pairs = [(g, v) for g, v in grads_and_vars]
    variables = [v for _, v in pairs]
    if not fused_apply_supported(optimizer, variables):
        _original_apply(optimizer, pairs)
        return
    import keras
    import tensorflow as tf

    if not optimizer.built:
        with keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(variables)
        optimizer.built = True
    kind = _keras_kind(optimizer)
    lr_value = optimizer._get_current_learning_rate()
    step = tf.cast(optimizer.iterations + 1, tf.float32)
    for grad, var in pairs:
        if grad is None:
            continue
        dtype = var.dtype
        grad = tf.cast(grad, dtype)
        lr = tf.cast(lr_value, dtype)
        index = optimizer._get_variable_index(var)
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
    optimizer.iterations.assign_add(1)


# While tracing the host step, Keras SGD/Adam ``apply_gradients`` calls made by a
# user's ``host_call`` function are routed to the fused path. The switch is per thread
# and only active inside ``fused_optimizer_scope``.
_local = threading.local()
_patch_lock = threading.Lock()
_patched: dict[str, Any] = {}


def _original_apply(optimizer: Any, pairs: list[tuple[Any, Any]]) -> None:
    original = _patched.get("apply_gradients")
    if original is not None:
        original(optimizer, pairs)
    else:
        optimizer.apply_gradients(pairs)


def _routed_apply(self: Any, grads_and_vars: Any) -> Any:
    if getattr(_local, "active", False):
        apply_gradients(self, grads_and_vars)
        return self.iterations
    return _patched["apply_gradients"](self, grads_and_vars)


@contextlib.contextmanager
def fused_optimizer_scope(enabled: bool = True) -> Iterator[None]:
    """Inside this block, ``SGD``/``Adam`` ``apply_gradients`` use the fused kernels."""
    if not enabled:
        yield
        return
    import keras

    base = keras.optimizers.Optimizer
    with _patch_lock:
        if "apply_gradients" not in _patched:
            _patched["apply_gradients"] = base.apply_gradients
            base.apply_gradients = _routed_apply
        _patched["depth"] = _patched.get("depth", 0) + 1
    _local.active = True
    try:
        yield
    finally:
        _local.active = False
        with _patch_lock:
            _patched["depth"] -= 1
            if _patched["depth"] == 0:
                base.apply_gradients = _patched.pop("apply_gradients")
                _patched.pop("depth")
