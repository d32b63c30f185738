"""Rank functions for tests/test_keras_checkpoints.py: checkpoints of ``fit`` with
``hostreduce.horovod.keras.DistributedOptimizer`` (variables on the host or not) and of
a GradientTape loop, written by one job and resumed by a new one.

:func:`first_job` trains half the steps and checkpoints on rank 0 (Keras's
``ModelCheckpoint`` writes ``.keras`` files; ``tf.train.CheckpointManager`` writes
TensorFlow checkpoints), and trains the same model all the steps without a break, for
comparison. :func:`second_job`, in new processes, resumes three ways: rank 0 alone
loads the ``.keras`` file with ``hvd.load_model`` and ``BroadcastGlobalVariablesCallback``
hands its state to the others; every rank restores the TensorFlow checkpoint; a custom
loop restores its ``CheckpointManager``'s latest checkpoint. Each records the state it
starts from and the weights it ends with. A fourth resume puts rank 0's loaded model
beside models without an ``Input`` (variables made by the first batch) on the others.

The code uses ``tf.keras``, so it runs on Keras 3, and on tf_keras when the ranks get
``TF_USE_LEGACY_KERAS=1``. The data are fixed and unshuffled, so a resumed run can be
compared with the straight one number for number.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

GLOBAL_BATCH = 8
STEPS_PER_EPOCH = 2
EPOCHS = 2  # the first job trains the first epoch, the second job the second
TAPE_STEPS = 4
SEED = 1234


def _global_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(500 + step)
    return (rng.normal(size=(GLOBAL_BATCH, 5)).astype(np.float32),
            rng.normal(size=(GLOBAL_BATCH, 3)).astype(np.float32))


def _shard(rank: int, size: int, steps: range) -> tuple[np.ndarray, np.ndarray, int]:
    """This rank's rows of each global batch in ``steps``, batch after batch."""
    per = GLOBAL_BATCH // size
    parts = [[a[rank * per:(rank + 1) * per] for a in _global_batch(s)] for s in steps]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), per


def _model(on_host: bool, seed: int) -> Any:
    import tensorflow as tf

    keras = tf.keras
    keras.utils.set_random_seed(seed)
    with tf.device("/CPU:0") if on_host else contextlib.nullcontext():
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="tanh"),
                                 keras.layers.Dense(3)])


def _compiled(on_host: bool, seed: int) -> Any:
    import tensorflow as tf

    import hostreduce.horovod.keras as hvd

    model = _model(on_host, seed)
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.02), variables_on_host=on_host)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    return model


def _state(model: Any, optimizer: Any = None) -> dict:
    """The model's weights and every optimizer variable (values, devices), by position."""
    from hostreduce.host.kerases import underlying_variable
    from hostreduce.ops.optimizer import is_wrapped, optimizer_variables

    optimizer = model.optimizer if optimizer is None else optimizer
    variables = optimizer_variables(optimizer)
    return {
        "weights": [np.array(w.numpy()) for w in model.trainable_variables],
        "optimizer": [np.array(v.numpy()) for v in variables],
        "devices": [underlying_variable(v).device for v in list(variables) + list(model.trainable_variables)],
        "class": f"{type(optimizer).__module__}.{type(optimizer).__name__}",
        "wrapped": is_wrapped(optimizer),
        "on_host": bool(getattr(getattr(optimizer, "_hostreduce_config", None), "variables_on_host", False)),
    }


def _recorder(store: dict) -> Any:
    """A callback that records the state training starts from (after the callbacks
    before it), building the optimizer first where Keras has not yet (tf_keras)."""
    import tensorflow as tf

    class Recorder(tf.keras.callbacks.Callback):
        def on_train_begin(self, logs: Any = None) -> None:
            optimizer = self.model.optimizer
            if not (getattr(optimizer, "built", False) or getattr(optimizer, "_built", False)):
                optimizer.build(list(self.model.trainable_variables))
            store.update(_state(self.model))

    return Recorder()


def _fit(model: Any, rank: int, size: int, epochs: int, initial_epoch: int = 0, callbacks: list | None = None) -> None:
    x, y, per = _shard(rank, size, range(STEPS_PER_EPOCH))
    model.fit(x, y, batch_size=per, epochs=epochs, initial_epoch=initial_epoch, shuffle=False, verbose=0,
              callbacks=callbacks or [])


def _tape_parts(seed: int, directory: Path) -> tuple[Any, Any, Any, Any]:
    """Model, wrapped optimizer (variables on the host), checkpoint and manager of the
    custom loop, as a training script sets them up."""
    import tensorflow as tf

    import hostreduce.horovod.keras as hvd

    model = _model(True, seed)
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.02), variables_on_host=True)
    checkpoint = tf.train.Checkpoint(step=tf.Variable(0, dtype=tf.int64), model=model, optimizer=optimizer)
    manager = tf.train.CheckpointManager(checkpoint, str(directory), max_to_keep=2)
    return model, optimizer, checkpoint, manager


def _tape_train(rank: int, size: int, model: Any, optimizer: Any, checkpoint: Any, until: int,
                manager: Any = None) -> None:
    import tensorflow as tf

    @tf.function
    def step(x: Any, y: Any) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    while int(checkpoint.step.numpy()) < until:
        s = int(checkpoint.step.numpy())
        x, y, _ = _shard(rank, size, range(s, s + 1))
        step(tf.constant(x), tf.constant(y))
        checkpoint.step.assign_add(1)
        if manager is not None and rank == 0:
            manager.save(checkpoint_number=s + 1)


def _case_dir(out_dir: str, on_host: bool) -> Path:
    return Path(out_dir) / f"variables_on_host={on_host}"


def first_job(rank: int, size: int, out_dir: str, cases: tuple[bool, ...]) -> dict:
    """Half the training with checkpoints on rank 0, and the whole training straight."""
    import tensorflow as tf

    import hostreduce.horovod.keras as hvd

    hvd.init()
    result: dict = {}
    for on_host in cases:
        directory = _case_dir(out_dir, on_host)
        straight = _compiled(on_host, SEED)
        _fit(straight, rank, size, EPOCHS)
        model = _compiled(on_host, SEED)
        callbacks = []
        if rank == 0:  # as in Horovod: only rank 0 writes, so workers cannot corrupt the files
            callbacks.append(tf.keras.callbacks.ModelCheckpoint(str(directory / "epoch{epoch}.keras")))
        _fit(model, rank, size, 1, callbacks=callbacks)
        if rank == 0:
            checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
            tf.train.CheckpointManager(checkpoint, str(directory / "tf"), max_to_keep=2).save()
        result[on_host] = {"straight": _state(straight), "saved": _state(model)}
    model, optimizer, checkpoint, manager = _tape_parts(SEED, Path(out_dir) / "tape")
    _tape_train(rank, size, model, optimizer, checkpoint, TAPE_STEPS // 2, manager)
    straight, straight_optimizer, straight_checkpoint, _ = _tape_parts(SEED, Path(out_dir) / "tape-straight")
    _tape_train(rank, size, straight, straight_optimizer, straight_checkpoint, TAPE_STEPS)
    result["tape"] = {"saved": _state(model, optimizer), "straight": _state(straight, straight_optimizer)}
    hvd.shutdown()
    return result


def _resume_from_keras_file(rank: int, size: int, on_host: bool, path: Path) -> dict:
    """Rank 0 loads the file; the callback hands its state to ranks whose model was
    initialised differently."""
    import hostreduce.horovod.keras as hvd

    out: dict = {}
    if rank == 0:
        model = hvd.load_model(str(path), variables_on_host=on_host)
        out["loaded"] = _state(model)
    else:
        model = _compiled(on_host, SEED + 100 + rank)
    begin: dict = {}
    _fit(model, rank, size, EPOCHS, initial_epoch=1,
         callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), _recorder(begin)])
    out.update(begin=begin, end=_state(model))
    return out


def _resume_beside_an_unbuilt_model(rank: int, size: int, path: Path) -> list[np.ndarray]:
    """Rank 0 loads the file, the others build a model without an ``Input``, whose
    variables appear only at the first batch: the ranks must agree to broadcast after
    it (as Horovod always does) instead of waiting for each other at different points."""
    import tensorflow as tf

    import hostreduce.horovod.keras as hvd

    if rank == 0:
        model = hvd.load_model(str(path))
    else:
        tf.keras.utils.set_random_seed(SEED + 400 + rank)
        model = tf.keras.Sequential([tf.keras.layers.Dense(6, activation="tanh"), tf.keras.layers.Dense(3)])
        model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.02)), loss="mse",
                      jit_compile=False)
    _fit(model, rank, size, EPOCHS, initial_epoch=1, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    return [np.array(w.numpy()) for w in model.trainable_variables]


def _resume_from_tf_checkpoint(rank: int, size: int, on_host: bool, directory: Path) -> dict:
    """Every rank restores the same checkpoint into a model of its own."""
    import tensorflow as tf

    model = _compiled(on_host, SEED + 200 + rank)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    latest = tf.train.CheckpointManager(checkpoint, str(directory), max_to_keep=2).latest_checkpoint
    status = checkpoint.restore(latest)
    begin: dict = {}
    _fit(model, rank, size, EPOCHS, initial_epoch=1, callbacks=[_recorder(begin)])
    status.assert_consumed()  # every saved value found its variable
    return {"begin": begin, "end": _state(model), "latest": os.path.basename(latest)}


def _plain_keras_load(path: Path) -> dict:
    """``keras.models.load_model`` alone, outside any hostreduce call."""
    import tensorflow as tf

    return _state(tf.keras.models.load_model(str(path)))


def _load_model_errors(path: Path) -> list[str]:
    import hostreduce.horovod.keras as hvd

    messages = []
    for kwargs in ({"custom_optimizers": "Adam"}, {"custom_objects": ["Adam"]}, {"compression": "fp8"}):
        try:
            hvd.load_model(str(path), **kwargs)
            messages.append(f"no error for {kwargs}")
        except Exception as exc:  # noqa: BLE001 - the message is what is checked
            messages.append(f"{type(exc).__name__}: {exc}")
    return messages


def second_job(rank: int, size: int, out_dir: str, cases: tuple[bool, ...]) -> dict:
    """The new job: resume every case of :func:`first_job`, finish the training."""
    import hostreduce.horovod.keras as hvd

    hvd.init()
    result: dict = {"files": sorted(str(p.relative_to(out_dir)) for p in Path(out_dir).rglob("*") if p.is_file())}
    for on_host in cases:
        directory = _case_dir(out_dir, on_host)
        result[on_host] = {
            "keras_file": _resume_from_keras_file(rank, size, on_host, directory / "epoch1.keras"),
            "tf_checkpoint": _resume_from_tf_checkpoint(rank, size, on_host, directory / "tf"),
        }
        if rank == 0:
            result[on_host]["plain_load"] = _plain_keras_load(directory / "epoch1.keras")
        if not on_host:
            result[on_host]["unbuilt"] = _resume_beside_an_unbuilt_model(rank, size, directory / "epoch1.keras")
    if rank == 0:
        result["errors"] = _load_model_errors(_case_dir(out_dir, cases[0]) / "epoch1.keras")
    model, optimizer, checkpoint, manager = _tape_parts(SEED + 300 + rank, Path(out_dir) / "tape")
    latest = manager.latest_checkpoint
    checkpoint.restore(latest)
    resumed_at = int(checkpoint.step.numpy())
    _tape_train(rank, size, model, optimizer, checkpoint, TAPE_STEPS)
    result["tape"] = {"end": _state(model, optimizer), "resumed_at": resumed_at, "latest": os.path.basename(latest)}
    hvd.shutdown()
    return result
