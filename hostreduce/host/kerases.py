"""Which Keras a user's object comes from, without importing any Keras.

With ``TF_USE_LEGACY_KERAS=1`` ``tf.keras`` is ``tf_keras`` (Keras 2), whose variables
are ``tf.Variable``; otherwise it is Keras 3, whose TensorFlow-backend ``Variable``
wraps a ``tf.Variable`` (in ``_value``). Both can be loaded in one process, so code
that handles an optimizer or variable asks its own package, never ``import keras``.
"""
from __future__ import annotations

import sys
import threading
from types import ModuleType
from typing import Any

from ..errors import ConfigError

__all__ = ["loaded_kerases", "keras_of", "underlying_variable", "optimizer_variables", "optimizer_bases",
           "optimizer_subclass", "check_not_xla"]

_PACKAGES = ("keras", "tf_keras")


def loaded_kerases() -> list[ModuleType]:
    """The Keras packages imported so far (``keras`` 3 and/or ``tf_keras``)."""
    found = []
    for name in _PACKAGES:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "optimizers"):
            found.append(module)
    return found


def keras_of(obj: Any) -> ModuleType | None:
    """The imported Keras package that defines ``obj``'s class, or None."""
    top = type(obj).__module__.split(".", 1)[0]
    return sys.modules.get(top) if top in _PACKAGES else None


def underlying_variable(variable: Any) -> Any:
    """The ``tf.Variable`` behind ``variable`` (a Keras 3 variable's ``_value``); a
    ``tf.Variable`` itself (TensorFlow, tf_keras) as it is; None for anything else."""
    import tensorflow as tf

    if isinstance(variable, tf.Variable):
        return variable
    value = getattr(variable, "_value", None)
    return value if isinstance(value, tf.Variable) else None


def optimizer_variables(optimizer: Any) -> list[Any]:
    """An optimizer's variables: Keras 3's ``variables`` list, Keras 2's ``variables()``
    (none for None)."""
    if optimizer is None:
        return []
    found = optimizer.variables
    return list(found() if callable(found) else found)


def optimizer_bases(package: Any) -> tuple[type, ...]:
    """The optimizer base classes of a Keras package: tf_keras also has its legacy
    (``OptimizerV2``) optimizers (Keras 3's ``optimizers.legacy`` names a class that
    refuses to be made)."""
    legacy = getattr(getattr(package.optimizers, "legacy", None), "Optimizer", None)
    real = isinstance(legacy, type) and hasattr(legacy, "apply_gradients")
    return (package.optimizers.Optimizer,) + ((legacy,) if real else ())


_subclasses: dict[tuple[type, type], type] = {}
_subclasses_lock = threading.Lock()


def optimizer_subclass(base: type, methods: type, **attributes: Any) -> type:
    """The subclass of the optimizer class ``base`` with the methods of ``methods`` (and
    ``attributes``), made once per pair. It keeps ``base``'s name, module and docstring,
    so Keras saves and names its instances as ``base``'s."""
    with _subclasses_lock:
        cls = _subclasses.get((base, methods))
        if cls is None:
            namespace = {k: v for k, v in vars(methods).items() if callable(v)}
            namespace.update(attributes, __module__=base.__module__, __qualname__=base.__qualname__,
                             __doc__=base.__doc__)
            cls = _subclasses[base, methods] = type(base.__name__, (base,), namespace)
        return cls


def check_not_xla() -> None:
    """Refuse to run inside an XLA-compiled step: gradients reach the host through ops XLA
    cannot compile."""
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    if not tf.executing_eagerly() and control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ConfigError(
            "A hostreduce optimizer wrapper cannot run in an XLA-compiled train step: its gradients go to the "
            "host through ops XLA cannot compile. Pass `jit_compile=False` to `model.compile()` "
            "(Keras turns XLA on by default where a GPU is present)."
        )
