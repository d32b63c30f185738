"""Wire compression (``reducers/compression.py``): the fast 16-bit casts and sums give
numpy's and ml_dtypes' bits (NaN, infinity, ties and subnormals included); which dtypes
are compressed; ``out=``; bad values; and, end to end, that ``Compression.bf16`` /
``fp16`` really reach the wire when two ring workers train (the weights move away from
the uncompressed run by about 16-bit rounding, and stay equal on both ranks)."""
from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

from hostreduce.errors import ConfigError
from hostreduce.reducers import compression as C
from hostreduce.reducers.local import LocalReducer

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)


def _float32_bits() -> np.ndarray:
    """Random bit patterns, every float16 value, the ties between neighbours and the
    patterns next to them, subnormals, NaN payloads and the overflow edge."""
    rng = np.random.default_rng(0)
    patterns = [rng.integers(0, 2**32, 1 << 18, dtype=np.uint64).astype(np.uint32)]
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    h = halves.view(np.uint32)
    for delta in (0, 1, -1, 1 << 12, (1 << 12) - 1, (1 << 12) + 1, 1 << 13, 1 << 15, 1 << 16, 0x7FFF, 0x8000):
        patterns.append((h.astype(np.int64) + delta).astype(np.uint32))
    special = [0x7F800000, 0xFF800000, 0x7F800001, 0xFFC00000, 0x7FFFFFFF, 0x7F802000, 0x477FEFFF, 0x477FF000,
               0x47800000, 0x7F7FFFFF, 0x00000001, 0x80000001, 0x33000000, 0x33000001, 0x387FFFFF, 0x38800000]
    patterns.append(np.array(special, np.uint32))
    return np.concatenate(patterns)


@pytest.mark.parametrize("wire", [F16, BF16], ids=["fp16", "bf16"])
def test_casts_give_astype_bits(wire: np.dtype) -> None:
    x = _float32_bits().view(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = x.astype(wire)
    got = C.to_wire(x, wire)
    assert got.dtype == wire
    np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(wire)
    back = C.from_wire(every, np.float32)
    np.testing.assert_array_equal(back.view(np.uint32), every.astype(np.float32).view(np.uint32))
    out = np.empty(x.shape, np.float32)
    assert C.from_wire(got, np.float32, out) is out
    w2 = np.empty(x.shape, wire)
    assert C.to_wire(x, wire, w2) is w2 and (w2.view(np.uint16) == ref.view(np.uint16)).all()
    # float64 and odd layouts go through astype
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x64 = x[::3].astype(np.float64)
        np.testing.assert_array_equal(C.to_wire(x64, wire).view(np.uint16), x64.astype(wire).view(np.uint16))


@pytest.mark.parametrize("wire", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("ufunc", [np.add, np.multiply])
def test_sums_give_numpy_and_ml_dtypes_bits(wire: np.dtype, ufunc) -> None:
    bits = _float32_bits()
    rng = np.random.default_rng(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = bits.view(np.float32).astype(wire)
        b = rng.permutation(bits).view(np.float32).astype(wire)
        for src_first in (False, True):
            ref = ufunc(b, a) if src_first else ufunc(a, b)
            dst = a.copy()
            assert C.combine16(dst, b, ufunc, src_first)
            np.testing.assert_array_equal(dst.view(np.uint16), ref.view(np.uint16))


def test_combine16_declines_what_it_does_not_speed_up() -> None:
    a = np.ones(4, F16)
    assert not C.combine16(a, a.copy(), np.maximum)
    assert not C.combine16(np.ones(4, np.float32), np.ones(4, np.float32), np.add)
    assert not C.combine16(np.ones((2, 2), F16), np.ones((2, 2), F16), np.add)


def test_wire_dtype_and_parse() -> None:
    assert C.wire_dtype("fp16", np.dtype(np.float32)) == F16
    assert C.wire_dtype("bf16", np.dtype(np.float64)) == BF16
    for dt in (np.float16, BF16, np.int32, np.int64, np.uint8, np.bool_):
        assert C.wire_dtype("bf16", np.dtype(dt)) is None
    assert C.wire_dtype("none", np.dtype(np.float32)) is None
    assert C.parse_compression(None) == "none" and C.parse_compression("BF16") == "bf16"
    for bad in ("fp8", "", 16, True):
        with pytest.raises(ConfigError, match=r"`compression` must be one of \['none', 'fp16', 'bf16'\]"):
            C.parse_compression(bad)


@pytest.mark.parametrize("comp", ["fp16", "bf16"])
def test_reducer_rounds_through_the_wire_dtype_and_honours_out(comp: str) -> None:
    r = LocalReducer()
    x = np.linspace(-3, 3, 1001, dtype=np.float32) + np.float32(1e-3)
    wire = C.wire_dtype(comp, x.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expect = x.astype(wire).astype(np.float32)
    got = r.allreduce("x", x, op="sum", compression=comp)
    assert got.dtype == np.float32 and not np.array_equal(got, x)
    np.testing.assert_array_equal(got, expect)
    out = np.empty_like(x)
    assert r.allreduce("x", x, op="sum", out=out, compression=comp) is out
    np.testing.assert_array_equal(out, expect)
    ints = np.arange(5, dtype=np.int32)
    np.testing.assert_array_equal(r.allreduce("i", ints, op="sum", compression=comp), ints)
    np.testing.assert_array_equal(r.allreduce("x", x, op="sum", compression="none"), x)
    with pytest.raises(ConfigError, match="`compression` must be one of"):
        r.allreduce("x", x, compression="int8")
    r.close()


# ------------------------------------------------------------------ end to end


def train_rank(rank: int, size: int) -> dict:
    """Two ring workers train a tiny model 5 steps with each compression (horovod API:
    DistributedGradientTape, whose fp16/bf16 go to the engine's wire compression)."""
    import tensorflow as tf

    import hostreduce.horovod as hvd

    hvd.init()
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((64, 16)).astype(np.float32)
    y = rng.standard_normal((64, 1)).astype(np.float32)
    out = {}
    for name, comp in (("none", hvd.Compression.none), ("fp16", hvd.Compression.fp16),
                       ("bf16", hvd.Compression.bf16)):
        init = np.random.default_rng(7)
        w1 = tf.Variable(init.standard_normal((16, 32)).astype(np.float32) * 0.3)
        w2 = tf.Variable(init.standard_normal((32, 1)).astype(np.float32) * 0.3)
        opt = tf.keras.optimizers.SGD(0.05)
        for _ in range(5):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((tf.nn.relu(x @ w1) @ w2 - y) ** 2)
            tape = hvd.DistributedGradientTape(tape, compression=comp)
            grads = tape.gradient(loss, [w1, w2])
            opt.apply_gradients(zip(grads, [w1, w2]))
        out[name] = [w1.numpy(), w2.numpy()]
    hvd.shutdown()
    return out


@pytest.mark.tf
def test_training_on_two_ring_workers_really_compresses() -> None:
    from hostreduce.testing import run_ranks

    ranks = run_ranks(train_rank, 2, timeout=120)
    for comp in ("none", "fp16", "bf16"):
        for a, b in zip(ranks[0][comp], ranks[1][comp]):
            np.testing.assert_array_equal(a, b)  # bitwise equal on both ranks
    ref = ranks[0]["none"]
    # 5 SGD steps of 16-bit-rounded gradients: off by about the rounding, not more.
    for comp, rel in (("fp16", 2.0 ** -10), ("bf16", 2.0 ** -7)):
        for w, w0 in zip(ranks[0][comp], ref):
            diff = np.abs(w - w0).max()
            assert diff > 0, f"{comp}: the weights equal the uncompressed run's: nothing was compressed"
            assert diff < 5 * 0.05 * rel * 10, f"{comp}: off by {diff}, more than 16-bit rounding explains"


@pytest.mark.tf
def test_horovod_compression_api() -> None:
    import tensorflow as tf

    from hostreduce.horovod import Compression
    from hostreduce.horovod._compression import engine_wire

    x = tf.constant([1.0, 1.0 + 2.0 ** -9, 3.0], tf.float32)
    for comp, dt in ((Compression.fp16, tf.float16), (Compression.bf16, tf.bfloat16)):
        wire, ctx = comp.compress(x)  # Horovod's static methods still cast in TensorFlow
        assert wire.dtype == dt and ctx == tf.float32
        assert comp.decompress(wire, ctx).dtype == tf.float32
        assert comp.compress(tf.constant([1, 2]))[1] is None
    assert engine_wire(Compression.bf16, x) == "bf16"  # cast on the host by the engine
    assert engine_wire(Compression.fp16, x) is None  # tf.cast (F16C) beats numpy's float16
    assert engine_wire(Compression.bf16, tf.constant([1, 2])) is None
    assert engine_wire(Compression.none, x) is None

    class Mine(Compression.bf16):  # a user's own compressor keeps its own casts
        pass

    assert engine_wire(Mine, x) is None
