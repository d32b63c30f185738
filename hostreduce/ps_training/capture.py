"""What a ``host_call`` applies, read without running it: which variable each of its
tensors updates, and with which optimizer (for parameter servers, which apply the
gradients themselves).

The function is called once, eagerly, on stand-ins for its tensors, with every
optimizer's ``apply_gradients`` (Keras 3, tf_keras and TF1) routed to a recorder, so
nothing is computed or updated. A ``host_call`` that does more with its gradients than
pass them to ``apply_gradients`` (clipping, scaling) cannot be split this way and is
refused with a :class:`SpecError` saying so.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

from ..errors import ConfigError, SpecError
from ..host.kerases import keras_of, loaded_kerases, optimizer_bases
from ..host.patch import routed

__all__ = ["Updates", "capture_updates", "host_optimizer_config"]


class _Stand:
    """Stands for ``host_call`` tensor #index."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<host_call tensor #{self.index}>"


class Updates:
    """``variables[i]``: the variable tensor #i updates; ``optimizer``: the one applying."""

    def __init__(self) -> None:
        self.variables: dict[int, Any] = {}
        self.optimizers: list[Any] = []

    def record(self, optimizer: Any, grads_and_vars: Any) -> None:
        if not any(o is optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)
        for grad, var in grads_and_vars:
            if grad is None:
                continue
            if not isinstance(grad, _Stand):
                raise SpecError(
                    f"With parameter servers, `host_call` must pass its tensors to `apply_gradients` unchanged (the "
                    f"ps apply them). Received: {type(optimizer).__name__}.apply_gradients given {grad!r:.80} for "
                    f"{getattr(var, 'name', var)!r}")
            if grad.index in self.variables:
                raise SpecError(f"`host_call` tensor #{grad.index} is applied to two variables")
            self.variables[grad.index] = var


def capture_updates(fn: Callable[..., Any], count: int) -> Updates:
    """Call ``fn`` on ``count`` stand-ins with ``apply_gradients`` recorded; what it applies."""
    import tensorflow as tf

    updates = Updates()

    def record(original: Any, optimizer: Any, grads_and_vars: Any, *args: Any, **kwargs: Any) -> None:
        updates.record(optimizer, list(grads_and_vars))

    with contextlib.ExitStack() as stack:
        for package in loaded_kerases():
            for base in optimizer_bases(package):  # tf_keras's legacy optimizers too
                stack.enter_context(routed(base, "apply_gradients", record))
        stack.enter_context(routed(tf.compat.v1.train.Optimizer, "apply_gradients", record))
        try:
            fn(*[_Stand(i) for i in range(count)])
        except SpecError:
            raise
        except Exception as e:
            raise SpecError(
                "With parameter servers, `host_call` must only pass its tensors to an optimizer's `apply_gradients` "
                f"(the ps apply them); calling it on stand-ins failed with {type(e).__name__}: {str(e)[:200]}") from None
    missing = sorted(set(range(count)) - set(updates.variables))
    if missing:
        raise SpecError(f"`host_call` tensors {missing} are not passed to `apply_gradients`: with parameter servers "
                        "every tensor must be a gradient the ps apply")
    if not updates.optimizers:
        raise SpecError("`host_call` applies no gradients: with parameter servers it must call an optimizer's "
                        "`apply_gradients`")
    return updates


def _constant(name: str, value: Any, optimizer: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ConfigError(f"`{name}` of {type(optimizer).__name__} must be a constant number on parameter servers. "
                      f"Received: {name}={value!r:.80}")


def _tf1_config(optimizer: Any) -> dict[str, Any] | None:
    import tensorflow as tf

    train = tf.compat.v1.train
    kind = type(optimizer)
    if kind is train.GradientDescentOptimizer:
        return {"name": "sgd", "learning_rate": _constant("learning_rate", optimizer._learning_rate, optimizer)}
    if kind is train.MomentumOptimizer:
        # accum = accum * mu + g; var -= lr * accum  is Keras's m = m * mu - lr * g; var += m (m = -lr * accum).
        return {"name": "sgd", "learning_rate": _constant("learning_rate", optimizer._learning_rate, optimizer),
                "momentum": _constant("momentum", optimizer._momentum, optimizer),
                "nesterov": bool(optimizer._use_nesterov)}
    if kind is train.AdamOptimizer:
        return {"name": "adam", "learning_rate": _constant("learning_rate", optimizer._lr, optimizer),
                "beta_1": _constant("beta1", optimizer._beta1, optimizer),
                "beta_2": _constant("beta2", optimizer._beta2, optimizer),
                "epsilon": _constant("epsilon", optimizer._epsilon, optimizer)}
    if kind is train.AdagradOptimizer:
        return {"name": "adagrad", "learning_rate": _constant("learning_rate", optimizer._learning_rate, optimizer),
                "initial_accumulator_value": _constant("initial_accumulator_value",
                                                       optimizer._initial_accumulator_value, optimizer),
                "epsilon": 0.0}
    return None


def host_optimizer_config(optimizers: list[Any], sparse: str = "keras") -> dict[str, Any]:
    """The ``hostreduce.ps`` optimizer config equal to ``optimizers`` (all must agree):
    Keras 3 and tf_keras SGD, Adam, Adagrad, RMSprop; TF1 GradientDescent, Momentum, Adam,
    Adagrad."""
    from ..ps.optimizers import from_config, from_keras

    configs = []
    for optimizer in optimizers:
        if keras_of(optimizer) is not None:
            configs.append(from_keras(optimizer, sparse=sparse).get_config())
            continue
        config = _tf1_config(optimizer)
        if config is None:
            raise ConfigError("The optimizer of `host_call` must be a Keras SGD, Adam, Adagrad or RMSprop or a TF1 "
                              "GradientDescent, Momentum, Adam or Adagrad optimizer on parameter servers. "
                              f"Received: {type(optimizer).__module__}.{type(optimizer).__name__}")
        configs.append(from_config({**config, "sparse": sparse}).get_config())
    if any(c != configs[0] for c in configs[1:]):
        raise ConfigError(f"`host_call` must apply one optimizer configuration on parameter servers. Received: {configs}")
    return configs[0]
