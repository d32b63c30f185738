"""Models, data and entry points shared by the training tests (run in subprocesses
by ``run_ranks``/``mpirun`` and in the test process itself)."""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

GLOBAL_BATCH = 16
FEATURES = 12
CLASSES = 5


def dataset_arrays(n: int = 512, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES)).astype("float32")
    w = rng.standard_normal((FEATURES, CLASSES)).astype("float32")
    y = np.argmax(x @ w + 0.3 * rng.standard_normal((n, CLASSES)), axis=1).astype("int32")
    return x, y


def make_input_fn(global_batch: int = GLOBAL_BATCH, n: int = 512, repeat: bool = True,
                  shuffle: bool = False) -> Any:
    """Batches of ``global_batch`` examples; each worker takes its contiguous slice.
    ``shuffle``: the examples in a seeded order, a new one every epoch (equal on every
    worker)."""
    import tensorflow as tf

    x, y = dataset_arrays(n)

    def input_fn(mode: str, input_context: Any = None) -> Any:
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        if shuffle:
            ds = ds.shuffle(n, seed=3, reshuffle_each_iteration=True)
        ds = ds.batch(global_batch, drop_remainder=True)
        if input_context is not None and input_context.num_input_pipelines > 1:
            per = input_context.get_per_replica_batch_size(global_batch)
            lo = input_context.input_pipeline_id * per
            ds = ds.map(lambda a, b: (a[lo:lo + per], b[lo:lo + per]))
        return ds.repeat() if repeat else ds

    return input_fn


def make_optimizer(name: str) -> Any:
    import keras

    if name == "sgd":
        return keras.optimizers.SGD(0.05, momentum=0.9)
    if name == "adam":
        return keras.optimizers.Adam(1e-2)
    if name == "rmsprop":  # no fused kernel: the Keras path
        return keras.optimizers.RMSprop(1e-2)
    raise ValueError(name)


def mlp_model_fn(features: Any, labels: Any, mode: str, params: dict) -> Any:
    """The model_fn shape from the documentation: Keras layers and the optimizer are
    built inside, gradients taken on the device, applied in ``host_call``."""
    import keras
    import tensorflow as tf

    from hostreduce.estimator import EstimatorSpec, ModeKeys, compute_gradients

    layers = [keras.layers.Dense(params.get("width", 32), activation="tanh") for _ in range(params.get("depth", 2))]
    model = keras.Sequential(layers + [keras.layers.Dense(CLASSES)])
    logits = model(features)
    if mode == ModeKeys.PREDICT:
        return EstimatorSpec(mode, predictions={"classes": tf.argmax(logits, axis=1)})
    loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
    if mode == ModeKeys.TRAIN and params.get("update") == "tf1_minimize":  # tf.estimator's habit
        optimizer = tf.compat.v1.train.AdamOptimizer(1e-2)
        return EstimatorSpec(mode, loss=loss,
                             train_op=optimizer.minimize(loss, tf.compat.v1.train.get_or_create_global_step()))
    if mode == ModeKeys.TRAIN:
        optimizer = make_optimizer(params.get("optimizer", "sgd"))
        grads = compute_gradients(loss, model.trainable_variables)
        if params.get("update") == "keras_apply":  # the update made in model_fn itself
            return EstimatorSpec(mode, loss=loss,
                                 train_op=optimizer.apply_gradients(zip(grads, model.trainable_variables)))

        def host_model_fn(*grads: Any) -> None:
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        return EstimatorSpec(mode, loss=loss, train_op=tf.identity(loss), host_call=(host_model_fn, grads))
    accuracy = keras.metrics.SparseCategoricalAccuracy()
    accuracy.update_state(labels, logits)
    return EstimatorSpec(mode, loss=loss, eval_metric_ops={"accuracy": accuracy})


def train_weights(strategy: Any, optimizer: str, steps: int, model_dir: str | None = None,
                  save_every: int | None = None, kill_at: int | None = None, global_batch: int = GLOBAL_BATCH,
                  timeline_dir: str | None = None, depth: int = 2, n: int = 512,
                  shuffle: bool = False) -> dict[str, np.ndarray]:
    """Train ``steps`` steps; return every variable. ``kill_at`` ends the process hard
    right after that step (after its checkpoint, if one is due). ``optimizer`` may end
    in ``@once`` for ``RunConfig(host_apply="once")`` (default: per gradient)."""
    import keras

    from hostreduce.estimator import Estimator, RunConfig

    optimizer, _, host_apply = optimizer.partition("@")
    optimizer, _, update = optimizer.partition("+")  # "+keras_apply", "+tf1_minimize": the update in model_fn
    keras.utils.set_random_seed(1234)  # rank 0's initial weights equal the reference run's
    config = RunConfig(train_distribute=strategy, model_dir=model_dir, save_checkpoints_steps=save_every,
                       log_step_count_steps=None, timeline_dir=timeline_dir, host_apply=host_apply or "per_gradient")
    est = Estimator(mlp_model_fn, config=config, params={"optimizer": optimizer, "depth": depth, "update": update})
    ran = []
    hooks = [lambda step, loss: ran.append(step)]
    if kill_at is not None:
        def die(step: int, loss: float) -> None:
            if step == kill_at:
                if save_every and step % save_every == 0:
                    est._save()
                os._exit(17)
        hooks.append(die)
    est.train(make_input_fn(global_batch, n, shuffle=shuffle), max_steps=steps, hooks=hooks)
    weights = est.get_variables()
    metrics = est.evaluate(make_input_fn(global_batch, repeat=False), steps=4)
    weights["__eval_loss__"] = np.array(metrics["loss"])
    weights["__steps_run__"] = np.array(len(ran))
    est.close()
    return weights


def ring_rank(rank: int, world_size: int, optimizers: list[str], steps: int, uneven: bool = True
              ) -> dict[str, dict[str, np.ndarray]]:
    """Entry point for ``run_ranks``: MultiWorkerStrategy over the ring (TF_CONFIG)."""
    from hostreduce.strategies import MultiWorkerStrategy

    results = {opt: train_weights(MultiWorkerStrategy(), opt, steps) for opt in optimizers}
    if uneven:
        results["uneven_steps"] = uneven_data_steps(MultiWorkerStrategy(), 3 + 2 * rank)
    return results


def uneven_data_steps(strategy: Any, local_batches: int) -> int:
    """Train until the data ends when workers hold different numbers of batches: every
    worker must stop after the smallest count."""
    import tensorflow as tf

    from hostreduce.estimator import Estimator, RunConfig

    x, y = dataset_arrays(local_batches * 8)
    est = Estimator(mlp_model_fn, config=RunConfig(train_distribute=strategy, log_step_count_steps=None))
    est.train(lambda: tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
    est.close()
    return est.global_step


def save_result(path: str, result: dict[str, np.ndarray]) -> None:
    np.savez(path, **{k.replace("/", ":"): v for k, v in result.items()})


def load_result(path: str) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k.replace(":", "/"): data[k] for k in data.files}


if __name__ == "__main__":  # under mpirun: python tf_common.py OPT[,OPT] STEPS OUT_DIR
    from hostreduce.strategies import HorovodStrategy

    opts, n_steps, out_dir = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3]
    for opt in opts:
        strategy = HorovodStrategy()
        result = train_weights(strategy, opt, n_steps)
        save_result(os.path.join(out_dir, f"{opt}-rank{strategy.rank}.npz"), result)
        print(f"OK {opt} rank {strategy.rank}/{strategy.size} reducer {strategy.reducer_name}", flush=True)


def streaming_rank(rank: int, world_size: int, timeline_dir: str, steps: int) -> list[dict]:
    """Entry point for ``run_ranks``: a deep, wide MLP over the ring with a timeline."""
    from hostreduce.estimator import Estimator, RunConfig
    from hostreduce.strategies import MultiWorkerStrategy

    import tensorflow as tf

    x = np.random.default_rng(rank).standard_normal((256, 512)).astype("float32")
    y = np.zeros(256, "int32")

    def input_fn(mode: str, input_context: Any = None) -> Any:
        return tf.data.Dataset.from_tensors((x, y)).repeat()

    config = RunConfig(train_distribute=MultiWorkerStrategy(), timeline_dir=timeline_dir, log_step_count_steps=None)
    est = Estimator(mlp_model_fn, config=config, params={"depth": 8, "width": 512, "optimizer": "sgd"})
    est.train(input_fn, steps=steps)
    events = est._timeline.events()
    est.close()
    return events
