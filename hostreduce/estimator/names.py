"""The names variables have in Estimator checkpoints, and loading a checkpoint into a
Keras model and optimizer by those names.

An Estimator names each variable after its Keras path (Keras 3 ``Variable.path``, e.g.
``sequential/dense/kernel``; optimizer variables ``adam/iteration`` and slots
``adam/sequential_dense_kernel_momentum``) with the counters that Keras and TensorFlow
append to repeated names removed (``sequential_1/dense_2`` -> ``sequential/dense``), so
the names do not depend on what else the process built. The k-th later variable with the
same such name gets ``#k``: a model of three ``Dense`` layers holds
``sequential/dense/kernel``, ``sequential/dense/kernel#1`` and
``sequential/dense/kernel#2``. These are the names ``Estimator.get_variable_names()``
returns and the names in ``tf.train.list_variables(model_dir)``.
"""
from __future__ import annotations

from typing import Any, Iterable

from ..host.variables import canonical_name as _canonical

__all__ = ["checkpoint_names", "restore_variables"]


def _path(variable: Any) -> str:
    path = getattr(variable, "path", None)  # Keras 3
    return str(path if isinstance(path, str) and path else variable.name)


def checkpoint_names(variables: Iterable[Any]) -> list[str]:
    """The checkpoint name of each of ``variables`` (Keras or ``tf.Variable``), given in
    the order ``model_fn`` creates them: ``model.variables`` (or
    ``model.weights``), then ``optimizer.variables``."""
    counts: dict[str, int] = {}
    names = []
    for variable in variables:
        base = _canonical(_path(variable))
        index = counts.get(base, 0)
        counts[base] = index + 1
        names.append(base if index == 0 else f"{base}#{index}")
    return names


def restore_variables(checkpoint: str, variables: Iterable[Any]) -> list[str]:
    """Assign each of ``variables`` its value in ``checkpoint`` (a ``model_dir``, a
    checkpoint directory or prefix); return the names read.

    Build the model and optimizer as ``model_fn`` does, create the optimizer's slots
    (``optimizer.build(model.trainable_variables)``), then pass ``model.variables +
    optimizer.variables`` (or the model's alone).

    Raises:
        CheckpointError: a variable's name is missing from the checkpoint or its shape
            differs.
    """
    import tensorflow as tf

    from .checkpoint import CheckpointError

    variables = list(variables)
    names = checkpoint_names(variables)
    try:
        reader = tf.train.load_checkpoint(checkpoint)
    except Exception as exc:  # TensorFlow's NotFoundError, DataLossError, ValueError
        raise CheckpointError(f"`checkpoint` cannot be read: {type(exc).__name__}: {exc}. "
                              f"Received: checkpoint={checkpoint!r}") from exc
    shapes = reader.get_variable_to_shape_map()
    missing = [n for n in names if n not in shapes]
    if missing:
        raise CheckpointError(f"Checkpoint {checkpoint!r} has no variable named {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}; it holds {sorted(shapes)[:10]}")
    for name, variable in zip(names, variables):
        if list(shapes[name]) != list(variable.shape):
            raise CheckpointError(f"Variable {name!r} has shape {list(shapes[name])} in checkpoint {checkpoint!r} "
                                  f"but {list(variable.shape)} in the model")
        variable.assign(reader.get_tensor(name))
    return names
