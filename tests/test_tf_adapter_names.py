"""TF Adapter's names resolve on ``import hostreduce as npu`` (the one line a port
changes), with TF Adapter's argument names, order and defaults; names hostreduce cannot
run raise ``UnsupportedCallError`` saying what to use instead. One process: every call
leaves its input as it is (``tests/test_examples_tf2.py`` runs a ported script on two
workers)."""
from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from tests.script_jobs import ROOT, base_env

WORLD = "hccl_world_group"
# TF Adapter's signatures: (parameter, default) in order; ``inspect.Parameter.empty`` for none.
_ = inspect.Parameter.empty
SIGNATURES = {
    "distribute.all_reduce": [("values", _), ("reduction", "mean"), ("fusion", 1), ("fusion_id", -1),
                              ("group", WORLD)],
    "distribute.broadcast": [("values", _), ("root_rank", 0), ("fusion", 2), ("fusion_id", 0), ("group", WORLD)],
    "distribute.shard_and_rebatch_dataset": [("dataset", _), ("global_bs", _)],
    "distribute.npu_distributed_keras_optimizer_wrapper": [("optimizer", _), ("reduce_reduction", "mean"),
                                                           ("fusion", 1), ("fusion_id", -1), ("group", WORLD)],
    "distribute.npu_allreduce": [("values", _), ("reduction", "mean"), ("fusion", 1), ("fusion_id", -1),
                                 ("group", WORLD)],
    "distribute.npu_distributed_optimizer_wrapper": [("tf_optimizer", _)],
    "distribute.grouping_broadcast": [("vars", _)],
    "hccl.allreduce": [("tensor", _), ("reduction", _), ("fusion", 1), ("fusion_id", -1), ("group", WORLD)],
    "hccl.allgather": [("tensor", _), ("rank_size", _), ("fusion", 0), ("fusion_id", -1), ("group", WORLD)],
    "hccl.broadcast": [("tensor", _), ("root_rank", _), ("fusion", 2), ("fusion_id", 0), ("group", WORLD)],
    "hccl.reduce": [("tensor", _), ("reduction", _), ("root_rank", _), ("fusion", 0), ("fusion_id", -1),
                    ("group", WORLD)],
    "hccl.reduce_scatter": [("tensor", _), ("reduction", _), ("rank_size", _), ("fusion", 0), ("fusion_id", -1),
                            ("group", WORLD)],
    "hccl.send": [("tensor", _), ("sr_tag", _), ("dest_rank", _), ("group", WORLD)],
    "hccl.receive": [("shape", _), ("data_type", _), ("sr_tag", _), ("src_rank", _), ("group", WORLD)],
    "hccl.all_to_all_v": [("send_data", _), ("send_counts", _), ("send_displacements", _), ("recv_counts", _),
                          ("recv_displacements", _), ("group", WORLD)],
    "hccl.all_to_all_v_c": [("send_data", _), ("send_count_matrix", _), ("rank", _), ("fusion", 0),
                            ("fusion_id", -1), ("group", WORLD)],
    "hccl.create_group": [("group", _), ("rank_num", _), ("rank_ids", _)],
    "hccl.get_rank_size": [("group", WORLD)],
    "hccl.get_rank_id": [("group", WORLD)],
    "hccl.get_world_rank_from_group_rank": [("group", _), ("group_rank_id", _)],
    "hccl.get_group_rank_from_world_rank": [("world_rank_id", _), ("group", _)],
    "hccl.set_split_strategy_by_idx": [("idxList", _), ("group", WORLD)],
    "hccl.set_split_strategy_by_size": [("dataSizeList", _), ("group", WORLD)],
}


def test_import_hostreduce_as_npu_resolves_modules_without_tensorflow() -> None:
    """``npu.horovod``, ``npu.distribute``'s module name and ``dir(npu)`` need no
    TensorFlow import of their own: ``import hostreduce`` stays light."""
    code = ("import sys\n"
            "import hostreduce as npu\n"
            "assert 'tensorflow' not in sys.modules\n"
            "assert {'distribute', 'hccl', 'horovod', 'estimator', 'strategies', 'launch'} <= set(dir(npu))\n"
            "assert callable(npu.horovod.rank) and callable(npu.open)\n"
            "assert 'tensorflow' not in sys.modules, 'npu.horovod imported TensorFlow'\n"
            "assert npu.launch.__name__ == 'hostreduce.launch'\n"
            "import hostreduce\n"
            "try:\n"
            "    hostreduce.no_such_name\n"
            "except AttributeError as err:\n"
            "    assert 'no_such_name' in str(err)\n"
            "else:\n"
            "    raise AssertionError('no AttributeError')\n"
            "assert 'open' not in hostreduce.__all__\n"
            "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=base_env(), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


@pytest.mark.tf
def test_tf_adapter_names_resolve_with_its_signatures() -> None:
    import hostreduce as npu
    import hostreduce.distribute
    import hostreduce.hccl

    assert npu.distribute is hostreduce.distribute and npu.hccl is hostreduce.hccl
    assert npu.distribute.hccl_ops is npu.hccl
    assert npu.distribute.keras_optimizer_wrapper is npu.distribute.npu_distributed_keras_optimizer_wrapper
    assert npu.hccl.all_to_all_v is npu.hccl.all_to_all_v_dynamic
    for name in npu.distribute.__all__ + npu.hccl.__all__:
        assert getattr(npu.distribute if name in npu.distribute.__all__ else npu.hccl, name) is not None, name
    for path, expected in SIGNATURES.items():
        module, name = path.split(".")
        params = list(inspect.signature(getattr(getattr(npu, module), name)).parameters.values())
        got = [(p.name, p.default) for p in params[:len(expected)]]
        assert got == expected, f"{path}: {got} != {expected}"
        # Anything past TF Adapter's arguments is hostreduce's own, with a default.
        assert all(p.default is not _ for p in params[len(expected):]), path


@pytest.fixture
def one_worker(monkeypatch: pytest.MonkeyPatch):
    import hostreduce.horovod as hvd

    for var in ("TF_CONFIG", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
                "HOROVOD_RANK", "HOROVOD_SIZE", "ASCEND_DEVICE_ID"):
        monkeypatch.delenv(var, raising=False)
    hvd.shutdown()
    yield
    hvd.shutdown()


@pytest.mark.tf
def test_tf_adapter_names_with_one_worker(one_worker: None) -> None:
    import keras
    import tensorflow as tf

    import hostreduce as npu

    handle = npu.open()
    assert handle.as_default() is handle and handle.device_id == 0
    assert npu.open(3).device_id == 3
    with pytest.raises(npu.ConfigError, match="`device_id` must be a non-negative integer. Received: device_id=-1"):
        npu.open(-1)

    x = tf.constant([1.0, 2.0])
    assert npu.distribute.npu_allreduce(x) is x
    out = npu.distribute.npu_allreduce((x, None))
    assert isinstance(out, list) and out[0] is x and out[1] is None
    sgd = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    assert npu.distribute.npu_distributed_optimizer_wrapper(sgd) is sgd
    adam = npu.distribute.npu_distributed_keras_optimizer_wrapper("adam")
    assert isinstance(adam, keras.optimizers.Adam)
    assert npu.distribute.grouping_gradients_apply(lambda gv, k=0: (list(gv), k), zip([x], ["v"]), k=1) == (
        [(x, "v")], 1)
    v = tf.Variable([4.0])
    assert npu.distribute.grouping_broadcast([v]) == [v] and v.numpy().tolist() == [4.0]

    # TF1's and TF2's argument orders of allgather/reduce_scatter: a group name where
    # TF1 has `fusion` is the group.
    assert npu.hccl.allgather(x, 1, WORLD).numpy().tolist() == [1.0, 2.0]
    assert npu.hccl.allgather(x, 1, 0, -1, WORLD).numpy().tolist() == [1.0, 2.0]
    assert npu.hccl.reduce_scatter(x, "sum", 1, WORLD).numpy().tolist() == [1.0, 2.0]
    with pytest.raises(npu.ConfigError, match="`group` is given twice"):
        npu.hccl.reduce_scatter(x, "sum", 1, "pairs", group="others")
    npu.hccl.set_split_strategy_by_idx([20, 100])
    npu.hccl.set_split_strategy_by_size([60, 40])
    with pytest.raises(npu.ConfigError, match="`idxList` must be a non-empty list of non-negative numbers"):
        npu.hccl.set_split_strategy_by_idx([-1])
    counts = tf.constant([[1]], tf.int64)
    assert npu.hccl.all_to_all_v_c(tf.constant([7]), counts, 0).numpy().tolist() == [7]


@pytest.mark.tf
@pytest.mark.parametrize("call", [
    lambda npu: npu.hccl.remote_read(None, None),
    lambda npu: npu.hccl.remote_ref_read(None, None, 0),
    lambda npu: npu.hccl.remote_write(None, None, None),
    lambda npu: npu.hccl.remote_scatter_write(None, None, 0),
    lambda npu: npu.hccl.gather_all_to_all_v(None, None, None, None, None, -1),
    lambda npu: npu.distribute.npu_callbacks_append([]),
])
def test_unsupported_names_say_what_to_use_instead(call) -> None:
    import hostreduce as npu

    with pytest.raises(npu.UnsupportedCallError, match="is not supported.* Use |is not supported. For model.fit"):
        call(npu)
