"""Row-sparse gradients: summing the rows of duplicate ids, vectorised.

An embedding lookup of a batch yields one gradient row per occurrence of an id
(``tf.IndexedSlices`` with repeated indices). Every consumer here (the wire, the sync
sum over workers, the sparse kernels) wants each id once with its rows summed: a
sparse kernel applied to repeated ids would apply the later rows on top of the earlier
update instead of to their sum.
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError

__all__ = ["sum_duplicates", "check_ids"]


def sum_duplicates(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(unique ids, ascending; the sum of each id's rows)``, each sum taken left to
    right in the rows' order of arrival (deterministic, bit for bit)."""
    ids = np.asarray(ids).reshape(-1).astype(np.int64, copy=False)
    values = np.asarray(values)
    if len(ids) != (values.shape[0] if values.ndim else 1):
        raise ConfigError(f"`values` must have one row per id: {len(ids)} ids. "
                          f"Received: values.shape={values.shape}")
    if len(ids) == 0:
        return ids, values
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    # np.take, not values[order]: several times faster for rows of a 2-D array.
    ordered = np.take(values, order, axis=0)
    first = np.r_[True, sorted_ids[1:] != sorted_ids[:-1]]
    if first.all():  # no duplicates: just the sort
        return sorted_ids, ordered
    # Each id's first row, then its later rows added one by one in their order (np.add.at
    # is unbuffered and sequential). np.add.reduceat along axis 0 was 20x slower for
    # thousands of rows, and its sums of long segments are not left to right.
    starts = np.flatnonzero(first)
    out = np.take(ordered, starts, axis=0)
    later = np.flatnonzero(~first)
    np.add.at(out, np.cumsum(first)[later] - 1, np.take(ordered, later, axis=0))
    return sorted_ids[starts], out


def check_ids(name: str, ids: np.ndarray, num_rows: int) -> np.ndarray:
    """``ids`` as int64 if they are a 1-D array of integers in ``[0, num_rows)``; raise
    ConfigError naming ``name`` otherwise. (Floats are refused, not rounded: a NaN id
    would become the most negative int64, and 1.5 would silently be row 1.)"""
    if ids.ndim != 1:
        raise ConfigError(f"row ids of {name!r} must be a 1-D array. Received: shape={ids.shape}")
    if ids.dtype.kind not in "iu":
        raise ConfigError(f"row ids of {name!r} must be integers. Received: dtype={ids.dtype.name}")
    if len(ids) and (ids.min() < 0 or ids.max() >= num_rows):
        bad = ids[(ids < 0) | (ids >= num_rows)][:5].tolist()
        raise ConfigError(f"row ids of {name!r} must be in [0, {num_rows}). Received: ids including {bad}")
    return ids.astype(np.int64, copy=False)
