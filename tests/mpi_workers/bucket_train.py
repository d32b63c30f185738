"""Under mpirun: train the test MLP with the 'mpi' reducer at several fusion bucket sizes,
counting the collectives the engine runs and the buckets the hook sees.

    python bucket_train.py RUN[,RUN] STEPS OUT_DIR      RUN = OPT@BUCKET_BYTES ("default": the config's)

Writes ``RUN-rankR.npz`` (weights) and ``RUN-rankR.json`` (counts) per run.
"""
from __future__ import annotations

import collections
import json
import os
import sys

from tests.tf_workers import tf_common as common


def main() -> None:
    from hostreduce.config import Config
    from hostreduce.reducers.mpi.reducer import MPIReducer
    from hostreduce.strategies import HorovodStrategy
    from hostreduce.streaming import default_bucket_hook, register_bucket_hook

    engine: collections.Counter = collections.Counter()
    for method in ("_allreduce_async", "_broadcast_async", "_allgather_async"):
        original = getattr(MPIReducer, method)

        def counted(self, name, *args, _original=original, _kind=method, **kwargs):
            grad = "hostreduce.grad" in name
            engine[(_kind.strip("_").split("_")[0], "grad" if grad else "other")] += 1
            return _original(self, name, *args, **kwargs)

        setattr(MPIReducer, method, counted)
    buckets: list[list[object]] = []

    def recording_hook(reducer, bucket):
        buckets.append([bucket.name, len(bucket.names), bucket.nbytes])
        return default_bucket_hook(reducer, bucket)

    register_bucket_hook(recording_hook)
    runs, steps, out_dir = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3]
    for run in runs:
        opt, _, size = run.partition("@")
        overrides = {} if size == "default" else {"fusion_threshold_bytes": int(size)}
        strategy = HorovodStrategy(config=Config.from_env(**overrides), reducer="mpi")
        engine.clear()
        buckets.clear()
        result = common.train_weights(strategy, opt, steps)
        rank = strategy.rank
        common.save_result(os.path.join(out_dir, f"{run}-rank{rank}.npz"), result)
        counts = {"engine": {f"{k}/{g}": n for (k, g), n in engine.items()}, "buckets": list(buckets),
                  "steps": int(result["__steps_run__"])}
        with open(os.path.join(out_dir, f"{run}-rank{rank}.json"), "w") as f:
            json.dump(counts, f)
        print(f"OK {run} rank {rank}/{strategy.size} reducer {strategy.reducer_name}", flush=True)


if __name__ == "__main__":
    main()
