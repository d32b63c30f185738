"""The contract the Reducer base owns for every engine: argument checks, closed
reducers, 0-d all-gather inputs, mean and low-precision helpers (the 'local' engine
stands in for all; the multi-process engines run the same checks)."""
from __future__ import annotations

import numpy as np
import pytest

from hostreduce.errors import ConfigError, ReducerClosedError
from hostreduce.reducers import create_reducer
from hostreduce.reducers.base import ReduceOp, apply_mean, check_out, is_low_precision


@pytest.fixture
def reducer():
    r = create_reducer("local")
    yield r
    r.close()


def test_out_must_match_be_writeable_and_contiguous_where_required(reducer):
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ConfigError, match=r"`out` must be a writeable numpy array of shape \(2, 3\) and dtype "
                                          r"float32. Received: ndarray with shape=\(3, 2\)"):
        reducer.allreduce("x", x, out=np.empty((3, 2), np.float32))
    with pytest.raises(ConfigError, match="Received: list with shape=None"):
        reducer.allreduce("x", x, out=[0.0] * 6)
    frozen = np.empty((2, 3), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ConfigError, match="read-only"):
        reducer.allreduce_async("x", x, out=frozen)
    strided = np.empty((3, 2), np.float32).T
    assert reducer.allreduce("x", x, out=strided) is strided  # accepted where not required
    with pytest.raises(ConfigError, match="C-contiguous. Received: .*not C-contiguous"):
        check_out("x", x, strided, contiguous=True)


def test_name_dtype_op_root_and_timeout_are_checked(reducer):
    with pytest.raises(ConfigError, match="`name` must be a non-empty string. Received: name=''"):
        reducer.allreduce("", np.ones(1, np.float32))
    with pytest.raises(ConfigError, match="dtype must be one of .* Received: dtype=complex64"):
        reducer.broadcast("b", np.ones(1, np.complex64))
    with pytest.raises(ConfigError, match="a reduction needs a numeric dtype.* Received: dtype=bool"):
        reducer.allreduce("b", np.ones(1, np.bool_))
    with pytest.raises(ConfigError, match="`op` must be one of .* Received: op='xor'"):
        reducer.allreduce("x", np.ones(1, np.float32), op="xor")
    with pytest.raises(ConfigError, match=r"`root` must be an integer in \[0, 1\). Received: root=1"):
        reducer.broadcast("b", np.ones(1, np.float32), root=1)
    with pytest.raises(ConfigError, match="`timeout` must be a number > 0 or None. Received: timeout=0"):
        reducer.barrier(timeout=0)


def test_zero_d_allgather_is_one_row_and_a_closed_reducer_refuses_work(reducer):
    np.testing.assert_array_equal(reducer.allgather("g", np.float32(2.0)), np.array([2.0], np.float32))
    reducer.close()
    with pytest.raises(ReducerClosedError, match="'local' reducer is closed"):
        reducer.allreduce("x", np.ones(1, np.float32))
    with pytest.raises(ReducerClosedError):
        reducer.barrier()


def test_mean_floors_integers_and_low_precision_is_float16_and_bfloat16():
    ints = np.array([7, -7], np.int64)
    apply_mean(ints, ReduceOp.MEAN, 2)
    assert ints.tolist() == [3, -4]
    floats = np.array([3.0], np.float32)
    apply_mean(floats, ReduceOp.SUM, 2)
    assert floats[0] == 3.0
    apply_mean(floats, ReduceOp.MEAN, 2)
    assert floats[0] == 1.5
    assert is_low_precision(np.dtype(np.float16)) and not is_low_precision(np.dtype(np.float32))
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert is_low_precision(np.dtype(ml_dtypes.bfloat16))


def test_every_collective_on_one_rank_matches_numpy(reducer):
    from tests.collectives_check import agree, check_all

    digests = check_all(reducer)
    agree(reducer, digests)
    assert len(digests["0"]) > 60


def test_collective_arguments_are_checked(reducer):
    x = np.ones((4, 2), np.float32)
    with pytest.raises(ConfigError, match=r"`counts` must be 1 non-negative integers .* Received: counts=\[3\]"):
        reducer.reduce_scatter("rs", x, counts=[3])
    with pytest.raises(ConfigError, match=r"`splits` must be 1 non-negative integers .* Received: splits=\[-4\]"):
        reducer.alltoall("a", x, splits=[-4])
    with pytest.raises(ConfigError, match="needs at least one dimension"):
        reducer.reduce_scatter("rs", np.float32(1))
    with pytest.raises(ConfigError, match=r"`root` must be an integer in \[0, 1\). Received: root=2"):
        reducer.reduce("r", x, root=2)
    with pytest.raises(ConfigError, match="`dst` must be another rank than this one"):
        reducer.send("s", x, 0)
    with pytest.raises(ConfigError, match="`shape` must be a sequence of non-negative integers"):
        reducer.recv("s", 0, (-1,), np.float32)
    with pytest.raises(ConfigError, match="`compression` must be one of .* Received: compression='zip'"):
        reducer.allreduce("x", x, compression="zip")
    with pytest.raises(ConfigError, match=r"`ranks` must be a non-empty list of distinct integers in \[0, 1\). "
                                          r"Received: ranks=\[0, 0\]"):
        reducer.create_group([0, 0])
    with pytest.raises(ConfigError, match="`group` must be None .* Received: group='g'"):
        reducer.allreduce("x", x, group="g")
    with pytest.raises(ConfigError, match="the world group cannot be destroyed"):
        reducer.destroy_group(reducer.world)


def test_groups_and_compression_on_one_rank(reducer):
    from hostreduce.reducers.groups import make_group

    g = make_group([3, 1], world_rank=1, world_size=4)
    assert (g.ranks, g.rank, g.size, g.key, g.is_member) == ((1, 3), 0, 2, "1,3", True)
    assert make_group([2], world_rank=0, world_size=4).rank == -1
    assert reducer.create_group([0]) is reducer.world
    x = np.array([1.0 + 2 ** -10, 3.0], np.float32)
    out = np.empty_like(x)
    assert reducer.allreduce("c", x, out=out, compression="bf16") is out
    np.testing.assert_array_equal(out, np.array([1.0, 3.0], np.float32))  # rounded through bfloat16
    assert reducer.allreduce("c", x, compression="fp16")[0] == np.float32(np.float16(x[0]))
    np.testing.assert_array_equal(reducer.allreduce("i", np.arange(3), compression="bf16"), np.arange(3))
