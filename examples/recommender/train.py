"""A wide-and-deep recommender with a large embedding table on parameter servers.

The same script runs in every task of the job (roles from ``TF_CONFIG``): the ps tasks
hold the tables (sharded by rows) and their Adam slots and apply the gradients; each
training task pulls the rows its batch looks up, computes the gradients of its batch,
and pushes them back. After training, the training tasks evaluate on held-out
synthetic clicks and the chief prints loss, AUC and accuracy.

See README.md in this directory for the commands (``hostreduce run -np 2 --ps 2``, or
one terminal per task).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import wide_deep  # noqa: E402

log = logging.getLogger("recommender")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=4_000_000, help="rows of the embedding table (default 4M)")
    parser.add_argument("--dim", type=int, default=64, help="embedding width (default 64)")
    parser.add_argument("--batch-size", type=int, default=512, help="examples per worker per step (default 512)")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--eval-batches", type=int, default=20, help="held-out batches to evaluate (default 20)")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--async", dest="sync", action="store_false",
                        help="apply each worker's gradients as they arrive (default: sync, the ps average "
                             "the workers' gradients of each step)")
    parser.add_argument("--model-dir", help="checkpoint directory (training resumes from it)")
    parser.add_argument("--save-steps", type=int, default=None, help="checkpoint every N steps")
    parser.add_argument("--log-steps", type=int, default=50)
    parser.add_argument("--shard-bytes", type=int, default=4 << 20,
                        help="tables of at least this many bytes are split by rows over the ps (default 4 MiB)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("vocab", "dim", "batch_size", "steps", "eval_batches", "shard_bytes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1. Received: {getattr(args, name)}")
    if args.vocab < wide_deep.FIELDS:
        parser.error(f"--vocab must be at least {wide_deep.FIELDS} (one row per field). Received: {args.vocab}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    import hostreduce

    # Adam on the tables updates only the rows of each batch ("lazy"), O(batch) per step;
    # Keras's exact Adam would move every row of a 4M-row table at every step.
    # The chief registers the tables on the ps before the first step (a 1 GB initial value
    # at 4M x 64: tens of seconds on a busy machine) while the other workers wait for it
    # in a collective: give that wait more than the default 30 s, unless the user chose.
    overrides = {} if "HOSTREDUCE_TIMEOUT_S" in os.environ else {"timeout_s": 180.0}
    strategy = hostreduce.ParameterServerStrategy(sync=args.sync, sparse="lazy", shard_bytes=args.shard_bytes,
                                                  config=hostreduce.Config.from_env(**overrides))
    chief = strategy.role == "worker" and strategy.is_chief
    logging.basicConfig(level=logging.INFO if chief else logging.WARNING, format="%(message)s")
    logging.getLogger("hostreduce.estimator").setLevel(logging.INFO if chief else logging.WARNING)
    params = {"vocab": args.vocab, "dim": args.dim, "learning_rate": args.learning_rate}
    config = hostreduce.RunConfig(train_distribute=strategy, model_dir=args.model_dir,
                                  save_checkpoints_steps=args.save_steps, log_step_count_steps=args.log_steps)
    estimator = hostreduce.Estimator(wide_deep.model_fn, config=config, params=params)
    if chief:
        table_mb = args.vocab * args.dim * 4 / 1e6
        log.info("table %d x %d float32 (%.0f MB; with Adam's slots %.0f MB on the ps), %d workers x batch %d, "
                 "%d steps, %s", args.vocab, args.dim, table_mb, 3 * table_mb, strategy.size, args.batch_size,
                 args.steps, "sync" if args.sync else "async")
    start = time.perf_counter()
    # A ps task serves inside train() and ends its process when the chief's ends.
    estimator.train(wide_deep.make_input_fn(args.batch_size, args.vocab, args.seed), max_steps=args.steps)
    train_s = time.perf_counter() - start
    client = strategy.job.client
    pulled, pushed = sum(client.bytes_received.values()), sum(client.bytes_sent.values())
    metrics = estimator.evaluate(wide_deep.make_input_fn(args.batch_size, args.vocab, args.seed,
                                                         eval_batches=args.eval_batches))
    if chief:
        log.info("trained to step %d in %.1f s; this worker's ps traffic: %.1f MB received, %.1f MB sent "
                 "(the registration of the initial values included)",
                 estimator.global_step, train_s, pulled / 1e6, pushed / 1e6)
        print(f"held-out: loss {metrics['loss']:.4f}, AUC {metrics['auc']:.4f}, accuracy {metrics['accuracy']:.4f}",
              flush=True)
    estimator.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
