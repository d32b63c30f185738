"""Keras optimizers whose update reduces the gradients over the job first: what
``hostreduce.horovod.keras.DistributedOptimizer`` and
``hostreduce.distribute.keras_optimizer_wrapper`` return.

The wrapped optimizer is an instance of a subclass of the user's optimizer class (one
subclass per class, with the same name and module, so Keras saves it as the original
class). Its update method (Keras 3 ``apply``, which ``apply_gradients`` and ``fit``'s
train step call; tf_keras ``apply_gradients``) hands every gradient to the job's engine
through :func:`hostreduce.ops.aggregation.reduce_some`. Called inside the traced train
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
from ..host.kerases import (check_not_xla, keras_of, loaded_kerases, optimizer_bases, optimizer_subclass,
                            underlying_variable)
from . import job as _engine
from .tensors import ReduceOp

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
    backward_passes_per_step: int = 1
    average_aggregated_gradients: bool = False
    process_set: Any = None
    scale_local_gradients: bool = True


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
    """This pass's gradients made ready to apply: reduced (local variables' kept), or,
    with ``backward_passes_per_step`` > 1, added to the local sums and reduced on every
    that-many-th pass. Gradients that this optimizer's ``compute_gradients`` (or
    ``get_gradients``) returned have been through this already and pass as they are."""
    check_not_xla()
    done = getattr(optimizer, "_hostreduce_done", None)
    if done and all(g is None or any(g is d for d in done) for g in grads):
        optimizer._hostreduce_done = None
        return list(grads)
    from .aggregation import reduce_some

    helper = optimizer._agg_helper
    if helper is not None:
        return helper.compute_gradients(grads, variables)
    return reduce_some(optimizer._hostreduce_spec, grads, variables)


def _mark_reduced(optimizer: Any, grads: Sequence[Any]) -> None:
    optimizer._hostreduce_done = [g for g in grads if g is not None]


def _apply_every(optimizer: Any, apply: Any, variables: Sequence[Any]) -> Any:
    """``apply()`` now, or, with local aggregation, only on the passes that reduced; the
    other passes only count ``iterations`` (as in Horovod)."""
    helper = optimizer._agg_helper
    if helper is None:
        return apply()
    if not (getattr(optimizer, "built", False) or getattr(optimizer, "_built", False)):
        optimizer.build(list(variables))  # variables cannot be created inside the cond's branch

    def skip() -> Any:
        return optimizer.iterations.assign_add(1)

    return helper.apply_gradients(apply, skip)


def _compute_gradients(optimizer: Any, loss: Any, var_list: Any, grad_loss: Any = None, tape: Any = None) -> Any:
    """Horovod's ``compute_gradients``/``_compute_gradients`` of a Keras optimizer: the
    gradients of ``loss`` (a tensor recorded on ``tape``, or a callable) reduced over the
    job (aggregated with ``backward_passes_per_step`` > 1), as (gradient, variable) pairs."""
    import tensorflow as tf

    tape = tf.GradientTape() if tape is None else tape
    if callable(loss):
        with tape:
            if callable(var_list):
                var_list = var_list()
            tape.watch(var_list)
            loss = loss()
    if callable(var_list):
        var_list = var_list()
    var_list = list(var_list)
    grads = tape.gradient(loss, var_list, grad_loss)
    reduced = _reduce(optimizer, grads, var_list)
    _mark_reduced(optimizer, reduced)
    return list(zip(reduced, var_list))


class _HorovodMethods:
    """Methods Horovod's Keras wrapper has, for both Keras packages."""

    def register_local_var(self, var: Any) -> None:
        """Keep the gradient of ``var`` local to this worker (not reduced; divided by the
        number of workers when ``scale_local_gradients``), as Horovod does."""
        if self._agg_helper is not None:
            self._agg_helper.register_local_var(var)
        else:
            self._hostreduce_spec.register_local(var)

    def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> Any:
        """The gradients of ``loss`` over ``var_list``, reduced over the job."""
        return _compute_gradients(self, loss, var_list, None, tape)

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None, tape: Any = None) -> Any:
        return _compute_gradients(self, loss, var_list, grad_loss, tape)

    def get_gradients(self, loss: Any, params: Any) -> Any:
        """The wrapped class's ``get_gradients`` (where it has one), reduced over the job."""
        base = getattr(self._hostreduce_base, "get_gradients", None)
        if base is None:
            raise ConfigError(f"{self._hostreduce_base.__name__} has no `get_gradients`; use "
                              "`compute_gradients(loss, var_list, tape)` or `apply_gradients`. "
                              f"Received: params={params!r}")
        params = list(params)
        grads = base(self, loss, params)
        reduced = _reduce(self, grads, params)
        _mark_reduced(self, reduced)
        return reduced


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

        def apply() -> Any:
            if self._hostreduce_config.variables_on_host:
                return _host_apply(self, reduced, variables)
            return base.apply(self, reduced, trainable_variables)

        return _apply_every(self, apply, variables)


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

        def apply() -> Any:
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

        if self._agg_helper is None:
            return apply()
        _apply_every(self, apply, variables)
        return self.iterations


# Both kinds of wrapper have Horovod's methods (optimizer_subclass copies a class's own
# methods only, so they are set here rather than inherited).
for _method_name, _method in list(vars(_HorovodMethods).items()):
    if callable(_method):
        setattr(_Keras3Update, _method_name, _method)
        setattr(_TfKerasUpdate, _method_name, _method)


def _subclass(base: type, package: str) -> type:
    return optimizer_subclass(base, _Keras3Update if package == "keras" else _TfKerasUpdate, _hostreduce_base=base)


def is_wrapped(optimizer: Any) -> bool:
    return getattr(type(optimizer), "_hostreduce_base", None) is not None


def _check_optimizer(optimizer: Any, argument: str) -> Any:
    """The Keras package of ``optimizer``, a Keras optimizer not wrapped yet."""
    package = keras_of(optimizer)
    if package is None:  # a class of the user's own (defined in their module)
        package = next((k for k in loaded_kerases() if isinstance(optimizer, optimizer_bases(k))), None)
    if package is None or not isinstance(optimizer, optimizer_bases(package)):
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
    _attach_reduction(wrapped, config, name or type(optimizer).__name__)
    return wrapped


def _attach_reduction(wrapped: Any, config: WrapperConfig, name: str) -> None:
    from .aggregation import LocalAggregation, ReduceSpec
    from .process_sets import global_process_set

    spec = ReduceSpec(config.op, config.compression, config.sparse_as_dense, config.predivide,
                      config.process_set if config.process_set is not None else global_process_set,
                      config.scale_local_gradients)
    wrapped._hostreduce_spec = spec
    wrapped._hostreduce_done = None
    # ``_agg_helper``: Horovod's name (its tests read ``_agg_helper.counter``).
    wrapped._agg_helper = None if config.backward_passes_per_step == 1 else LocalAggregation(
        config.backward_passes_per_step, config.average_aggregated_gradients, spec, name=f"{name}_aggregation")


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
