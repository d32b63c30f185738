"""A sharded table's initial value computed by blocks of rows, so that TensorFlow never
holds it whole (the chief, registering the table on the ps).

Why: with oneDNN (TensorFlow's default on x86 Linux, ``TF_ENABLE_ONEDNN_OPTS``) every
CPU tensor of 4 KiB or more comes from a BFC pool (``MklCPUAllocator``) that grows to
the largest amount in use at once and never gives memory back to the system, neither
when the tensors are freed nor on ``malloc_trim``. A table's initializer run whole
(a Keras ``RandomUniform`` over 1M x 64 float32: the random bits, the scaled and the
shifted value, 3 x 256 MiB) would thus stay resident in the chief for the rest of the
job, although nothing refers to it once the ps hold the table.

How: ``initial()`` (the deferred initial value, which builds the whole shape) runs
once per block with the ops that make a tensor of the table's whole shape answering
for the block's rows only: TensorFlow's stateless random ops (Keras 3's and tf_keras's
seeded and unseeded random initializers, ``tf.random.stateless_*``), with their Philox
counter advanced to the block's first element, which gives exactly the values of those
rows in the whole tensor; and ``Fill`` (``tf.zeros``, ``tf.ones``, Keras ``Constant``).
Everything else runs as it is and is watched (an op callback): a block is only
accepted if every op that touched its rows is elementwise, and every block's random
ops were asked for the same seed. Any other initializer (``Orthogonal``, ``Identity``,
TF1's stateful random ops, numpy values) is computed whole, as before, with a warning
that TensorFlow may keep that memory.

The value is the same, bit for bit, as the one computed whole (``tests/test_initial_rows.py``).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import numpy as np

from ..errors import NotByRowsError

__all__ = ["initial_value_in_rows", "BLOCK_BYTES"]

logger = logging.getLogger("hostreduce.ps")

BLOCK_BYTES = 1 << 20  # per block: TensorFlow's pool grows by a few of these at most (1M x 64 float32: +6 MiB)

# Philox counter steps per output element of TensorFlow's CPU/GPU kernels
# (random/random_distributions.h, random_op_cpu.h): one step gives 4 uint32, i.e. 4
# floats of up to 32 bits or 2 doubles; a truncated normal reserves 256 samples for
# each output group, i.e. 64 steps per element.
_RANDOM_OPS = {"stateless_random_uniform_v2": "StatelessRandomUniformV2",
               "stateless_random_normal_v2": "StatelessRandomNormalV2",
               "stateless_truncated_normal_v2": "StatelessTruncatedNormalV2"}
_PHILOX, _AUTO_SELECT = 1, 3
_ROW_ALIGN = 4  # block starts: a multiple of 4 rows, so of every op's output group
# Ops that may touch a block's rows: elementwise, so its rows are the whole's rows.
_ELEMENTWISE = {"Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "Neg", "Cast", "Identity", "Maximum", "Minimum",
                "Abs", "Square", "Sqrt", "Rsqrt", "Exp", "Log", "Tanh", "Sigmoid", "Sign", "Floor", "Ceil", "Round",
                "ClipByValue", "FloorMod"}
# Ops that compute seeds, keys and counters (small tensors) from a seed.
_SEEDS = {"StatelessRandomGetKeyCounter", "StatelessRandomUniformFullIntV2", "BitwiseOr", "LeftShift", "Pack",
          "Reshape", "StridedSlice", "Const"}
_SOURCES = set(_RANDOM_OPS.values()) | {"Fill"}


class _Block:
    """The routes and the watch while ``initial()`` computes rows ``[start, stop)``."""

    def __init__(self, full_shape: tuple[int, ...], start: int, stop: int) -> None:
        self.full = [int(d) for d in full_shape]
        self.shape = tuple([stop - start] + self.full[1:])
        self.first_element = start * int(np.prod(self.full[1:], dtype=np.int64))
        self.seeds: list[tuple[str, tuple[int, ...], tuple[int, ...], int]] = []  # per random op: key, counter, alg
        self.wrong: str | None = None   # why the block is not the whole's rows
        self.answered = False           # whether an op made the block's rows instead of the whole

    def _whole(self, shape: Any) -> bool:
        try:
            return [int(d) for d in np.asarray(shape).reshape(-1)] == self.full
        except (TypeError, ValueError):
            return False

    def random(self, op: str) -> Callable[..., Any]:
        def route(original: Any, shape: Any, key: Any, counter: Any, alg: Any, dtype: Any = None,
                  name: Any = None) -> Any:
            import tensorflow as tf

            kwargs = {"name": name} if dtype is None else {"dtype": dtype, "name": name}
            if not self._whole(shape):
                return original(shape, key, counter, alg, **kwargs)
            try:
                key_v = tuple(int(k) for k in np.asarray(key).reshape(-1))
                count = [int(c) for c in np.asarray(counter).reshape(-1)]
                alg_v = int(np.asarray(alg))
            except (TypeError, ValueError):  # not eager values: leave it whole
                return original(shape, key, counter, alg, **kwargs)
            if alg_v not in (_PHILOX, _AUTO_SELECT) or len(count) != 2:
                return original(shape, key, counter, alg, **kwargs)
            self.seeds.append((op, key_v, tuple(count), alg_v))
            self.answered = True
            size = tf.as_dtype(dtype or tf.float32).size
            steps = self.first_element * 64 if op == "StatelessTruncatedNormalV2" else \
                self.first_element // (2 if size == 8 else 4)
            low = count[0] + steps
            moved = np.array([low & (2**64 - 1), (count[1] + (low >> 64)) & (2**64 - 1)], np.uint64)
            return original(list(self.shape), key, tf.constant(moved), alg, **kwargs)
        return route

    def fill(self, original: Any, dims: Any, value: Any, name: Any = None) -> Any:
        if not self._whole(dims):
            return original(dims, value, name=name)
        self.answered = True
        return original(list(self.shape), value, name=name)

    def watch(self, op_type: Any, inputs: Any, attrs: Any, outputs: Any, op_name: Any = None,
              graph: Any = None) -> None:
        op = op_type.decode() if isinstance(op_type, bytes) else str(op_type)
        rows_in = any(tuple(t.shape) == self.shape for t in inputs)
        rows_out = any(tuple(t.shape) == self.shape for t in outputs)
        if op in _SOURCES and not rows_in:
            return
        if op in _ELEMENTWISE:
            if not rows_in or all(tuple(t.shape) == self.shape for t in outputs):
                return
        elif op in _SEEDS and not (rows_in or rows_out):
            return
        # Raised here, the call ends at once: before a seed generator's state is
        # advanced (Keras's SeedGenerator reads its state first), so that the call
        # that computes the value whole draws the seed an unrouted call would.
        self.wrong = f"it runs {op}"
        raise NotByRowsError(self.wrong)

    @contextlib.contextmanager
    def routes(self) -> Iterator[None]:
        from tensorflow.python.framework import op_callbacks
        from tensorflow.python.ops import gen_array_ops, gen_stateless_random_ops_v2

        from ..host.patch import routed

        with contextlib.ExitStack() as stack:
            for fn, op in _RANDOM_OPS.items():
                stack.enter_context(routed(gen_stateless_random_ops_v2, fn, self.random(op)))
            stack.enter_context(routed(gen_array_ops, "fill", self.fill))
            op_callbacks.add_op_callback(self.watch)
            stack.callback(op_callbacks.remove_op_callback, self.watch)
            yield


def _numpy(value: Any) -> np.ndarray:
    return np.asarray(value.numpy() if hasattr(value, "numpy") else value)


def _rows(initial: Callable[[], Any], full_shape: tuple[int, ...], block_rows: int) -> tuple[np.ndarray, bool]:
    """The value, and whether it was computed by blocks of ``block_rows``: if none of
    ``initial``'s ops answered for a block, its first call computed the value whole."""
    out: np.ndarray | None = None
    seeds = None
    for start in range(0, full_shape[0], block_rows):
        stop = min(full_shape[0], start + block_rows)
        block = _Block(full_shape, start, stop)
        with block.routes():
            value = _numpy(initial())
        if start == 0 and not block.answered and value.shape == full_shape:
            return value, stop == full_shape[0]  # untouched: the whole value, as computed without routes
        if block.wrong:
            raise NotByRowsError(block.wrong)
        if seeds is not None and block.seeds != seeds:
            raise NotByRowsError("its random ops draw a new seed on each call")
        seeds = block.seeds
        if value.shape != block.shape:
            raise NotByRowsError(f"it made a value of shape {list(value.shape)} for rows of shape {list(block.shape)}")
        if out is None:
            out = np.empty(full_shape, value.dtype)
        out[start:stop] = value
    assert out is not None
    return out, True


def initial_value_in_rows(initial: Callable[[], Any], full_shape: tuple[int, ...], dtype: Any, name: str = "",
                          block_bytes: int | None = None) -> np.ndarray:
    """The value of ``initial()`` (a table of ``full_shape``), computed by blocks of
    about ``block_bytes`` (default :data:`BLOCK_BYTES`) where its ops allow (see the
    module's docstring), else whole. On the host, as the variable store creates an
    ordinary variable's value (and no accelerator's pool keeps the table either)."""
    import tensorflow as tf

    with tf.device("/CPU:0"):
        return _initial_value(initial, full_shape, dtype, name, block_bytes)


def _initial_value(initial: Callable[[], Any], full_shape: tuple[int, ...], dtype: Any, name: str,
                   block_bytes: int | None) -> np.ndarray:
    import tensorflow as tf

    block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
    full_shape = tuple(int(d) for d in full_shape)
    row_bytes = int(np.prod(full_shape[1:], dtype=np.int64)) * tf.as_dtype(dtype).size
    block_rows = max(_ROW_ALIGN, block_bytes // max(row_bytes, 1) // _ROW_ALIGN * _ROW_ALIGN)
    if not full_shape or full_shape[0] <= block_rows:  # one block: the whole value
        return _numpy(initial()).reshape(full_shape)
    value: np.ndarray | None = None
    try:
        value, by_rows = _rows(initial, full_shape, block_rows)
        why = "none of its ops makes a tensor of the table's shape by rows"
    except NotByRowsError as e:
        by_rows, why = False, str(e)
    except Exception as e:  # noqa: BLE001 - e.g. a reshape to the whole shape: computed whole instead
        by_rows, why = False, f"it fails on a block of rows: {type(e).__name__}"
    if not by_rows:
        nbytes = int(np.prod(full_shape, dtype=np.int64)) * tf.as_dtype(dtype).size
        logger.warning("The initial value of %s (shape %s, %d MiB) is computed whole on the chief, not by blocks of "
                       "rows (%s): TensorFlow's CPU allocator may keep that memory for the rest of the job",
                       name or "a table", list(full_shape), nbytes >> 20, why)
        if value is None:
            value = _numpy(initial())
    assert value is not None
    return value.reshape(full_shape)
