"""A SavedModel that serves ``model_fn``'s predictions (``Estimator.export_saved_model``).

The export holds the model's variables and one signature, ``serving_default``, that runs
``model_fn`` in ``PREDICT`` mode on a batch of features and returns its
``predictions`` (a dict of tensors, or one tensor under the key ``output``). Inputs are
named after the features' keys (one tensor: ``features``). It is written to
``export_dir_base/<timestamp>`` as ``tf.estimator`` did, through a temporary directory
renamed into place, so a reader never sees a partial export.
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Any, Callable

from ..errors import ConfigError
from ..ps_training.rowcache import is_row_cache

__all__ = ["features_spec", "write_saved_model"]


def features_spec(serving_input_receiver_fn: Callable[[], Any] | None, last_seen: Any) -> Any:
    """The features' ``tf.TensorSpec`` structure to serve: what
    ``serving_input_receiver_fn()`` returns, else ``last_seen`` (the features of the
    last ``input_fn``)."""
    import tensorflow as tf

    if serving_input_receiver_fn is None:
        if last_seen is None:
            raise ConfigError("`serving_input_receiver_fn` is needed before the Estimator has seen an input_fn: pass "
                              "one returning the features' tf.TensorSpec (or a dict of them). "
                              "Received: serving_input_receiver_fn=None")
        spec = last_seen
    elif callable(serving_input_receiver_fn):
        spec = serving_input_receiver_fn()
    else:
        raise ConfigError("`serving_input_receiver_fn` must be a callable with no arguments returning the features' "
                          f"tf.TensorSpec or a dict of them. Received: {serving_input_receiver_fn!r}")
    features = getattr(spec, "features", spec)  # a ServingInputReceiver-like value
    flat = tf.nest.flatten(features)
    if not flat or not all(isinstance(s, tf.TensorSpec) for s in flat) or not (
            isinstance(features, tf.TensorSpec)
            or (isinstance(features, dict) and all(isinstance(v, tf.TensorSpec) for v in features.values()))):
        raise ConfigError("`serving_input_receiver_fn` must return a tf.TensorSpec or a flat dict of them (batch "
                          f"dimension None). Received: {features!r}")
    return features


def write_saved_model(predict: Callable[[Any], Any], spec: Any, variables: list[Any], export_dir_base: str) -> str:
    """Save ``predict`` (features -> predictions) with ``variables``; return the export's path."""
    import tensorflow as tf

    if isinstance(spec, dict):
        keys = sorted(spec)
        signature = [tf.TensorSpec(spec[k].shape, spec[k].dtype, name=k) for k in keys]

        def serve(*tensors: Any) -> Any:
            return _outputs(predict(dict(zip(keys, tensors))))
    else:
        signature = [tf.TensorSpec(spec.shape, spec.dtype, name="features")]

        def serve(features: Any) -> Any:  # type: ignore[misc]
            return _outputs(predict(features))

    module = tf.Module()
    module.model_variables = list(variables)
    module.serve = tf.function(serve, input_signature=signature, autograph=False)
    if any(is_row_cache(v) for v in module.serve.get_concrete_function().variables):
        raise ConfigError("export_saved_model cannot export a model whose tables the parameter servers split by "
                          "rows from a training task (it holds only some rows of them). Export from a process "
                          "without parameter servers that restores the checkpoint (it reads the tables from the ps "
                          "shards). Received: a model with row-cached tables")
    base = os.fspath(export_dir_base)
    os.makedirs(base, exist_ok=True)
    stamp = int(time.time())
    while os.path.exists(os.path.join(base, str(stamp))):
        stamp += 1
    final = os.path.join(base, str(stamp))
    tmp = os.path.join(base, f"temp-{stamp}-{os.getpid()}")
    try:
        tf.saved_model.save(module, tmp, signatures={"serving_default": module.serve.get_concrete_function()})
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _outputs(predictions: Any) -> dict[str, Any]:
    import tensorflow as tf

    if isinstance(predictions, dict):
        return {str(k): tf.convert_to_tensor(v) for k, v in predictions.items()}
    return {"output": tf.convert_to_tensor(predictions)}
