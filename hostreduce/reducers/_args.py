"""The arguments every collective takes, checked once for every engine: the reduction
``op``, the dtypes an engine moves, ``out=`` arrays, split sizes, and what ``mean`` and
low-precision dtypes mean. Errors name the argument and what was received."""
from __future__ import annotations

import enum
from typing import Any

import numpy as np

from ..errors import ConfigError
from .compression import divide16

__all__ = ["ReduceOp", "SUPPORTED_DTYPES", "as_dtype", "check_array", "check_reducible", "check_out", "check_counts", "even_counts",
           "is_low_precision", "apply_mean"]


class ReduceOp(str, enum.Enum):
    SUM = "sum"
    MEAN = "mean"
    MIN = "min"
    MAX = "max"
    PROD = "prod"

    @classmethod
    def parse(cls, op: "ReduceOp | str") -> "ReduceOp":
        if isinstance(op, ReduceOp):
            return op
        try:
            return cls(str(op).lower())
        except ValueError:
            raise ConfigError(
                f"`op` must be one of {[o.value for o in cls]}. Received: op={op!r}"
            ) from None


def _supported_dtypes() -> tuple[np.dtype, ...]:
    dtypes = [np.dtype(t) for t in ("float16", "float32", "float64", "int32", "int64", "uint8", "int8", "uint16",
                                    "int16", "bool")]
    try:  # bfloat16 comes from ml_dtypes (a TensorFlow dependency), when present.
        import ml_dtypes

        dtypes.append(np.dtype(ml_dtypes.bfloat16))
    except ImportError:  # pragma: no cover - ml_dtypes ships with TensorFlow
        pass
    return tuple(dtypes)


SUPPORTED_DTYPES: tuple[np.dtype, ...] = _supported_dtypes()


def as_dtype(name: str) -> np.dtype:
    """The supported dtype whose ``str`` is ``name`` (bfloat16 included)."""
    for dtype in SUPPORTED_DTYPES:
        if str(dtype) == name:
            return dtype
    raise ConfigError(f"dtype must be one of {[str(d) for d in SUPPORTED_DTYPES]}. Received: dtype={name!r}")


def check_array(name: Any, array: Any) -> np.ndarray:
    """Validate a collective's arguments; return the array as a numpy array."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"`name` must be a non-empty string. Received: name={name!r}")
    arr = np.asarray(array)
    if arr.dtype not in SUPPORTED_DTYPES:
        raise ConfigError(
            f"Tensor {name!r}: dtype must be one of {[str(d) for d in SUPPORTED_DTYPES]}. "
            f"Received: dtype={arr.dtype}"
        )
    return arr


def check_reducible(name: str, arr: np.ndarray) -> None:
    """Reductions need numbers: ``bool`` arrays are moved (broadcast, all-gather,
    all-to-all, send) but not reduced, as in Horovod."""
    if arr.dtype == np.bool_:
        raise ConfigError(f"Tensor {name!r}: a reduction needs a numeric dtype; bool tensors can be broadcast, "
                          f"all-gathered or sent. Received: dtype={arr.dtype}")


def check_out(name: str, arr: np.ndarray, out: Any, contiguous: bool = False) -> None:
    """Validate an all-reduce's ``out=``: a writeable array of ``arr``'s shape and dtype
    (and C-contiguous, for engines that write the result through a flat view)."""
    if out is None:
        return
    layout = ", C-contiguous" if contiguous else ""
    if (not isinstance(out, np.ndarray) or out.shape != arr.shape or out.dtype != arr.dtype
            or not out.flags.writeable or (contiguous and not out.flags.c_contiguous)):
        flags = ""
        if isinstance(out, np.ndarray):
            flags = "".join([", read-only" if not out.flags.writeable else "",
                             ", not C-contiguous" if contiguous and not out.flags.c_contiguous else ""])
        raise ConfigError(
            f"Tensor {name!r}: `out` must be a writeable numpy array of shape {arr.shape} and dtype "
            f"{arr.dtype}{layout}. Received: {type(out).__name__} with shape={getattr(out, 'shape', None)}, "
            f"dtype={getattr(out, 'dtype', None)}{flags}"
        )


def is_low_precision(dtype: np.dtype) -> bool:
    """float16 and bfloat16. Engines reduce them in 16 bits where they travel: each step
    combines two 16-bit values in float32 and rounds back, so a sum or product over N
    ranks rounds up to N - 1 times and min/max are exact; ``mean`` divides that sum in
    float32 and rounds once more. An engine with no 16-bit reduction for a dtype
    (Horovod's bfloat16) reduces in float32 and rounds once. Either way every rank gets
    bitwise the same result."""
    return (dtype.kind == "f" and dtype.itemsize == 2) or dtype.name == "bfloat16"


def apply_mean(buf: np.ndarray, op: "ReduceOp", size: int) -> None:
    """Turn a sum into a mean in place (floor division for integers)."""
    if op is ReduceOp.MEAN and size > 1 and buf.size:
        if buf.dtype.kind in "iu":
            np.floor_divide(buf, size, out=buf)
        elif not divide16(buf.reshape(-1) if buf.flags.c_contiguous else buf, size):  # 16 bits: vectorised
            np.divide(buf, buf.dtype.type(size), out=buf)




def even_counts(rows: int, parts: int) -> list[int]:
    """``rows`` split into ``parts`` near-equal counts, the first ones one larger (as
    Horovod's reducescatter splits the first dimension)."""
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def check_counts(name: str, arg: str, counts: Any, parts: int, rows: int) -> list[int]:
    """Validate per-rank row counts (``counts`` of a reduce-scatter, ``splits`` of an
    all-to-all): ``parts`` non-negative integers adding up to ``rows``."""
    arr = np.asarray(counts) if isinstance(counts, (list, tuple, np.ndarray)) else None
    if (arr is not None and arr.ndim == 1 and arr.size == parts and (arr.size == 0 or arr.dtype.kind in "iu")
            and bool((arr >= 0).all()) and int(arr.sum()) == rows):
        return [int(v) for v in arr]
    raise ConfigError(f"Tensor {name!r}: `{arg}` must be {parts} non-negative integers (one per rank of the "
                      f"group) adding up to the first dimension, {rows}. Received: {arg}={counts!r}")
