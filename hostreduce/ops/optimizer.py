"""Keras optimizers whose update reduces the gradients over the job first: what
``hostreduce.horovod.keras.DistributedOptimizer`` and
``hostreduce.distribute.keras_optimizer_wrapper`` return.

The wrapped optimizer is an instance of a subclass of the user's optimizer class (one
subclass per class, with the same name and module, so Keras saves it as the original
class). Its update method (Keras 3 ``apply``, which ``apply_gradients`` and ``fit``'s
train step call; tf_keras ``apply_gradients``) hands every gradient to the job's engine
through :func:`hostreduce.ops.tensors.reduce_gradients`. Called inside the traced train
step, that puts a hand-off op per gradient into the step's graph, so each reduction
starts as soon as the backward pass has produced its gradient.

``variables_on_host``: the optimizer's own variables (iterations, learning rate, every
slot) are created on ``/CPU:0``, the model's trainable variables must already live
there, and the update runs on the host through :func:`hostreduce.host.apply_gradients`
(TensorFlow's fused CPU kernels for Keras SGD and Adam). Each variable's update reads
only its own reduced gradient, so TensorFlow runs it as soon as that gradient's
reduction has been collected, not once per step. (The wait ops are stateful, so
``tf.function`` runs them in the order they were created: the order the backward pass
produces gradients in. The output layer's update thus overlaps the reductions of the
layers below it.)
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Iterator, Sequence

from ..errors import ConfigError
from ..host.kerases import check_not_xla, keras_of, optimizer_subclass, underlying_variable
from . import job as _engine
from .tensors import ReduceOp, reduce_gradients

__all__ = ["WrapperConfig", "wrap_optimizer", "wrap_loaded_optimizer", "is_wrapped", "optimizer_variables"]

HOST = "/CPU:0"


@dataclasses.dataclass(frozen=True)
class WrapperConfig:
    """How a wrapped optimizer reduces and where it applies."""

    op: ReduceOp
    compression: Any
    sparse_as_dense: bool = False
    predivide: float = 1.0
    variables_on_host: bool = False


# Set while the wrapper runs the wrapped class's own update (the host-apply layer falls
# back to ``optimizer.apply_gradients`` for configurations its fused kernels do not
# reproduce, which must not reduce a second time).
_local = threading.local()


@contextlib.contextmanager
def _unwrapped() -> Iterator[None]:
    previous, _local.inner = getattr(_local, "inner", False), True
    try:
        yield
    finally:
        _local.inner = previous


def _label(variable: Any, index: int) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", None) or f"variable{index}")


def _device(variable: Any) -> str:
    # A Keras 3 variable's device is its tf.Variable's; a tf.Variable's ``value`` is a
    # method, not the variable, so it must not be asked for ``value.device``.
    tf_variable = underlying_variable(variable)
    return getattr(tf_variable if tf_variable is not None else variable, "device", "") or ""


def _on_host(variable: Any) -> bool:
    import tensorflow as tf

    device = _device(variable)
    return bool(device) and tf.DeviceSpec.from_string(device).device_type == "CPU"


def _reduce(optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
    check_not_xla()
    config: WrapperConfig = optimizer._hostreduce_config
    labels = [_label(v, i) for i, v in enumerate(variables)]
    return reduce_gradients(grads, labels, op=config.op, compression=config.compression,
                            sparse_as_dense=config.sparse_as_dense, predivide=config.predivide)


def _check_host_variables(variables: Sequence[Any]) -> None:
    away = [(_label(v, i), v) for i, v in enumerate(variables) if not _on_host(v)]
    if away:
        raise ConfigError(
            "`variables_on_host=True` needs the model's trainable variables in host memory; "
            f"{[label for label, _ in away[:3]]} are on {_device(away[0][1]) or 'another device'}. "
            "Build the model under `with tf.device('/CPU:0'):` (with a `keras.Input`, so that its "
            "variables are created there), or pass `variables_on_host=False`."
        )


def _host_apply(optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> None:
    import tensorflow as tf

    from ..host import apply_gradients

    _check_host_variables(variables)
    with tf.device(HOST), _unwrapped():
        apply_gradients(optimizer, list(zip(grads, variables)))


class _Keras3Update:
    """Methods of the subclass made for a Keras 3 optimizer class."""

    def build(self, variables: Any) -> None:
        if self._hostreduce_config.variables_on_host:
            import tensorflow as tf

            with tf.device(HOST):
                return self._hostreduce_base.build(self, variables)
        return self._hostreduce_base.build(self, variables)

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        base = self._hostreduce_base
        if getattr(_local, "inner", False):
            return base.apply(self, grads, trainable_variables)
        grads = list(grads)
        variables = list(trainable_variables) if trainable_variables is not None else list(self._trainable_variables)
        reduced = _reduce(self, grads, variables)
        if self._hostreduce_config.variables_on_host:
            return _host_apply(self, reduced, variables)
        return base.apply(self, reduced, trainable_variables)


class _TfKerasUpdate:
    """Methods of the subclass made for a tf_keras (Keras 2) optimizer class."""

    def build(self, var_list: Any) -> None:
        if self._hostreduce_config.variables_on_host:
            import tensorflow as tf

            with tf.device(HOST):
                return self._hostreduce_base.build(self, var_list)
        return self._hostreduce_base.build(self, var_list)

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        base = self._hostreduce_base
        if getattr(_local, "inner", False):
            return base.apply_gradients(self, grads_and_vars, *args, **kwargs)
        pairs = list(grads_and_vars)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        reduced = _reduce(self, grads, variables)
        if self._hostreduce_config.variables_on_host and not args and not kwargs:
            _host_apply(self, reduced, variables)
            return self.iterations
        if self._hostreduce_config.variables_on_host:
            import tensorflow as tf

            _check_host_variables(variables)
            with tf.device(HOST), _unwrapped():
                return base.apply_gradients(self, list(zip(reduced, variables)), *args, **kwargs)
        with _unwrapped():
            return base.apply_gradients(self, list(zip(reduced, variables)), *args, **kwargs)


def _subclass(base: type, package: str) -> type:
    return optimizer_subclass(base, _Keras3Update if package == "keras" else _TfKerasUpdate, _hostreduce_base=base)


def is_wrapped(optimizer: Any) -> bool:
    return getattr(type(optimizer), "_hostreduce_base", None) is not None


def _check_optimizer(optimizer: Any, argument: str) -> Any:
    """The Keras package of ``optimizer``, a Keras optimizer not wrapped yet."""
    package = keras_of(optimizer)
    if package is None or not isinstance(optimizer, package.optimizers.Optimizer):
        raise ConfigError(f"`{argument}` must be a Keras optimizer (Keras 3 or tf_keras). "
                          f"Received: {argument}={optimizer!r}")
    if is_wrapped(optimizer):
        raise ConfigError(f"`{argument}` already reduces its gradients over the job; wrap an optimizer only once. "
                          f"Received: {argument}={optimizer!r}")
    return package


def _new_wrapped(optimizer: Any, package: Any, config: WrapperConfig, name: str | None) -> Any:
    _engine.job()  # fail here, not inside fit(), when init() was not called
    cls = _subclass(type(optimizer), package.__name__)
    config_dict = optimizer.get_config()
    if name is not None:
        config_dict["name"] = name
    import tensorflow as tf

    try:
        with tf.device(HOST) if config.variables_on_host else contextlib.nullcontext():
            wrapped = cls.from_config(config_dict)
    except Exception as exc:  # noqa: BLE001 - named for the user
        raise ConfigError(f"Could not re-create {type(optimizer).__name__} from its get_config() to wrap it: "
                          f"{type(exc).__name__}: {exc}") from exc
    wrapped._hostreduce_config = config
    return wrapped


def optimizer_variables(optimizer: Any) -> list[Any]:
    """Every variable of a Keras 3 (a property) or tf_keras (a method) optimizer."""
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def wrap_optimizer(optimizer: Any, config: WrapperConfig, name: str | None = None, argument: str = "optimizer") -> Any:
    """A new optimizer of ``optimizer``'s configuration whose update reduces first.

    ``optimizer`` must be a Keras 3 or tf_keras optimizer not used yet (its state is not
    carried over). ``name``: the new optimizer's name (default: the original's).
    """
    package = _check_optimizer(optimizer, argument)
    built = getattr(optimizer, "built", False) or bool(getattr(optimizer, "_variables", None))
    if built and int(optimizer.iterations.numpy()) > 0:
        raise ConfigError(f"`{argument}` must not have been used yet: wrap it before training (its state would "
                          f"be lost). Received: an optimizer at iteration {int(optimizer.iterations.numpy())}")
    return _new_wrapped(optimizer, package, config, name)


def wrap_loaded_optimizer(optimizer: Any, config: WrapperConfig, variables: Sequence[Any],
                          argument: str = "optimizer") -> Any:
    """A wrapped optimizer that carries on from ``optimizer``'s state: for the optimizer
    of a model Keras has loaded from a file, with its iteration count and slots.

    The new optimizer is built on ``variables`` (the model's trainable variables), so its
    variables are created where ``config`` puts them (``/CPU:0`` with
    ``variables_on_host``), not where the loaded ones happen to live; then each takes
    the value of the loaded variable at its position. Both optimizers are of one class,
    built on the same variables, so their variable lists correspond one to one; a
    difference in number or shape is refused rather than guessed at.
    """
    package = _check_optimizer(optimizer, argument)
    wrapped = _new_wrapped(optimizer, package, config, None)
    if not (getattr(optimizer, "built", False) or getattr(optimizer, "_built", False)):
        return wrapped  # never applied an update: its configuration is all its state
    wrapped.build(list(variables))
    source, target = optimizer_variables(optimizer), optimizer_variables(wrapped)
    shapes = [tuple(v.shape) for v in source], [tuple(v.shape) for v in target]
    if shapes[0] != shapes[1]:
        raise ConfigError(f"Could not carry the state of `{argument}` over to its wrapped copy: its variables have "
                          f"shapes {shapes[0]}, the copy's {shapes[1]}. Received: {argument}={optimizer!r}")
    for new, old in zip(target, source):
        new.assign(old.numpy())
    return wrapped
