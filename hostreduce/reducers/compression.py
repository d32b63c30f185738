"""Wire compression: float gradients travel, and are summed, in 16 bits.

``compression="fp16"`` or ``"bf16"`` (per collective, or the config's default) casts a
float32 or float64 array to float16 or bfloat16 before the engine sees it and casts the
result back, as Horovod's ``Compression.fp16`` does: half the bytes (float32) cross the
wire. Engines add 16-bit data in float32 and round each partial sum back to 16 bits
where it travels, so the result is the same on every rank. Integers and arrays already
in 16 bits are not compressed. ``"none"`` turns compression off.

The casts and sums here give the same bits as numpy's float16 and ml_dtypes' bfloat16
(``astype`` and ``np.add``: a sum in float32 rounded to nearest even once), NaN and
infinity included, only faster: numpy converts float16 one element at a time in
software (about 15 ns an element on a CPU without AVX-512, where a 64 MiB gradient
would spend longer in the cast than on a 1 Gbit/s wire), and ml_dtypes adds bfloat16
one element at a time. Here float16 -> float32 is a lookup in a 65,536-entry table
built with numpy's own cast, float32 -> float16 is rounding done on the bits (below),
bfloat16 keeps ml_dtypes' casts (already vectorised), and a 16-bit sum widens both
operands to float32, adds there and rounds once, in blocks that stay in the L2 cache.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import ConfigError
from .handle import Handle, LinkedHandle

__all__ = ["COMPRESSIONS", "parse_compression", "wire_dtype", "compressed", "to_wire", "from_wire",
           "combine16", "divide16"]

COMPRESSIONS = ("none", "fp16", "bf16")

# Elements per pass of the blocked loops: five float32 temporaries of this length
# (1.25 MiB) stay in a core's L2 cache on current x86 and ARM servers.
BLOCK = 1 << 16

_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
_F16_TABLE: np.ndarray | None = None  # float16 bits -> float32, from numpy's own cast


def parse_compression(value: Any) -> str:
    text = "none" if value is None else value
    if not isinstance(text, str) or text.lower() not in COMPRESSIONS:
        raise ConfigError(f"`compression` must be one of {list(COMPRESSIONS)}. Received: compression={value!r}")
    return text.lower()


def _bf16() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def wire_dtype(compression: str, dtype: np.dtype) -> np.dtype | None:
    """The 16-bit dtype ``dtype`` travels as, or None when it travels as it is."""
    if compression == "none" or dtype.kind != "f" or dtype.itemsize < 4:
        return None
    return _F16 if compression == "fp16" else _bf16()


def compressed(name: str, arr: np.ndarray, wire: np.dtype, out: np.ndarray | None,
               start: Callable[[np.ndarray], Handle]) -> Handle:
    """Run ``start`` on ``arr`` cast to ``wire`` (a private copy the engine may reduce
    in place); the returned handle's result is cast back to ``arr``'s dtype (into
    ``out`` when given). Results that are not arrays (a non-root's reduce) pass through."""
    inner = start(to_wire(arr, wire))
    outer = LinkedHandle(name, inner)

    def done(h: Handle) -> None:
        try:
            result = h.wait(0)
            if isinstance(result, np.ndarray):
                result = from_wire(result, arr.dtype, out)
        except BaseException as e:  # noqa: BLE001 - the caller sees the engine's error
            outer.set_error(e)
            return
        outer.set_result(result)

    inner.add_done_callback(done)
    return outer


# --------------------------------------------------------------------------- casts


def to_wire(arr: np.ndarray, wire: np.dtype, out: np.ndarray | None = None) -> np.ndarray:
    """``arr.astype(wire)`` (into ``out`` when given), bit for bit."""
    src = np.ascontiguousarray(arr)
    res = np.empty(src.shape, wire) if out is None else out
    if src.dtype == _F32 and wire == _F16 and res.flags.c_contiguous:
        flat_in, flat_out = src.reshape(-1), res.reshape(-1)
        for lo in range(0, flat_in.size, BLOCK):
            _narrow_f16(flat_in[lo:lo + BLOCK], flat_out[lo:lo + BLOCK])
    else:  # bfloat16: ml_dtypes' cast is vectorised; float64: rare, rounded directly
        with np.errstate(invalid="ignore", over="ignore"):  # NaN and overflow are results here
            np.copyto(res, src, casting="unsafe")
    return res


def from_wire(w: np.ndarray, dtype: Any, out: np.ndarray | None = None) -> np.ndarray:
    """``w.astype(dtype)`` (into ``out`` when given), bit for bit."""
    res = np.empty(w.shape, dtype) if out is None else out
    if w.dtype == _F16 and res.dtype == _F32:
        np.take(_f16_table(), np.ascontiguousarray(w).view(np.uint16), out=res)
    else:
        np.copyto(res, w, casting="unsafe")
    return res


_SUMS = {"add": np.add, "multiply": np.multiply}


def combine16(dst: np.ndarray, src: np.ndarray, ufunc: Any, src_first: bool = False) -> bool:
    """``dst = dst (ufunc) src`` in place for 1-D float16/bfloat16 arrays, computed in
    float32 and rounded once, as numpy and ml_dtypes compute it (``src_first``: operands
    swapped). Returns False, doing nothing, for what it does not speed up (other
    dtypes and ufuncs, such as minimum and maximum, which are exact anyway)."""
    if _SUMS.get(getattr(ufunc, "__name__", "")) is not ufunc or not _is16(dst) or src.ndim != 1:
        return False
    n = dst.size
    a = np.empty(min(n, BLOCK), _F32)
    b = np.empty_like(a)
    for lo in range(0, n, BLOCK):
        hi = min(lo + BLOCK, n)
        x, y = a[:hi - lo], b[:hi - lo]
        from_wire(dst[lo:hi], _F32, x)
        from_wire(src[lo:hi], _F32, y)
        # Operands swapped against numpy's scalar loops: where both are NaN, x86 keeps
        # the first operand's payload, and the scalar loops keep the second one's.
        if src_first:
            ufunc(x, y, out=x)
        else:
            ufunc(y, x, out=x)
        _narrow16(x, dst[lo:hi])
    return True


def divide16(buf: np.ndarray, divisor: int) -> bool:
    """``buf /= buf.dtype.type(divisor)`` in place for a 1-D float16/bfloat16 array (a
    mean's division), computed in float32 and rounded once, as numpy and ml_dtypes
    compute it (their loops go one element at a time). False, doing nothing, for
    other arrays."""
    if not _is16(buf):
        return False
    d = np.float32(buf.dtype.type(divisor))
    x = np.empty(min(buf.size, BLOCK), _F32)
    for lo in range(0, buf.size, BLOCK):
        hi = min(lo + BLOCK, buf.size)
        y = from_wire(buf[lo:hi], _F32, x[:hi - lo])
        np.divide(y, d, out=y)
        _narrow16(y, buf[lo:hi])
    return True


def _is16(arr: np.ndarray) -> bool:
    return arr.ndim == 1 and (arr.dtype == _F16 or arr.dtype.name == "bfloat16")


def _narrow16(x: np.ndarray, out: np.ndarray) -> None:
    """float32 ``x`` rounded to ``out``'s 16-bit dtype, into it."""
    if out.dtype == _F16:
        _narrow_f16(x, out)
    else:
        np.copyto(out, x, casting="unsafe")


def _f16_table() -> np.ndarray:
    global _F16_TABLE
    if _F16_TABLE is None:
        _F16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    return _F16_TABLE


def _narrow_f16(x: np.ndarray, out: np.ndarray) -> None:
    """float32 -> float16 rounded to nearest even, as numpy's cast: on the magnitude's
    bits, a normal result is the exponent rebiased and the mantissa's top 10 bits,
    rounded by adding 0xfff plus the lowest kept bit before shifting (a carry into the
    exponent is the right result, up to infinity at 65520); a subnormal result (|x| <
    2**-14) is the low bits of |x| + 0.5 in float32, whose addition rounds to the
    float16 subnormal step, 2**-24. The two are blended without branches (masked numpy
    loops run ten times slower). Beyond 65536, infinity and NaN (which keeps its
    payload's top bits, as numpy keeps them) are rare: fixed afterwards."""
    u = x.view(np.uint32)
    mag = np.bitwise_and(u, 0x7FFFFFFF)
    norm = np.right_shift(mag, 13)
    norm &= 1
    norm += mag
    norm += np.uint32(0xFFF - (112 << 23) & 0xFFFFFFFF)  # wraps below 2**-14: blended away
    norm >>= 13
    with np.errstate(invalid="ignore"):  # NaN lanes: fixed below
        sub = np.add(mag.view(np.float32), np.float32(0.5)).view(np.uint32)
    sub -= 0x3F000000
    mask = np.subtract(mag, 0x38800000).view(np.int32)  # < 0 (all ones after >>) below 2**-14
    mask >>= 31
    sub ^= norm
    sub &= mask.view(np.uint32)
    norm ^= sub
    np.right_shift(u, 16, out=sub)
    sub &= 0x8000
    norm |= sub
    bits = out.view(np.uint16)
    np.copyto(bits, norm, casting="unsafe")
    if mag.size and mag.max() >= 0x47800000:
        big = mag >= 0x47800000
        m, sign = mag[big], (u[big] >> 16) & 0x8000
        payload = (m >> 13) & 0x3FF
        payload[(payload == 0) & (m > 0x7F800000)] = 1  # a NaN must not turn into infinity
        payload[m <= 0x7F800000] = 0  # overflow and infinity: infinity
        bits[big] = (0x7C00 | payload | sign).astype(np.uint16)
