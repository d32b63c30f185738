"""An Estimator with an embedding and a dense layer, run as every task of a
parameter-server job (the same script on ps and workers, roles from ``TF_CONFIG``) or,
with ``--reference``, alone on the global batch; each training task writes its final
variables to ``--out/<rank>.npz``."""
import argparse
import os
import signal
import sys
import time

import numpy as np

import keras
import tensorflow as tf

import hostreduce

VOCAB, DIM, LOOKUPS, FEATURES, EXAMPLES = 1000, 8, 4, 6, 1024

parser = argparse.ArgumentParser()
parser.add_argument("--optimizer", default="sgd")
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--batch", type=int, default=16, help="per worker")
parser.add_argument("--workers", type=int, default=2)
parser.add_argument("--reference", action="store_true")
parser.add_argument("--evaluate", action="store_true", help="after training, evaluate on the first examples")
parser.add_argument("--model-dir")
parser.add_argument("--save-steps", type=int, default=3, help="save_checkpoints_steps")
parser.add_argument("--keep", type=int, default=5, help="keep_checkpoint_max")
parser.add_argument("--progress", action="store_true", help="log the Estimator's progress (as tf.estimator's INFO)")
parser.add_argument("--async", dest="sync", action="store_false", help="ParameterServerStrategy(sync=False)")
parser.add_argument("--fail-at", type=int, help="worker 1 fails after this step: --fail-how")
parser.add_argument("--fail-how", choices=("kill", "raise", "both"), default="raise",
                    help="SIGKILL itself or raise; both: worker 1 is killed and worker 2 raises")
parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step of the chief lasts more")
parser.add_argument("--train-and-evaluate", action="store_true", help="train_and_evaluate (with an evaluator task)")
parser.add_argument("--marks", help="a directory of test events: each ps writes ps-K (its pid and address) there "
                    "before it serves; the chief marks chief-step-1 after its first step and waits for 'resume'")
parser.add_argument("--out", required=True)
args = parser.parse_args()
if args.marks:
    import json

    from tests.marks import mark, wait_for_marks

    tf_config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    task = tf_config.get("task", {})
    if task.get("type") == "ps":
        address = tf_config["cluster"]["ps"][task["index"]]
        with open(os.path.join(args.marks, f".ps-{task['index']}"), "w") as f:
            json.dump({"pid": os.getpid(), "address": address}, f)
        os.rename(os.path.join(args.marks, f".ps-{task['index']}"), os.path.join(args.marks, f"ps-{task['index']}"))
if args.progress:
    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.INFO)


def data():
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 60, size=(EXAMPLES, LOOKUPS)).astype(np.int32)   # few ids: duplicates
    ids[:, 0] = rng.integers(0, VOCAB, size=EXAMPLES)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
    y = rng.normal(size=(EXAMPLES, 1)).astype(np.float32)
    return {"ids": ids, "x": x}, y


def input_fn(input_context=None):
    features, labels = data()
    dataset = tf.data.Dataset.from_tensor_slices((features, labels))
    batch = args.batch
    if input_context is not None and input_context.num_input_pipelines > 1:
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    elif args.reference:
        batch = args.batch * args.workers
    return dataset.batch(batch, drop_remainder=True).repeat()


def eval_input_fn():
    """Every worker (and the reference) evaluates the same batches of the global size."""
    features, labels = data()
    return tf.data.Dataset.from_tensor_slices((features, labels)).batch(args.batch * args.workers).take(2)


def model_fn(features, labels, mode):
    emb = keras.layers.Embedding(VOCAB, DIM, embeddings_initializer=keras.initializers.RandomUniform(seed=1),
                                 name="emb")
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2),
                               bias_initializer="zeros", name="out")
    looked = tf.reduce_mean(emb(features["ids"]), axis=1)
    pred = dense(tf.concat([looked, features["x"]], axis=1))
    loss = tf.reduce_mean(tf.square(pred - labels))
    if mode != hostreduce.ModeKeys.TRAIN:
        mse = tf.compat.v1.metrics.mean_squared_error(labels, pred)  # per example: an empty batch adds nothing
        return hostreduce.EstimatorSpec(mode, loss=loss, eval_metric_ops={"mse": mse})
    optimizer = keras.optimizers.Adam(0.01) if args.optimizer == "adam" else keras.optimizers.SGD(0.5)
    variables = emb.trainable_variables + dense.trainable_variables
    grads = hostreduce.compute_gradients(loss, variables)

    def host_fn(*g):
        optimizer.apply_gradients(zip(g, variables))

    return hostreduce.EstimatorSpec(mode, loss=loss, train_op=tf.identity(loss), host_call=(host_fn, grads))


if args.reference:
    config = hostreduce.RunConfig(fused_apply=False, model_dir=args.model_dir)
else:
    strategy = hostreduce.ParameterServerStrategy(sync=args.sync, shard_bytes=16_000)
    config = hostreduce.RunConfig(train_distribute=strategy, model_dir=args.model_dir,
                                   save_checkpoints_steps=args.save_steps, keep_checkpoint_max=args.keep)
estimator = hostreduce.Estimator(model_fn, config=config)
rank = 0 if args.reference or estimator.strategy.role != "worker" else estimator.strategy.rank


def hook(step, loss):
    if rank == 0 and args.marks and step == 1:  # the test acts between the chief's steps 1 and 2
        mark(args.marks, "chief-step-1")
        wait_for_marks(args.marks, ["resume"], timeout=240)
    if rank == 0 and args.step_sleep:  # the chief's simulated longer steps (only their sum matters)
        time.sleep(args.step_sleep)
    failing = {"kill": {1: "kill"}, "raise": {1: "raise"}, "both": {1: "kill", 2: "raise"}}[args.fail_how]
    if rank in failing and step == args.fail_at:
        print(f"FAILING rank {rank} at step {step} ({failing[rank]})", flush=True)
        if failing[rank] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"worker {rank} fails on purpose after step {step}")


if args.train_and_evaluate:  # an evaluator task evaluates each checkpoint (the others train)
    metrics, _ = hostreduce.train_and_evaluate(estimator, hostreduce.TrainSpec(input_fn, args.steps, (hook,)),
                                               hostreduce.EvalSpec(eval_input_fn, steps=None))
    if estimator.strategy.role == "evaluator":
        print(f"EVALUATOR step {metrics['global_step']}: loss {metrics['loss']!r} mse {metrics['mse']!r}",
              flush=True)
        sys.exit(0)
else:
    estimator.train(input_fn, max_steps=args.steps, hooks=[hook])
if args.evaluate:
    results = estimator.evaluate(eval_input_fn)
    print(f"EVAL rank {rank}: loss {results['loss']!r} mse {results['mse']!r}", flush=True)
# get_variables pulls the sharded table from the ps: the chief ends the job only once
# every other worker's process has ended, so no worker need wait for the others here.
values = {k: v for k, v in estimator.get_variables().items() if v.dtype.kind == "f" and v.ndim >= 1}
np.savez(os.path.join(args.out, f"{'ref' if args.reference else rank}.npz"), **values)
traffic = {} if args.reference else estimator.strategy.job.client.bytes_received
print(f"DONE rank {rank}: step {estimator.global_step} pulled {sorted(traffic.items())}", flush=True)
