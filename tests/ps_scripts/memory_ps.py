"""A parameter-server job with an embedding table larger than a worker should hold, run
as every task (roles from ``TF_CONFIG``): each task samples its resident memory
(``VmRSS`` of ``/proc/self/status``) and writes what it saw to ``--out/<task>.json``:
``baseline`` (a worker: TensorFlow imported and running, before the model is built; a
ps: before it serves), ``training`` (a worker: the largest sample from the end of the
first step through an evaluation after training), ``hwm`` (``VmHWM`` at the end) and ``last``. The ps tasks serve without
importing TensorFlow, which they do not need, so the job starts sooner."""
import argparse
import atexit
import json
import os
import threading

import numpy as np

import hostreduce

parser = argparse.ArgumentParser()
parser.add_argument("--rows", type=int, required=True)
parser.add_argument("--dim", type=int, default=64)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--batch", type=int, default=64)
parser.add_argument("--out", required=True)
args = parser.parse_args()

TASK = json.loads(os.environ["TF_CONFIG"])["task"]
NAME = f"{TASK['type']}{TASK['index']}"


def memory() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


class Meter:
    """Samples VmRSS every few milliseconds; the largest sample while ``training``."""

    def __init__(self) -> None:
        self.baseline = memory()["VmRSS"]
        self.training = False
        self.peak_training = 0
        self.samples = 0
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        atexit.register(self.write)

    def sample(self) -> None:
        rss = memory()["VmRSS"]
        if self.training:
            self.peak_training = max(self.peak_training, rss)
            self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.sample()

    def write(self) -> None:
        self._stop.set()
        now = memory()
        body = {"baseline": self.baseline, "training": self.peak_training, "samples": self.samples,
                "hwm": now["VmHWM"], "last": now["VmRSS"]}
        with open(os.path.join(args.out, f"{NAME}.json"), "w") as f:
            json.dump(body, f)


strategy = hostreduce.ParameterServerStrategy(sync=True, sparse="lazy")
if TASK["type"] == "ps":
    meter = Meter()
    strategy.serve()
    raise SystemExit(0)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.reduce_sum(tf.ones((8, 8)))  # TensorFlow's runtime up before the baseline
meter = Meter()


def input_fn(input_context=None):
    rng = np.random.default_rng(3)
    n = args.batch * (args.steps + 1) * 2
    ids = rng.integers(0, args.rows, size=(n, 4)).astype(np.int64)
    labels = rng.normal(size=(n, 1)).astype(np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((ids, labels))
    if input_context is not None and input_context.num_input_pipelines > 1:
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return dataset.batch(args.batch, drop_remainder=True).repeat()


def model_fn(features, labels, mode):
    emb = keras.layers.Embedding(args.rows, args.dim, embeddings_initializer=keras.initializers.RandomUniform(seed=1),
                                 name="emb")
    dense = keras.layers.Dense(1, name="out")
    pred = dense(tf.reduce_mean(emb(features), axis=1))
    loss = tf.reduce_mean(tf.square(pred - labels))
    if mode != hostreduce.ModeKeys.TRAIN:
        return hostreduce.EstimatorSpec(mode, loss=loss)
    optimizer = keras.optimizers.Adam(0.01)
    variables = emb.trainable_variables + dense.trainable_variables
    grads = hostreduce.compute_gradients(loss, variables)

    def host_fn(*g):
        optimizer.apply_gradients(zip(g, variables))

    return hostreduce.EstimatorSpec(mode, loss=loss, train_op=tf.identity(loss), host_call=(host_fn, grads))


def hook(step, loss):
    meter.training = True  # from the end of the first step on
    meter.sample()


estimator = hostreduce.Estimator(model_fn, config=hostreduce.RunConfig(train_distribute=strategy))
estimator.train(input_fn, max_steps=args.steps, hooks=[hook])
results = estimator.evaluate(input_fn, steps=3)  # reads the table's rows from the ps as training does
meter.training = False
print(f"DONE {NAME}: step {estimator.global_step} eval loss {results['loss']:.4f}", flush=True)
