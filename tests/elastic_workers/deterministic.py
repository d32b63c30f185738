"""An elastic GradientTape loop whose result does not depend on the job's membership:
at global step t every epoch's ranks split the same 12 examples (drawn from seed t)
evenly, so the average of their gradients is the gradient of the whole batch, and SGD
from the last commit gives what one process gives on the whole batches. A test changes
the membership at commits and compares the final weights with that one-process result.

With ``HR_ELASTIC_MARKS=<dir>``: ``started-w<id>`` at start, ``commit-w<id>-b<step>-s<size>``
after each commit, a wait while ``hold-b<step>`` exists, each rank's final weights in
``final-w<id>.npz``; a worker for which ``die-after-init-w<id>`` exists exits right after
its ``hvd.init()``.

Run: ``hostreduce run -np 2 --min-np 1 --max-np 3 ... -- python deterministic.py STEPS``;
``python deterministic.py STEPS --reference OUT.npz`` trains one process, no hostreduce.
"""
import os
import sys

import numpy as np
import tensorflow as tf

GLOBAL_BATCH = 12          # divisible by every size the tests use (1, 2, 3)
LR = 0.05


def make_model():
    model = tf.keras.Sequential([tf.keras.layers.Dense(16, activation="tanh"), tf.keras.layers.Dense(4)])
    model.build((None, 8))
    rng = np.random.default_rng(0)
    model.set_weights([rng.normal(scale=0.5, size=w.shape).astype(np.float32) for w in model.get_weights()])
    return model


def batch(step, rank=0, size=1):
    rng = np.random.default_rng(1000 + step)
    x = rng.normal(size=(GLOBAL_BATCH, 8)).astype(np.float32)
    y = rng.normal(size=(GLOBAL_BATCH, 4)).astype(np.float32)
    return x[rank::size], y[rank::size]


def reference(steps, out):
    model, opt = make_model(), tf.keras.optimizers.SGD(LR)
    for t in range(steps):
        x, y = batch(t)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    np.savez(out, *model.get_weights())


def main(steps):
    import hostreduce.horovod as hvd
    from tests import marks

    directory, worker = os.environ.get("HR_ELASTIC_MARKS"), os.environ.get("HOSTREDUCE_ELASTIC_WORKER", "?")
    if directory:
        marks.mark(directory, f"started-w{worker}")
    hvd.init()
    if directory and os.path.exists(os.path.join(directory, f"die-after-init-w{worker}")):
        os._exit(3)   # for a test: a member that has its place and is gone before its ring comes up
    model, opt = make_model(), tf.keras.optimizers.SGD(LR)
    opt.build(model.trainable_variables)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    @hvd.elastic.run
    def train(state):
        while state.batch < steps:
            train_step(*batch(state.batch, hvd.rank(), hvd.size()))
            state.batch += 1
            state.commit()
            if directory:
                marks.mark(directory, f"commit-w{worker}-b{state.batch}-s{hvd.size()}")
                marks.wait_for_absence(directory, f"hold-b{state.batch}", timeout=240)

    state = hvd.elastic.TensorFlowKerasState(model, opt, batch=0)
    train(state)
    if directory:
        np.savez(os.path.join(directory, f"final-w{worker}.npz"), *model.get_weights())
    print(f"DONE worker {worker} rank {hvd.rank()}/{hvd.size()} step {state.batch}", flush=True)


if __name__ == "__main__":
    if "--reference" in sys.argv:
        reference(int(sys.argv[1]), sys.argv[sys.argv.index("--reference") + 1])
    else:
        main(int(sys.argv[1]))
