"""Data-parallel MNIST with Keras ``model.fit`` and Horovod's Keras API on hostreduce.

``hostreduce.horovod.keras.DistributedOptimizer`` averages every gradient over the
workers inside the traced train step, each one as soon as the backward pass has
produced it; Horovod's callbacks start every worker from rank 0's weights, average the
metrics and warm the learning rate up. The same script runs over the gRPC ring
(``hostreduce run -np 2 -- python examples/keras/train.py``) and under ``mpirun``.

See README.md in this directory for the commands and options.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

Data = tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per worker")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate of one worker; scaled by the "
                                                                "number of workers")
    parser.add_argument("--warmup-epochs", type=int, default=2, help="epochs to ramp the learning rate up to "
                                                                     "lr * workers")
    parser.add_argument("--variables-on-host", action="store_true",
                        help="weights and optimizer state in host memory; the update runs there")
    parser.add_argument("--data", help="path to mnist.npz (Keras format); default: scikit-learn's 8x8 digits")
    parser.add_argument("--timeline", metavar="DIR", help="write DIR/timeline-rank{r}.json (Chrome trace)")
    parser.add_argument("--checkpoint-dir", help="rank 0 saves checkpoint-{epoch}.keras here")
    parser.add_argument("--save-weights", metavar="DIR", help="every rank saves its final weights to "
                                                              "DIR/weights-rank{r}.npz")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "warmup_epochs"):
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


def build_model(features: int, on_host: bool) -> Any:
    """An MLP; with ``on_host`` its weights live in host memory (``/CPU:0``)."""
    import keras
    import tensorflow as tf

    # With a keras.Input the weights are created here, under the device scope.
    with tf.device("/CPU:0") if on_host else contextlib.nullcontext():
        return keras.Sequential([
            keras.Input(shape=(features,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(10),
        ])


def save_weights(directory: str, rank: int, model: Any) -> None:
    os.makedirs(directory, exist_ok=True)
    np.savez(os.path.join(directory, f"weights-rank{rank}.npz"), *model.get_weights())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.timeline:
        # Read when the job is set up in hvd.init().
        os.environ["HOSTREDUCE_TIMELINE"] = args.timeline

    import keras
    import tensorflow as tf

    import hostreduce.horovod.keras as hvd

    hvd.init()
    # One GPU per process, chosen by the rank on this host.
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")

    (x_train, y_train), (x_test, y_test) = load_data(args.data)
    # Each worker reads its own shard; the same shuffle seed everywhere keeps them disjoint.
    dataset = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
               .shard(hvd.size(), hvd.rank())
               .shuffle(len(x_train), seed=0)
               .repeat()
               .batch(args.batch_size, drop_remainder=True))
    # Without tf.data's autotune thread: the iterator's destructor waits for it, which
    # can hold up the end of training by tens of seconds.
    options = tf.data.Options()
    options.autotune.enabled = False
    dataset = dataset.with_options(options)
    steps_per_epoch = max(1, len(x_train) // (args.batch_size * hvd.size()))

    model = build_model(x_train.shape[1], args.variables_on_host)
    scaled_lr = args.lr * hvd.size()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(scaled_lr), variables_on_host=args.variables_on_host)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    callbacks = [
        # Every worker starts from rank 0's weights and optimizer state (after batch 1).
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Epoch metrics averaged over the workers (before callbacks that read them).
        hvd.callbacks.MetricAverageCallback(),
        # Ramp the rate from lr to lr * workers: large early steps hurt accuracy.
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=args.warmup_epochs,
                                                 verbose=1),
    ]
    # Only rank 0 writes checkpoints and shows progress.
    if hvd.rank() == 0 and args.checkpoint_dir:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(args.checkpoint_dir,
                                                                      "checkpoint-{epoch}.keras")))
    start = time.perf_counter()
    # shuffle=False: the dataset shuffles itself (Keras warns that it cannot).
    model.fit(dataset, steps_per_epoch=steps_per_epoch, epochs=args.epochs, callbacks=callbacks, shuffle=False,
              verbose=2 if hvd.rank() == 0 else 0)
    train_s = time.perf_counter() - start

    if args.save_weights:
        save_weights(args.save_weights, hvd.rank(), model)
    # Every worker holds the same weights: rank 0 alone evaluates and reports.
    if hvd.rank() == 0:
        _, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
        print(f"{hvd.size()} workers, {args.epochs} epochs of {steps_per_epoch} steps in {train_s:.1f} s", flush=True)
        print(f"test accuracy: {accuracy:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
