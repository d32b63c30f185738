"""The wide-and-deep recommender of ``train.py`` trained with Keras ``model.fit`` on
parameter servers.

The same script runs in every task of the job (roles from ``TF_CONFIG``). The model is
built in ``strategy.scope()``: each table the ps split by rows is, on a worker, a cache
of the rows its steps look up (a host op in the lookup pulls them), so no worker holds a
table whole. ``strategy.keras_optimizer`` puts Adam's slots on the ps; on a ps task that
call serves until the chief ends the job. After training the chief evaluates on the
held-out clicks and prints loss, AUC and accuracy.

    .venv/bin/hostreduce run -np 2 --ps 2 -- .venv/bin/python examples/recommender/train_keras.py
"""
from __future__ import annotations

import logging
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import wide_deep  # noqa: E402
from train import parse_args  # noqa: E402  (the same options)

log = logging.getLogger("recommender")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model_dir or args.save_steps:
        sys.exit("train_keras.py: --model-dir/--save-steps are train.py's: checkpoints of the ps shards are not "
                 "written with Keras fit yet")

    import keras

    import hostreduce

    # Lazy Adam on the tables (only the batch's rows move), as train.py; the chief
    # registers the tables before the first step while the others wait for it.
    overrides = {} if "HOSTREDUCE_TIMEOUT_S" in os.environ else {"timeout_s": 180.0}
    strategy = hostreduce.ParameterServerStrategy(sync=args.sync, sparse="lazy", shard_bytes=args.shard_bytes,
                                                  config=hostreduce.Config.from_env(**overrides))
    keras.utils.set_random_seed(args.seed)
    with strategy.scope():
        model = wide_deep.keras_model(args.vocab, args.dim)
    optimizer = strategy.keras_optimizer(keras.optimizers.Adam(args.learning_rate))  # a ps task serves here
    chief = strategy.is_chief
    logging.basicConfig(level=logging.INFO if chief else logging.WARNING, format="%(message)s")
    model.compile(optimizer=optimizer, loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.AUC(from_logits=True, name="auc"),
                           keras.metrics.BinaryAccuracy(threshold=0.0, name="accuracy")], jit_compile=False)
    train = wide_deep.make_input_fn(args.batch_size, args.vocab, args.seed)(None, strategy.input_context())
    if chief:
        log.info("table %d x %d float32 (%.0f MB), %d workers x batch %d, %d steps, %s, Keras fit", args.vocab,
                 args.dim, args.vocab * args.dim * 4 / 1e6, strategy.size, args.batch_size, args.steps,
                 "sync" if args.sync else "async")
    start = time.perf_counter()
    model.fit(train, steps_per_epoch=args.steps, epochs=1, verbose=0, shuffle=False)
    train_s = time.perf_counter() - start
    caches = [v for v in model.trainable_variables if tuple(v.numpy().shape) != tuple(v.shape)]
    held = ", ".join(f"{v.path}: {v.numpy().shape[0]} of {v.shape[0]} rows" for v in caches)
    print(f"worker {strategy.rank} holds {held or 'every table whole'}", flush=True)
    if chief:  # every held-out batch, on the chief alone
        held_out = wide_deep.make_input_fn(args.batch_size, args.vocab, args.seed, eval_batches=args.eval_batches)()
        metrics = model.evaluate(held_out, verbose=0, return_dict=True)
        log.info("trained %d steps in %.1f s (%.0f examples/s over %d workers)", args.steps, train_s,
                 args.steps * args.batch_size * strategy.size / train_s, strategy.size)
        print(f"held-out: loss {metrics['loss']:.4f}, AUC {metrics['auc']:.4f}, accuracy {metrics['accuracy']:.4f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
