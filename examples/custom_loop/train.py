"""Data-parallel MNIST with a GradientTape loop and Horovod's TensorFlow API on hostreduce.

The train step is a ``tf.function``; ``hvd.DistributedGradientTape`` hands each gradient
to the host as the backward pass produces it and returns the gradients averaged over the
workers. After the first step every worker takes rank 0's weights and optimizer state
(``hvd.broadcast_variables``). The same script runs over the gRPC ring
(``hostreduce run -np 2 -- python examples/custom_loop/train.py``) and under ``mpirun``.

See README.md in this directory for the commands and options.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

Data = tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per worker")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate of one worker; scaled by the "
                                                                "number of workers")
    parser.add_argument("--variables-on-host", action="store_true",
                        help="weights and optimizer state in host memory; the update runs there")
    parser.add_argument("--data", help="path to mnist.npz (Keras format); default: scikit-learn's 8x8 digits")
    parser.add_argument("--timeline", metavar="DIR", help="write DIR/timeline-rank{r}.json (Chrome trace)")
    parser.add_argument("--checkpoint-dir", help="rank 0 saves a tf.train.Checkpoint here at the end")
    parser.add_argument("--save-weights", metavar="DIR", help="every rank saves its final weights to "
                                                              "DIR/weights-rank{r}.npz")
    parser.add_argument("--log-steps", type=int, default=20, help="rank 0 prints the loss every N steps")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "log_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1. Received: {getattr(args, name)}")
    return args


def load_data(path: str | None) -> Data:
    """``((x_train, y_train), (x_test, y_test))``: images flattened to float32 in [0, 1]."""
    if path:
        if not os.path.isfile(path):
            sys.exit(f"--data {path!r} is not a file (expected mnist.npz in the Keras format: x_train, y_train, "
                     "x_test, y_test)")
        with np.load(path) as data:
            x_train, y_train, x_test, y_test = (data[k] for k in ("x_train", "y_train", "x_test", "y_test"))
        scale = 255.0
    else:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        print("No --data given: using scikit-learn's bundled 8x8 handwritten digits (1,797 images) "
              "instead of MNIST.", flush=True)
        digits = load_digits()
        x_train, x_test, y_train, y_test = train_test_split(
            digits.images, digits.target, test_size=0.2, random_state=0, stratify=digits.target)
        scale = 16.0
    prep = lambda x: (x.reshape(len(x), -1) / scale).astype("float32")  # noqa: E731
    return (prep(x_train), y_train.astype("int64")), (prep(x_test), y_test.astype("int64"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.timeline:
        # Read when the job is set up in hvd.init().
        os.environ["HOSTREDUCE_TIMELINE"] = args.timeline

    import keras
    import tensorflow as tf

    import hostreduce.horovod as hvd

    hvd.init()
    # One GPU per process, chosen by the rank on this host.
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")

    (x_train, y_train), (x_test, y_test) = load_data(args.data)
    # Each worker reads its own shard; the same shuffle seed everywhere keeps them disjoint.
    steps_per_epoch = max(1, len(x_train) // (args.batch_size * hvd.size()))
    dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
               .shard(hvd.size(), hvd.rank())
               .shuffle(len(x_train), seed=0)
               .repeat()
               .batch(args.batch_size, drop_remainder=True)
               .take(steps_per_epoch * args.epochs))
    # Without tf.data's autotune thread: the iterator's destructor waits for it, which
    # can hold up the end of training by tens of seconds.
    options = tf.data.Options()
    options.autotune.enabled = False
    dataset = dataset.with_options(options)

    def placement():
        return tf.device("/CPU:0") if args.variables_on_host else contextlib.nullcontext()

    with placement():
        # With a keras.Input the weights are created here, under the device scope.
        model = keras.Sequential([
            keras.Input(shape=(x_train.shape[1],)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(10),
        ])
        opt = keras.optimizers.Adam(args.lr * hvd.size())
        opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(images, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        # Reduce the gradients over the job, each as soon as it is produced.
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        with placement():  # the update runs where the variables live
            opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    start = time.perf_counter()
    for step, (images, labels) in enumerate(dataset):
        loss = train_step(images, labels)
        if step == 0:
            # Every worker continues from rank 0's weights and optimizer state; after
            # the first step, as in Horovod's examples, every variable exists.
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        if step % args.log_steps == 0 and hvd.rank() == 0:
            print(f"step {step}: loss {float(loss):.4f}", flush=True)
    train_s = time.perf_counter() - start

    if args.save_weights:
        os.makedirs(args.save_weights, exist_ok=True)
        np.savez(os.path.join(args.save_weights, f"weights-rank{hvd.rank()}.npz"), *model.get_weights())
    # Every worker holds the same weights: rank 0 alone checkpoints, evaluates and reports.
    if hvd.rank() == 0:
        if args.checkpoint_dir:
            tf.train.Checkpoint(model=model, optimizer=opt).save(os.path.join(args.checkpoint_dir, "ckpt"))
        logits = model.predict(x_test, batch_size=256, verbose=0)
        accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
        print(f"{hvd.size()} workers, {steps_per_epoch * args.epochs} steps in {train_s:.1f} s", flush=True)
        print(f"test accuracy: {accuracy:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
