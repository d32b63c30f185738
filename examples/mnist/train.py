"""Data-parallel MNIST with a host-side optimizer: the Estimator + ``host_call`` pattern.

Each worker computes gradients on its shard of every global batch; the gradients are
averaged across workers on the host (the gRPC ring with ``--strategy ring``, Horovod or
MPI with ``--strategy horovod``) and Adam runs on the host, where its state lives.

See README.md in this directory for the commands (two terminals, ``python -m hostreduce
run``, ``mpirun``).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

log = logging.getLogger("mnist")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("ring", "horovod", "none"), default="ring",
                        help="ring: gRPC ring over TF_CONFIG (default); horovod: Horovod/MPI under mpirun; "
                             "none: this process alone")
    parser.add_argument("--data-dir", help="directory holding mnist.npz (Keras format); default: "
                                           "scikit-learn's bundled 8x8 digits")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size, split across workers (rounded down to a multiple of their number)")
    parser.add_argument("--epochs", type=float, default=8.0)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--model-dir", help="checkpoint directory (training resumes from it)")
    parser.add_argument("--save-steps", type=int, default=None, help="checkpoint every N steps")
    parser.add_argument("--timeline-dir", help="write timeline-rank{r}.json (Chrome trace) here")
    parser.add_argument("--variables-on-device", action="store_true",
                        help="keep weights and optimizer state on the default device, reduce on the host")
    parser.add_argument("--log-steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def load_data(data_dir: str | None) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """((x_train, y_train), (x_test, y_test)); images flattened to float32 in [0, 1]."""
    if data_dir:
        path = os.path.join(data_dir, "mnist.npz")
        if not os.path.isfile(path):
            sys.exit(f"--data-dir {data_dir!r} has no mnist.npz (Keras format: x_train, y_train, x_test, y_test)")
        with np.load(path) as data:
            x_train, y_train, x_test, y_test = (data[k] for k in ("x_train", "y_train", "x_test", "y_test"))
        scale = 255.0
    else:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        print("No --data-dir given: using scikit-learn's bundled 8x8 handwritten digits "
              "(1,797 images) instead of MNIST.", flush=True)
        digits = load_digits()
        x_train, x_test, y_train, y_test = train_test_split(
            digits.images, digits.target, test_size=0.2, random_state=0, stratify=digits.target)
        scale = 16.0
    prep = lambda x: (x.reshape(len(x), -1) / scale).astype("float32")  # noqa: E731
    return (prep(x_train), y_train.astype("int32")), (prep(x_test), y_test.astype("int32"))


def make_input_fn(x: np.ndarray, y: np.ndarray, global_batch: int, training: bool, seed: int):
    import tensorflow as tf

    def input_fn(mode, input_context=None):
        shards, shard, batch = 1, 0, global_batch
        if input_context is not None and input_context.num_input_pipelines > 1:
            shards, shard = input_context.num_input_pipelines, input_context.input_pipeline_id
            batch = input_context.get_per_replica_batch_size(global_batch)
        xs, ys = x[shard::shards], y[shard::shards]  # this worker's examples
        if not training:
            return tf.data.Dataset.from_tensor_slices((xs, ys)).batch(batch)
        # Every epoch is a fresh permutation of this worker's examples, drawn from the
        # examples' positions alone (a stateless index shuffle seeded by seed and epoch), so
        # the pipeline's state is a counter. Symbolic checkpointing saves that counter and
        # not the batches prefetched (they are made again on a restore, the same since
        # every step of the pipeline is deterministic): the input position every checkpoint
        # saves is a few hundred bytes. A shuffle buffer (ds.shuffle(n)) would be saved whole
        # at every checkpoint, on every worker (0.5 MB and about 20 ms per save here).
        n = len(xs)
        features, labels = tf.constant(xs), tf.constant(ys)

        def pick(positions):
            seeds = tf.stack([tf.fill(tf.shape(positions), tf.constant(seed, tf.int64)), positions // n,
                              tf.zeros_like(positions)], axis=1)
            order = tf.raw_ops.RandomIndexShuffle(index=positions % n, seed=seeds,
                                                  max_index=tf.constant(n - 1, tf.int64))
            return tf.gather(features, order), tf.gather(labels, order)

        options = tf.data.Options()
        options.experimental_symbolic_checkpoint = True
        ds = tf.data.Dataset.range(2 ** 62).batch(batch, drop_remainder=True).map(pick).prefetch(2)
        return ds.with_options(options)

    return input_fn


def model_fn(features, labels, mode, params):
    import keras
    import tensorflow as tf

    from hostreduce.estimator import EstimatorSpec, ModeKeys, compute_gradients

    model = keras.Sequential([
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])
    logits = model(features)
    if mode == ModeKeys.PREDICT:
        return EstimatorSpec(mode, predictions={"classes": tf.argmax(logits, axis=1)})
    # Mean over the local batch only: the host averages the gradients across workers.
    loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
    if mode == ModeKeys.TRAIN:
        optimizer = keras.optimizers.Adam(params["learning_rate"])
        grads = compute_gradients(loss, model.trainable_variables)  # on the device

        def host_model_fn(*grads):  # on the host, after the all-reduce
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        return EstimatorSpec(mode, loss=loss, train_op=tf.identity(loss), host_call=(host_model_fn, grads))
    accuracy = keras.metrics.SparseCategoricalAccuracy()
    accuracy.update_state(labels, logits)
    return EstimatorSpec(mode, loss=loss, eval_metric_ops={"accuracy": accuracy})


def make_strategy(name: str, variables_on_host: bool):
    from hostreduce.strategies import HorovodStrategy, MultiWorkerStrategy

    if name == "ring":
        return MultiWorkerStrategy(variables_on_host=variables_on_host)
    if name == "horovod":
        return HorovodStrategy(variables_on_host=variables_on_host)
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    (x_train, y_train), (x_test, y_test) = load_data(args.data_dir)

    import keras

    from hostreduce.estimator import Estimator, RunConfig
    from hostreduce.strategies import SingleProcessStrategy

    keras.utils.set_random_seed(args.seed)
    strategy = make_strategy(args.strategy, not args.variables_on_device) \
        or SingleProcessStrategy(not args.variables_on_device)
    chief = strategy.is_chief
    logging.basicConfig(level=logging.INFO if chief else logging.WARNING,
                        format=f"[rank {strategy.rank}] %(message)s")
    # Training progress has its own logger, independent of the engine's log level.
    logging.getLogger("hostreduce.estimator").setLevel(logging.INFO if chief else logging.WARNING)
    if args.batch_size < strategy.size:
        sys.exit(f"--batch-size must be at least the number of workers ({strategy.size}). "
                 f"Received: --batch-size {args.batch_size}")
    if args.batch_size % strategy.size:
        per_worker = args.batch_size // strategy.size
        if chief:
            log.info("--batch-size %d is not a multiple of %d workers: using a global batch of %d (%d per worker)",
                     args.batch_size, strategy.size, per_worker * strategy.size, per_worker)
        args.batch_size = per_worker * strategy.size
    steps = int(args.epochs * len(x_train) / args.batch_size)
    config = RunConfig(train_distribute=strategy, model_dir=args.model_dir, save_checkpoints_steps=args.save_steps,
                       log_step_count_steps=args.log_steps, timeline_dir=args.timeline_dir)
    estimator = Estimator(model_fn, config=config, params={"learning_rate": args.learning_rate})
    if chief:
        log.info("%d workers, global batch %d, %d steps, %d training / %d test images", strategy.size,
                 args.batch_size, steps, len(x_train), len(x_test))
    seen: list[int] = []  # the global steps this run trained (a resumed run starts past 0)

    def record(step: int, _loss: float) -> None:
        seen.append(step)

    start = time.perf_counter()
    estimator.train(make_input_fn(x_train, y_train, args.batch_size, True, args.seed), max_steps=steps,
                    hooks=[record])
    train_s = time.perf_counter() - start
    metrics = estimator.evaluate(make_input_fn(x_test, y_test, args.batch_size, False, args.seed))
    if chief:
        trained, first_step = len(seen), (seen[0] - 1 if seen else estimator.global_step)
        resumed = f" (resumed at step {first_step}, now at step {estimator.global_step})" if first_step else ""
        log.info("trained %d steps in %.1f s%s; test loss %.4f", trained, train_s, resumed, metrics["loss"])
        print(f"test accuracy: {metrics['accuracy']:.4f}", flush=True)
    estimator.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
