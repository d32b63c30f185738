"""Estimator checkpoints in TensorFlow's format: every variable and slot by name, restore
into a Keras model, atomic publication, each worker's input position resumed, the
earlier npz format, and the SavedModel export."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
from tests.tf_workers import tf_common as common  # noqa: E402

from hostreduce.errors import CheckpointError, ConfigError, HostReduceError  # noqa: E402
from hostreduce.estimator import Estimator, RunConfig  # noqa: E402
from hostreduce.estimator import checkpoint as checkpoint_module  # noqa: E402
from hostreduce.estimator.checkpoint import GLOBAL_STEP, CheckpointManager  # noqa: E402
from hostreduce.estimator.names import restore_variables  # noqa: E402

pytestmark = pytest.mark.tf


def _estimator(model_dir: Path | None, **config) -> Estimator:
    keras.utils.set_random_seed(1234)
    run_config = RunConfig(model_dir=str(model_dir) if model_dir else None, log_step_count_steps=None,
                           save_summary_steps=None, **config)
    return Estimator(common.mlp_model_fn, config=run_config, params={"optimizer": "adam"})


def _relative_error(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-12))


def test_every_variable_and_slot_by_name_and_restore_into_keras(tmp_path: Path) -> None:
    est = _estimator(tmp_path)
    est.train(common.make_input_fn(), steps=3)
    listed = dict(tf.train.list_variables(str(tmp_path)))  # through model_dir's `checkpoint` index
    assert set(listed) == set(est.get_variable_names()) | {GLOBAL_STEP}
    for name in ("sequential/dense/kernel", "sequential/dense/kernel#1", "sequential/dense/bias#2", "adam/iteration",
                 "adam/sequential_dense_kernel_momentum", "adam/sequential_dense_bias_velocity#2"):
        assert name in listed, name
    reader = tf.train.load_checkpoint(est.latest_checkpoint())
    assert est.latest_checkpoint() == tf.train.latest_checkpoint(str(tmp_path))
    assert int(reader.get_tensor(GLOBAL_STEP)) == 3 and int(reader.get_tensor("adam/iteration")) == 3
    for name in est.get_variable_names():
        np.testing.assert_array_equal(reader.get_tensor(name), est.get_variable_value(name), err_msg=name)

    # The same Keras model and optimizer, built in this process (their Keras paths carry
    # counters such as sequential_4/dense_9), take the checkpoint's values by name.
    model = keras.Sequential([keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(32, activation="tanh"),
                              keras.layers.Dense(common.CLASSES)])
    model.build((None, common.FEATURES))
    optimizer = keras.optimizers.Adam(1e-2)
    optimizer.build(model.trainable_variables)
    names = restore_variables(str(tmp_path), model.variables + optimizer.variables)
    assert sorted(names) == sorted(est.get_variable_names())
    np.testing.assert_array_equal(model.layers[1].kernel.numpy(), reader.get_tensor("sequential/dense/kernel#1"))
    assert int(optimizer.iterations.numpy()) == 3
    x, _ = common.dataset_arrays(40)
    predicted = next(est.predict(lambda: tf.data.Dataset.from_tensors(x), yield_single_examples=False))
    np.testing.assert_array_equal(np.argmax(model(x).numpy(), axis=1), predicted["classes"])


def test_crash_before_publishing_leaves_the_previous_checkpoint(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    est = _estimator(tmp_path)
    est.train(common.make_input_fn(), steps=2)
    saved = est.get_variables()

    def crash(*args, **kwargs):
        raise OSError("killed")

    # Killed after writing every file of step 4, before the rename that publishes it.
    # The write runs in the background: train() raises its error when it waits for it.
    monkeypatch.setattr(checkpoint_module.os, "rename", crash)
    with pytest.raises(CheckpointError, match="checkpoint of step 4 failed: OSError: killed") as raised:
        est.train(common.make_input_fn(), steps=2)
    assert isinstance(raised.value.__cause__, OSError)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "ckpt-000000002"]
    reader = tf.train.load_checkpoint(str(tmp_path))
    assert int(reader.get_tensor(GLOBAL_STEP)) == 2
    resumed = _estimator(tmp_path)
    resumed.train(common.make_input_fn(), steps=0)
    assert resumed.global_step == 2
    for name, value in saved.items():
        np.testing.assert_array_equal(resumed.get_variable_value(name), value, err_msg=name)

    # Killed after publishing step 4, before the index moved on: the index still names
    # a complete checkpoint, and the Estimator resumes from the newest directory.
    monkeypatch.setattr(checkpoint_module, "_write_index", crash)
    with pytest.raises(CheckpointError, match="killed"):
        resumed.train(common.make_input_fn(), steps=2)
    monkeypatch.undo()
    assert int(tf.train.load_checkpoint(str(tmp_path)).get_tensor(GLOBAL_STEP)) == 2
    assert _estimator(tmp_path).train(common.make_input_fn(), steps=1).global_step == 5
    assert int(tf.train.load_checkpoint(str(tmp_path)).get_tensor(GLOBAL_STEP)) == 5


def test_checkpoints_are_written_beside_training_from_a_snapshot(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A save copies the step's values and returns; the files are written in the
    background while the next steps run, and train() returns with them on disk."""
    import threading

    est = _estimator(tmp_path, save_checkpoints_steps=2)
    real_save = CheckpointManager.save
    release, written = threading.Event(), []

    def held_save(self, step, arrays, *args, **kwargs):  # type: ignore[no-untyped-def]
        if step == 2:  # the first write waits until training has gone past it
            assert release.wait(120), "training stopped while a checkpoint was being written"
        written.append(step)
        return real_save(self, step, arrays, *args, **kwargs)

    monkeypatch.setattr(CheckpointManager, "save", held_save)
    at_step_2: dict[str, np.ndarray] = {}

    def hook(step: int, loss: float) -> None:
        if step == 2:  # before the save of step 2
            at_step_2.update(est.get_variables())
        if step == 3:  # step 3 ran while the write of step 2 was held
            assert written == [] and not (tmp_path / "ckpt-000000002").exists()
            release.set()

    est.train(common.make_input_fn(), steps=6, hooks=[hook])
    assert written == [2, 4, 6]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-")) == \
        ["ckpt-000000002", "ckpt-000000004", "ckpt-000000006"]
    step, arrays, _ = CheckpointManager(str(tmp_path)).load(str(tmp_path / "ckpt-000000002"))
    assert step == 2 and set(arrays) == set(at_step_2)
    for name, value in at_step_2.items():  # the values of step 2, not of a later step
        np.testing.assert_array_equal(arrays[name], value, err_msg=name)
    assert int(tf.train.load_checkpoint(est.latest_checkpoint()).get_tensor(GLOBAL_STEP)) == 6


def test_a_failed_background_write_is_raised_by_the_next_save(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    est = _estimator(tmp_path, save_checkpoints_steps=2)
    real_save = CheckpointManager.save

    def failing_save(self, step, *args, **kwargs):  # type: ignore[no-untyped-def]
        if step == 2:
            raise OSError("No space left on device")
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(CheckpointManager, "save", failing_save)
    ran: list[int] = []
    with pytest.raises(CheckpointError, match="checkpoint of step 2 failed: OSError: No space left") as raised:
        est.train(common.make_input_fn(), steps=10, hooks=[lambda step, loss: ran.append(step)])
    assert isinstance(raised.value, HostReduceError) and isinstance(raised.value.__cause__, OSError)
    assert ran == [1, 2, 3, 4]  # the save of step 4 waited for the write of step 2 and raised its error
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("ckpt-")]


def test_a_write_that_does_not_end_is_an_error_after_the_timeout(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from hostreduce.estimator import checkpointing

    est = _estimator(tmp_path, save_checkpoints_steps=2)
    real_save, release = CheckpointManager.save, threading.Event()

    def stuck_save(self, step, *args, **kwargs):  # type: ignore[no-untyped-def]
        release.wait(60)  # a filesystem that does not answer
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(CheckpointManager, "save", stuck_save)
    monkeypatch.setattr(checkpointing, "WRITE_TIMEOUT_S", 0.5)
    try:
        with pytest.raises(CheckpointError, match="checkpoint of step 2 is still being written after"):
            est.train(common.make_input_fn(), steps=3)
    finally:
        release.set()
    est.latest_checkpoint()  # the write ends once the filesystem answers
    assert [s for s, _ in CheckpointManager(str(tmp_path)).checkpoints()] == [2]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_resumed_run_equals_straight_run(tmp_path: Path, world_size: int) -> None:
    from tests.tf_workers.estimator_resume_workers import resume_rank

    from hostreduce.testing import run_ranks

    steps = 10
    results = run_ranks(resume_rank, world_size, args=(str(tmp_path), steps), timeout=150)
    assert results[0]["kept"] == [steps // 2 - 1, steps // 2]  # keep_checkpoint_max=2
    index = tf.train.get_checkpoint_state(str(tmp_path / "stopped"))  # the resumed run kept 5 (the default)
    assert [os.path.basename(os.path.dirname(p)) for p in index.all_model_checkpoint_paths] == [
        f"ckpt-{s:09d}" for s in (steps // 2 - 1, steps // 2, steps)]
    assert index.model_checkpoint_path.endswith(f"ckpt-{steps:09d}/variables")
    for rank, result in enumerate(results):
        straight, resumed = result["straight"], result["resumed"]
        assert sorted(straight) == sorted(resumed) and int(resumed["__global_step__"]) == steps
        errors = {k: _relative_error(resumed[k], straight[k]) for k in straight}
        assert max(errors.values()) <= 1e-6, (rank, errors)
        # Restarting the data instead (the input positions removed) ends elsewhere.
        kernel = "sequential/dense/kernel"
        assert _relative_error(result["without_input"][kernel], straight[kernel]) > 1e-3, rank
    meta = json.loads((tmp_path / "stopped" / f"ckpt-{steps:09d}" / "meta.json").read_text())
    assert meta["world_size"] == world_size and meta["input_ranks"] == list(range(world_size))


def test_a_save_does_not_wait_for_the_gather_of_input_positions(tmp_path: Path) -> None:
    """Every worker's input position travels to the chief beside training: rank 1's save
    returns before the chief has reached it, and the chief's write still holds both
    positions, which restore where each iterator was."""
    from tests.tf_workers.estimator_resume_workers import late_chief_rank

    from hostreduce.testing import run_ranks

    chief, other = run_ranks(late_chief_rank, 2, args=(str(tmp_path),), timeout=150)
    assert chief["step"] == 3 and chief["w"] == [0.0, 1.0, 2.0]
    assert chief["meta"]["input"] == "saved" and chief["inputs"] == [0, 1]
    for result in (chief, other):
        assert result["resumed"] == result["after"], result
    assert chief["taken"] != other["taken"]  # (two different positions)


def test_a_gather_that_fails_raises_on_the_worker_and_the_chief_keeps_the_variables(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The job fails while the positions travel: the worker's next wait raises the
    reducer's error, and the chief's writer still writes the step's variables (without
    positions, saying so) rather than losing the checkpoint."""
    from types import SimpleNamespace

    from hostreduce.errors import PeerLostError
    from hostreduce.estimator.checkpointing import Checkpointing
    from hostreduce.reducers.handle import Handle

    def failed_gather(name: str, array: np.ndarray) -> Handle:
        handle = Handle(name)
        handle.set_error(PeerLostError("rank 1 stopped answering"))
        return handle

    reducer = SimpleNamespace(size=2, broadcast=lambda name, array, root: array, allgather_async=failed_gather)
    strategy = SimpleNamespace(rank=0, size=2, is_chief=True, reducer=reducer)
    ckpt = Checkpointing(strategy, CheckpointManager(str(tmp_path)), 1, None)
    ckpt.policy()
    ckpt.iterator = iter(tf.data.Dataset.range(10))
    next(ckpt.iterator)
    with caplog.at_level(logging.WARNING, logger="hostreduce.estimator"):
        ckpt.save(1, lambda: {"w": np.arange(3.0)})  # (returns: the gather is waited for later)
        with pytest.raises(PeerLostError, match="rank 1 stopped answering"):
            ckpt.flush()
    assert any("did not reach the chief (PeerLostError" in r.getMessage() for r in caplog.records)
    manager = CheckpointManager(str(tmp_path))
    step, arrays, meta = manager.load()
    assert step == 1 and arrays["w"].tolist() == [0.0, 1.0, 2.0] and meta["input"] == "not gathered"
    assert manager.load_inputs(manager.find(1)) == {}
    ckpt.flush()  # (raised once)


def test_uncheckpointable_input_warns_once_and_resumes_variables(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    x, y = common.dataset_arrays(64)

    def input_fn():
        def batches():
            while True:
                for i in range(0, 64, 16):
                    yield x[i:i + 16], y[i:i + 16]

        return tf.data.Dataset.from_generator(batches, output_signature=(
            tf.TensorSpec([16, common.FEATURES], tf.float32), tf.TensorSpec([16], tf.int32)))

    with caplog.at_level(logging.WARNING, logger="hostreduce.estimator"):
        est = _estimator(tmp_path, save_checkpoints_steps=1)
        est.train(input_fn, steps=3)
    warnings = [r.getMessage() for r in caplog.records if "cannot be checkpointed" in r.getMessage()]
    assert len(warnings) == 1 and "PyFunc is stateful" in warnings[0], warnings
    assert not [p for p in (tmp_path / "ckpt-000000003").iterdir() if p.name.startswith("input-")]
    resumed = _estimator(tmp_path)
    resumed.train(input_fn, steps=0)
    assert resumed.global_step == 3
    np.testing.assert_array_equal(resumed.get_variable_value("sequential/dense/kernel"),
                                  est.get_variable_value("sequential/dense/kernel"))


def test_the_stores_batched_read_follows_updates_and_new_variables() -> None:
    """What every save reads: ``VariableStore.values`` (one by one the first time, then
    one traced call per set of variables)."""
    from hostreduce.host.variables import VariableStore

    store = VariableStore()
    with store.scope():
        first = [tf.Variable(np.full([3], i, np.float32), name=f"v{i}") for i in range(3)]
    keys = [k for k, _ in store.items()]
    for value in (1.0, 2.0, 3.0):   # the first read, the one that traces, the traced one
        first[1].assign(np.full([3], value, np.float32))
        got = store.values(keys)
        np.testing.assert_array_equal(got[1], np.full([3], value, np.float32))
        np.testing.assert_array_equal(got[2], np.full([3], 2.0, np.float32))
    with store.scope():
        tf.Variable(np.ones([2, 2], np.float64), name="late")
    keys = [k for k, _ in store.items()]
    for _ in range(3):
        got = store.values(keys)
        assert [g.dtype for g in got] == [np.float32] * 3 + [np.float64] and got[3].shape == (2, 2)
    assert store.values([]) == []


def test_tensors_read_by_a_save_keep_their_values_through_updates() -> None:
    """What a save hands to the background writer: tensors read from the variables,
    not copies; an update after the read (an assignment, the optimizer's apply) leaves
    them as they were read."""
    from hostreduce.host.variables import VariableStore

    store = VariableStore()
    with store.scope():
        v = tf.Variable(np.full([4, 3], 1.0, np.float32), name="w")
        m = tf.Variable(np.zeros([4, 3], np.float32), name="m")
        u = tf.Variable(np.zeros([4, 3], np.float32), name="u")
    keys = [k for k, _ in store.items()]
    for _ in range(3):  # one by one, then the traced read, then the traced read again
        read = store.tensors(keys)
        before = [t.numpy().copy() for t in read]
        v.assign_add(np.ones([4, 3], np.float32))
        tf.raw_ops.ResourceApplyAdam(var=v.handle, m=m.handle, v=u.handle, beta1_power=0.9, beta2_power=0.99,
                                     lr=0.1, beta1=0.9, beta2=0.999, epsilon=1e-7, grad=tf.ones([4, 3]),
                                     use_locking=False)
        assert not np.array_equal(v.numpy(), before[0])
        for name, got, want in zip(keys, read, before):
            np.testing.assert_array_equal(got.numpy(), want, err_msg=name)


def _shuffled_batches() -> "tf.data.Dataset":
    return tf.data.Dataset.range(200).shuffle(64, seed=7).map(lambda i: i * 3).batch(5).prefetch(2)


def test_input_position_is_the_iterators_state_tensor_and_restores_exactly() -> None:
    from hostreduce.estimator import input_state

    iterator = iter(_shuffled_batches())
    for _ in range(3):
        next(iterator)
    files = input_state.save_iterator(iterator)
    assert list(files) == [".state"]  # one serialized TensorProto, the shuffle buffer inside
    state = tf.io.parse_tensor(files[".state"], tf.variant)
    assert state.dtype == tf.variant
    expected = [next(iterator).numpy() for _ in range(6)]
    restored = iter(_shuffled_batches())
    input_state.restore_iterator(restored, input_state.unpack(input_state.pack(files)))
    np.testing.assert_array_equal(np.stack([next(restored).numpy() for _ in range(6)]), np.stack(expected))


def test_input_positions_saved_by_earlier_releases_still_restore() -> None:
    """Earlier releases saved ``tf.train.Checkpoint(iterator=it)``'s files (``.index``,
    ``.data-*``)."""
    from hostreduce.estimator import input_state

    iterator = iter(_shuffled_batches())
    for _ in range(4):
        next(iterator)
    prefix = "ram://hostreduce-test-earlier-input/input"
    tf.train.Checkpoint(iterator=iterator).write(prefix)
    files = {}
    for name in tf.io.gfile.listdir("ram://hostreduce-test-earlier-input"):
        with tf.io.gfile.GFile(f"ram://hostreduce-test-earlier-input/{name}", "rb") as f:
            files[name[len("input"):]] = f.read()
    tf.io.gfile.rmtree("ram://hostreduce-test-earlier-input")
    assert sorted(files) == [".data-00000-of-00001", ".index"]
    expected = [next(iterator).numpy() for _ in range(5)]
    restored = iter(_shuffled_batches())
    input_state.restore_iterator(restored, files)
    np.testing.assert_array_equal(np.stack([next(restored).numpy() for _ in range(5)]), np.stack(expected))


def test_malformed_input_positions_are_refused_by_name() -> None:
    from hostreduce.estimator import input_state

    blob = input_state.pack({".state": b"abc", ".other": b""})
    assert input_state.unpack(blob) == {".state": b"abc", ".other": b""}
    for bad in (blob[:-1], blob + b"x", b"\xff" * 8, b""):
        with pytest.raises(HostReduceError, match="Input state of"):
            input_state.unpack(bad)
    iterator = iter(_shuffled_batches())
    with pytest.raises(HostReduceError, match="'.state' is not a serialized tensor"):
        input_state.restore_iterator(iterator, {".state": b"garbage"})
    with pytest.raises(HostReduceError, match="invalid file suffix"):
        input_state.restore_iterator(iterator, {"/../x": b""})
    generated = iter(tf.data.Dataset.from_generator(lambda: iter(range(3)),
                                                    output_signature=tf.TensorSpec([], tf.int64)))
    with pytest.raises(input_state.InputNotCheckpointable, match="PyFunc is stateful"):
        input_state.save_iterator(generated)


def test_npz_checkpoints_of_the_earlier_format_still_load(tmp_path: Path) -> None:
    est = _estimator(None)
    est.train(common.make_input_fn(), steps=2)
    saved = est.get_variables()
    old = tmp_path / "ckpt-000000002"
    old.mkdir()
    np.savez(old / "variables.npz", **{f"a{i}": v for i, v in enumerate(saved.values())})
    (old / "meta.json").write_text(json.dumps({"format": 1, "step": 2, "keys": list(saved), "world_size": 1}))
    resumed = _estimator(tmp_path)
    resumed.train(common.make_input_fn(), steps=0)
    assert resumed.global_step == 2
    for name, value in saved.items():
        np.testing.assert_array_equal(resumed.get_variable_value(name), value, err_msg=name)
    resumed.train(common.make_input_fn(), steps=1)  # and the next checkpoint is TensorFlow's
    assert int(tf.train.load_checkpoint(str(tmp_path)).get_tensor(GLOBAL_STEP)) == 3
    (old / "variables.npz").write_bytes(b"not a zip")
    with pytest.raises(checkpoint_module.CheckpointError, match="ckpt-000000002"):
        CheckpointManager(str(tmp_path)).load(str(old))


def test_export_saved_model_serves_predictions(tmp_path: Path) -> None:
    est = _estimator(tmp_path / "model")
    est.train(common.make_input_fn(), steps=2)
    x, _ = common.dataset_arrays(24)
    expected = next(est.predict(lambda: tf.data.Dataset.from_tensors(x), yield_single_examples=False))["classes"]
    path = est.export_saved_model(str(tmp_path / "export"))
    assert os.path.dirname(path) == str(tmp_path / "export") and os.path.basename(path).isdigit()
    serve = tf.saved_model.load(path).signatures["serving_default"]
    np.testing.assert_array_equal(serve(features=tf.constant(x))["classes"].numpy(), expected)

    # A fresh Estimator exports the latest checkpoint's variables; it has seen no input,
    # so it is told the features' spec.
    fresh = _estimator(tmp_path / "model")
    with pytest.raises(ConfigError, match="serving_input_receiver_fn"):
        fresh.export_saved_model(str(tmp_path / "export"))
    spec = tf.TensorSpec([None, common.FEATURES], tf.float32)
    again = fresh.export_saved_model(str(tmp_path / "export"), serving_input_receiver_fn=lambda: spec)
    assert again != path
    serve = tf.saved_model.load(again).signatures["serving_default"]
    np.testing.assert_array_equal(serve(features=tf.constant(x))["classes"].numpy(), expected)
