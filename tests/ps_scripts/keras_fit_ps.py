"""Keras 3 ``model.fit`` with ``ParameterServerStrategy.keras_optimizer``, run as every
task of a parameter-server job (the same script on ps and workers, roles from
``TF_CONFIG``), or with ``--reference`` alone on the global batch; each training task
writes its final weights to ``--out/<rank>.npz``."""
import argparse
import contextlib
import os

import numpy as np

import keras
import tensorflow as tf

import hostreduce

VOCAB, DIM, LOOKUPS, FEATURES, EXAMPLES = 500, 8, 4, 6, 512

parser = argparse.ArgumentParser()
parser.add_argument("--optimizer", default="sgd")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--batch", type=int, default=16, help="per worker")
parser.add_argument("--workers", type=int, default=2)
parser.add_argument("--reference", action="store_true")
parser.add_argument("--async", dest="sync", action="store_false")
parser.add_argument("--scope", action="store_true", help="build the model in strategy.scope()")
parser.add_argument("--out", required=True)
args = parser.parse_args()

rng = np.random.default_rng(7)
ids = rng.integers(0, 40, size=(EXAMPLES, LOOKUPS)).astype(np.int32)   # few ids: duplicate rows
ids[:, 0] = rng.integers(0, VOCAB, size=EXAMPLES)
x = rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
y = rng.normal(size=(EXAMPLES, 1)).astype(np.float32)

if not args.reference:
    strategy = hostreduce.ParameterServerStrategy(sync=args.sync, shard_bytes=4_000)  # the table split by rows

keras.utils.set_random_seed(3)
with strategy.scope() if args.scope else contextlib.nullcontext():  # the table a row cache on workers
    id_in = keras.Input((LOOKUPS,), dtype="int32")
    x_in = keras.Input((FEATURES,))
    looked = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(VOCAB, DIM, name="emb")(id_in))
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(keras.layers.Concatenate()([looked, x_in]))
    model = keras.Model([id_in, x_in], keras.layers.Dense(1, name="out")(hidden))
optimizer = keras.optimizers.Adam(0.01) if args.optimizer == "adam" else keras.optimizers.SGD(0.3, momentum=0.5)

dataset = tf.data.Dataset.from_tensor_slices(((ids, x), y))
if args.reference:
    # The ps apply Keras's arithmetic to the embedding's gradient as a dense tensor
    # (duplicate rows summed first); Keras's own Adam squares an IndexedSlices's
    # duplicate rows one by one, so the reference densifies it first.
    class Dense(type(optimizer)):
        def apply(self, grads, trainable_variables=None):
            return super().apply([tf.convert_to_tensor(g) for g in grads], trainable_variables)

    optimizer = Dense.from_config(optimizer.get_config())
    rank, batch = 0, args.batch * args.workers
else:
    optimizer = strategy.keras_optimizer(optimizer)  # a ps task serves here, then exits 0
    rank, batch = strategy.rank, args.batch
    dataset = dataset.shard(strategy.size, rank)
model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
history = model.fit(dataset.batch(batch, drop_remainder=True).repeat(), steps_per_epoch=args.steps, epochs=1,
                    shuffle=False, verbose=0)
weights = ({v.path: np.asarray(v.numpy()) for v in model.trainable_variables} if args.reference
           else strategy.keras_variables())  # a row cache's table pulled whole
np.savez(os.path.join(args.out, f"{'ref' if args.reference else rank}.npz"), **weights)
if not args.reference and args.scope:  # the worker's table variable holds only the last batch's rows
    print(f"CACHED {model.get_layer('emb').embeddings.numpy().shape[0]} of {VOCAB} rows", flush=True)
print(f"DONE rank {rank}: loss {history.history['loss'][-1]!r}", flush=True)
