"""``numpy_input_fn``: an ``input_fn`` over NumPy arrays, as
``tf.compat.v1.estimator.inputs.numpy_input_fn`` made one (that one fed a TF1 queue;
this one returns a ``tf.data.Dataset``)."""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from ..errors import ConfigError

__all__ = ["numpy_input_fn"]


def _as_arrays(name: str, value: Any) -> Any:
    """``value`` as an array, or a dict of arrays (keys kept in order)."""
    if isinstance(value, Mapping):
        if not value:
            raise ConfigError(f"`{name}` must be a non-empty dict of arrays or an array. Received: {name}={{}}")
        return {str(k): np.asarray(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or not hasattr(value, "shape"):
        raise ConfigError(f"`{name}` must be a NumPy array or a dict of them. Received: {name} of type "
                          f"{type(value).__name__}")
    return np.asarray(value)


def _lengths(name: str, value: Any) -> dict[str, int]:
    items = value.items() if isinstance(value, dict) else [(name, value)]
    lengths = {}
    for key, array in items:
        if array.ndim == 0:
            raise ConfigError(f"`{name}` must hold arrays with a first (example) dimension. Received: "
                              f"{key} of shape {array.shape}")
        lengths[key if key == name else f"{name}[{key!r}]"] = int(array.shape[0])
    return lengths


def numpy_input_fn(x: Any, y: Any = None, batch_size: int = 128, num_epochs: int | None = 1,
                   shuffle: bool | None = None, queue_capacity: int = 1000, num_threads: int = 1
                   ) -> Callable[[], Any]:
    """An ``input_fn`` returning batches of ``(x, y)`` (``x`` alone when ``y`` is None).

    Args:
        x: a NumPy array or a dict of them (the features), first dimension the examples.
        y: a NumPy array or a dict of them (the labels), or None.
        batch_size: examples per batch; the last batch of the data may be smaller.
        num_epochs: passes over the data; None repeats it for ever. Batches run on
            across the end of an epoch, as the queue of ``tf.estimator`` did.
        shuffle: whether to shuffle the examples (anew in every epoch); must be given,
            as ``tf.estimator`` required.
        queue_capacity, num_threads: accepted for ``tf.estimator`` scripts; the whole
            epoch is shuffled and tf.data decides the parallelism.
    """
    if not isinstance(shuffle, bool):
        raise ConfigError(f"`shuffle` must be given, True or False. Received: shuffle={shuffle!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"`batch_size` must be an integer >= 1. Received: batch_size={batch_size!r}")
    if num_epochs is not None and (isinstance(num_epochs, bool) or not isinstance(num_epochs, int)
                                   or num_epochs < 1):
        raise ConfigError(f"`num_epochs` must be an integer >= 1 or None. Received: num_epochs={num_epochs!r}")
    features = _as_arrays("x", x)
    labels = None if y is None else _as_arrays("y", y)
    lengths = {**_lengths("x", features), **({} if labels is None else _lengths("y", labels))}
    if len(set(lengths.values())) > 1:
        raise ConfigError(f"`x` and `y` must hold the same number of examples. Received: {lengths}")
    if isinstance(features, dict) and labels is not None and isinstance(labels, dict) and set(features) & set(labels):
        raise ConfigError(f"`x` and `y` must not share keys. Received: both have {sorted(set(features) & set(labels))}")
    count = next(iter(lengths.values()))

    def input_fn() -> Any:
        import tensorflow as tf

        data = features if labels is None else (features, labels)
        dataset = tf.data.Dataset.from_tensor_slices(data)
        if shuffle:
            dataset = dataset.shuffle(max(count, 1), reshuffle_each_iteration=True)
        return dataset.repeat(num_epochs).batch(batch_size)

    return input_fn
