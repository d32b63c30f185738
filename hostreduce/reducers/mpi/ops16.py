"""MPI reductions of float16 and bfloat16 that keep the data in 16 bits on the wire.

MPI has no predefined reduction for 2-byte floats. Widening them to float32 before the
collective would double the bytes sent, which defeats wire compression; instead the
data travels as 2-byte elements (``MPI.UINT16_T``) and a user-defined, commutative
operation combines two buffers: it widens both to float32, combines them there (exact
for ``min``/``max``; one rounding back to 16 bits per ``sum``/``prod`` step) and writes
the 16-bit result. IEEE addition and multiplication of two values are commutative, and
MPI computes each element's final value once per reduction step, so every rank gets
bitwise the same result whatever order the library pairs the ranks in.

The operations are created once per process (``MPI.Op.Create`` is local, not collective)
and freed when mpi4py finalizes MPI.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .._args import ReduceOp, is_low_precision

__all__ = ["is_low_precision", "op16", "wire16"]

_COMBINE = {
    ReduceOp.SUM: np.add,
    ReduceOp.MEAN: np.add,  # the division by the group size follows the reduction
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}
_ops: dict[tuple[str, ReduceOp], Any] = {}
_lock = threading.Lock()


def _make(dtype: np.dtype, ufunc: Any) -> Any:
    def combine(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        a = np.frombuffer(inbuf, dtype)
        b = np.frombuffer(inoutbuf, dtype)
        wide = a.astype(np.float32)
        ufunc(wide, b.astype(np.float32), out=wide)
        b[...] = wide.astype(dtype)  # b is a view of MPI's in-out buffer

    return combine


def op16(MPI: Any, dtype: np.dtype, op: ReduceOp) -> Any:
    """The MPI operation reducing 2-byte ``dtype`` (float16 or bfloat16) elements with ``op``."""
    key = (dtype.name, op)
    with _lock:
        if key not in _ops:
            _ops[key] = MPI.Op.Create(_make(dtype, _COMBINE[op]), commute=True)
        return _ops[key]


def wire16(MPI: Any) -> Any:
    """The MPI datatype 2-byte floats travel as (reduced only by :func:`op16`'s ops)."""
    return MPI.UINT16_T
