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


@pytest.mark.parametrize("wire", [F16, BF16], ids=["fp16", "bf16"])
def test_mean_division_gives_numpy_and_ml_dtypes_bits(wire: np.dtype) -> None:
    from hostreduce.reducers._args import ReduceOp, apply_mean

    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(wire)
    for size in (2, 3, 4, 7, 257, 1000):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = np.divide(every, wire.type(size))
            got = every.copy()
            assert C.divide16(got, size)
            grid = every.copy().reshape(256, 256)[:, ::2]  # not contiguous: numpy's own loop
            apply_mean(grid, ReduceOp.MEAN, size)
        np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))
        np.testing.assert_array_equal(grid.view(np.uint16), ref.reshape(256, 256)[:, ::2].view(np.uint16))
    assert not C.divide16(np.ones(3, np.float32), 2)


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


# ------------------------------------------------------------------ the ring casts in its pipeline


def test_pipeline_casts_of_a_fused_bucket_equal_whole_array_casts() -> None:
    """``Casts`` over arrays laid end to end (some empty), in chunks that straddle them."""
    from hostreduce.reducers.ring.algorithm import Casts

    rng = np.random.default_rng(3)
    srcs = [rng.standard_normal(k).astype(dt) for k, dt in ((0, np.float32), (7, np.float32), (0, np.float64),
                                                             (13, np.float64), (1, np.float32), (5, np.float32))]
    dsts = [np.zeros_like(s) for s in srcs]
    buf = np.zeros(26, BF16)
    casts = Casts(srcs, dsts, buf)
    for lo in range(0, 26, 4):
        casts.fill(lo, min(lo + 4, 26))
    np.testing.assert_array_equal(buf.view(np.uint16), np.concatenate([s.astype(BF16) for s in srcs]).view(np.uint16))
    for lo, hi in ((0, 3), (3, 20), (20, 21), (21, 26)):
        casts.drain(lo, hi)
    for s, d in zip(srcs, dsts):
        np.testing.assert_array_equal(d, s.astype(BF16).astype(s.dtype))


def _ring_input(rank: int, dtype: np.dtype, n: int, salt: int) -> np.ndarray:
    """Random values with ties, subnormals, infinities and NaN payloads among them."""
    rng = np.random.default_rng(100 * salt + rank)
    x = (rng.standard_normal(n) * 4.0 ** rng.integers(-9, 9, n)).astype(dtype)
    if n > 8 and dtype == np.float32:
        bits = _float32_bits()
        k = n // 3
        x[:k] = bits[rng.integers(0, bits.size, k)].view(np.float32)
    return x


def _ring_cases() -> list[tuple[str, str, np.dtype, str, int]]:
    # Sizes: empty, carried to rank 0 with the announcements (small), and many 4 KiB
    # chunks around the ring (odd counts: segments and chunks of unequal lengths).
    return [(f"{comp}/{np.dtype(dt).name}/{op}/{n}", comp, np.dtype(dt), op, n)
            for comp in ("fp16", "bf16") for dt in (np.float32, np.float64) for op in ("sum", "mean")
            for n in (0, 5, 200_001)]


def ring_compression_rank(rank: int, size: int, transport: str) -> dict:
    """Each case compressed by the ring (which casts inside its pipeline), blocking, async
    with out= in place, and fused with others; and as the cast-around path computes it:
    the engine all-reducing the 16-bit array, cast back."""
    from tests import ring_workers as w

    from hostreduce.reducers.compression import compressed

    got: dict[str, bytes] = {}
    with w.make_reducer(transport, chunk_bytes=4096, cycle_time_ms=20.0) as r:  # batched: fused
        for i, (name, comp, dt, op, n) in enumerate(_ring_cases()):
            x = _ring_input(rank, dt, n, i)
            wire = C.wire_dtype(comp, dt)
            got[name] = r.allreduce(name, x, op, compression=comp).tobytes()
            y = x.copy()
            assert r.allreduce_async(name, y, op, out=y, compression=comp).wait(60) is y
            old = compressed(name, x, wire, None, lambda a: r._allreduce_async(name, a, r._check_allreduce(
                name, a, op, None, None)[1], a, r.world)).wait(60)
            got[name + "/inplace"], got[name + "/old"] = y.tobytes(), old.tobytes()
        # Fused buckets: float32 and float64 cast to bf16 beside a tensor already in bf16,
        # submitted while a large all-reduce keeps the ring busy (so they are fused), each
        # too large to travel with its announcement.
        xs = [_ring_input(rank, np.dtype(dt), k, 50 + k) for dt, k in ((np.float32, 140_000), (np.float64, 150_001),
                                                                            (np.float32, 139_999))]
        native = _ring_input(rank, np.dtype(np.float32), 160_000, 60).astype(BF16)
        # The cast-around path's bits for them: each 16-bit tensor all-reduced alone (the
        # ring lays a bucket out segment by segment, so a tensor in a bucket is summed as
        # when it travels alone).
        for j, a in enumerate(xs):
            alone = r.allreduce(f"fused/{j}/alone", C.to_wire(a, BF16), "sum")
            got[f"fused/{j}/old"] = C.from_wire(alone, a.dtype).tobytes()
        got["fused/3/old"] = r.allreduce("fused/3/alone", native, "sum").tobytes()
        fused = False
        for _ in range(3):
            before = r.stats()["allreduce_buckets"]
            busy = r.allreduce_async("busy", np.ones(1 << 20, np.float32))
            hs = [r.allreduce_async(f"fused/{j}", a, "sum", compression="bf16") for j, a in enumerate(xs)]
            hs.append(r.allreduce_async("fused/native", native, "sum"))
            busy.wait(60)
            results = [h.wait(60).tobytes() for h in hs]
            if r.stats()["allreduce_buckets"] - before == 2 and not fused:  # all four in one bucket
                fused = True
                got.update((f"fused/{j}", v) for j, v in enumerate(results))
    return {"got": got, "fused": fused}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("size,transport", [(2, "grpc"), (3, "grpc"), (2, "shm")])
def test_ring_compression_is_bitwise_the_cast_around_result(size: int, transport: str) -> None:
    """Every rank gets the same bits, which are those of casting the whole array before
    and after the engine's 16-bit all-reduce; at N = 2 they are also numpy's and
    ml_dtypes' (the sum of the two 16-bit inputs, rounded once)."""
    from hostreduce.testing import run_ranks

    outs = run_ranks(ring_compression_rank, size, args=(transport,), timeout=200)
    got = [o["got"] for o in outs]
    for key in got[0]:
        assert len({g[key] for g in got}) == 1, f"{key} differs across ranks"
    for i, (name, comp, dt, op, n) in enumerate(_ring_cases()):
        assert got[0][name] == got[0][name + "/inplace"] == got[0][name + "/old"], name
        if size == 2:
            wire = C.wire_dtype(comp, dt)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                total = _ring_input(0, dt, n, i).astype(wire) + _ring_input(1, dt, n, i).astype(wire)
                if op == "mean":
                    total = total / wire.type(2)
                expect = total.astype(dt)
            assert got[0][name] == expect.tobytes(), name
    assert outs[0]["fused"], "the tensors submitted together were never fused into one bucket"
    for j in range(4):
        assert got[0][f"fused/{j}"] == got[0][f"fused/{j}/old"], f"fused/{j}"


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
    from hostreduce.ops.compression import engine_wire

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
