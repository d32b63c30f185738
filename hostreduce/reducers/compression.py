"""Wire compression: float gradients travel, and are summed, in 16 bits.

``compression="fp16"`` or ``"bf16"`` (per collective, or the config's default) casts a
float32 or float64 array to float16 or bfloat16 before the engine sees it and casts the
result back, as Horovod's ``Compression.fp16`` does: half the bytes (float32) cross the
wire. Engines add 16-bit data in float32 and round each partial sum back to 16 bits
where it travels, so the result is the same on every rank. Integers and arrays already
in 16 bits are not compressed. ``"none"`` turns compression off.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import ConfigError
from .handle import Handle

__all__ = ["COMPRESSIONS", "parse_compression", "wire_dtype", "compressed"]

COMPRESSIONS = ("none", "fp16", "bf16")


def parse_compression(value: Any) -> str:
    text = "none" if value is None else value
    if not isinstance(text, str) or text.lower() not in COMPRESSIONS:
        raise ConfigError(f"`compression` must be one of {list(COMPRESSIONS)}. Received: compression={value!r}")
    return text.lower()


def wire_dtype(compression: str, dtype: np.dtype) -> np.dtype | None:
    """The 16-bit dtype ``dtype`` travels as, or None when it travels as it is."""
    if compression == "none" or dtype.kind != "f" or dtype.itemsize < 4:
        return None
    if compression == "fp16":
        return np.dtype(np.float16)
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def compressed(name: str, arr: np.ndarray, wire: np.dtype, out: np.ndarray | None,
               start: Callable[[np.ndarray], Handle]) -> Handle:
    """Run ``start`` on ``arr`` cast to ``wire``; the returned handle's result is cast
    back to ``arr``'s dtype (into ``out`` when given). Results that are not arrays
    (a non-root's reduce) pass through."""
    inner = start(arr.astype(wire))
    outer = Handle(name)

    def done(h: Handle) -> None:
        try:
            result = h.wait(0)
        except BaseException as e:  # noqa: BLE001 - the caller sees the engine's error
            outer.set_error(e)
            return
        if isinstance(result, np.ndarray):
            if out is not None:
                np.copyto(out, result, casting="unsafe")
                result = out
            else:
                result = result.astype(arr.dtype)
        outer.set_result(result)

    inner.add_done_callback(done)
    return outer
