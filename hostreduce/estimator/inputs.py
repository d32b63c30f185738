"""Calling user functions with the arguments they ask for: ``input_fn(mode,
input_context)`` and ``model_fn(features, labels, mode, params, config)``; and, as
``tf.estimator.inputs`` did, :func:`numpy_input_fn` (from ``numpy_input.py``)."""
from __future__ import annotations

import inspect
from typing import Any, Callable

from ..errors import ConfigError, SpecError
from .numpy_input import numpy_input_fn

# ``numpy_input_fn`` is here too, where ``tf.estimator.inputs`` had it.
__all__ = ["batch_size", "call_input_fn", "call_model_fn", "check_model_fn", "check_steps", "numpy_input_fn",
           "split_element", "without_autotune_thread"]

_MODEL_FN_ARGS = ("features", "labels", "mode", "params", "config")


def _parameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def check_model_fn(model_fn: Any) -> None:
    if not callable(model_fn):
        raise SpecError(f"`model_fn` must be callable. Received: model_fn={model_fn!r}")
    params = _parameters(model_fn)
    if params and "features" not in params and not _has_var_positional(params):
        raise SpecError(
            f"`model_fn` must accept a `features` argument (model_fn(features, labels, mode, params)). "
            f"Received: model_fn{inspect.signature(model_fn)}"
        )


def _has_var_positional(params: dict[str, inspect.Parameter]) -> bool:
    return any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values())


def call_model_fn(model_fn: Callable[..., Any], features: Any, labels: Any, mode: str, params: Any,
                  config: Any) -> Any:
    """Call ``model_fn`` with those of (features, labels, mode, params, config) it names."""
    values = dict(zip(_MODEL_FN_ARGS, (features, labels, mode, params, config)))
    params_ = _parameters(model_fn)
    if not params_ or _has_var_positional(params_):
        return model_fn(features, labels, mode, params)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params_.values()):
        return model_fn(**values)
    return model_fn(**{k: v for k, v in values.items() if k in params_})


def call_input_fn(input_fn: Callable[..., Any], mode: str, input_context: Any, params: Any = None,
                  config: Any = None) -> Any:
    """Call ``input_fn``, passing those of ``mode``, ``input_context``, ``params`` and
    ``config`` it names (as ``tf.estimator`` did); return a ``tf.data.Dataset``."""
    import tensorflow as tf

    if not callable(input_fn):
        raise SpecError(f"`input_fn` must be callable. Received: input_fn={input_fn!r}")
    params_value, params = params, _parameters(input_fn)
    kwargs: dict[str, Any] = {}
    if "mode" in params:
        kwargs["mode"] = mode
    if "input_context" in params:
        kwargs["input_context"] = input_context
    if "params" in params:
        kwargs["params"] = {} if params_value is None else params_value
    if "config" in params:
        kwargs["config"] = config
    dataset = input_fn(**kwargs)
    if isinstance(dataset, tuple) and len(dataset) == 2:
        dataset = tf.data.Dataset.from_tensors(dataset).repeat()
    if not isinstance(dataset, tf.data.Dataset):
        raise SpecError(
            f"`input_fn` must return a tf.data.Dataset of (features, labels) or features. "
            f"Received: {type(dataset).__name__}"
        )
    return dataset


def check_steps(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ConfigError(f"`{name}` must be an integer >= 0 or None. Received: {name}={value!r}")


def split_element(element: Any, mode: str) -> tuple[Any, Any]:
    """(features, labels) of one dataset element (labels None when absent)."""
    if isinstance(element, tuple) and len(element) == 2:
        return element
    return element, None


def without_autotune_thread(dataset: Any) -> Any:
    """``dataset`` with tf.data's autotuning off, unless its options set it.

    Each ``train``/``evaluate``/``predict`` call drops its iterator when it returns, and
    TensorFlow's destructor waits for the iterator's autotune thread, which may sleep
    through its optimization period (growing to 60 s) before it notices: measured here as
    1-52 s at the end of ``train``, seemingly at random. Without autotuning there is no
    such thread; ``AUTOTUNE`` parallelism then stays at TensorFlow's default (the number
    of cores) and ``prefetch(AUTOTUNE)`` keeps its own buffer tuning.
    """
    import tensorflow as tf

    if dataset.options().autotune.enabled is not None:
        return dataset
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def batch_size(features: Any) -> int:
    import tensorflow as tf

    first = tf.nest.flatten(features)[0]
    return int(first.shape[0]) if first.shape.rank else 1
