"""One worker of a small training job that may fail, for the tests of how jobs end.

Usage: python job_end.py REDUCER MODE STEPS [FAIL_RANK FAIL_STEP]

REDUCER is ``ring`` (cluster from TF_CONFIG, settings from HOSTREDUCE_*) or ``mpi``
(under mpirun, timeout_s from HOSTREDUCE_TIMEOUT_S). MODE:

- ``noclose``: every rank all-reduces STEPS times and returns without ``close()``;
  rank 0 leaves first: the others go on (without collectives) until its exit has
  closed its reducer, which it marks in the directory ``JOB_END_MARKS`` names.
- ``raise``: rank FAIL_RANK raises ``ValueError`` before step FAIL_STEP; nothing is
  caught anywhere.
- ``catch``: like ``raise``, but the other ranks catch every error and return normally.

Prints ``FINISHED <rank> <time.monotonic()>`` after the last step and ``RAISING <rank>
<time.monotonic()>`` just before the raise, so the test can time how the job ends (on
Linux the monotonic clock is the same in every process).
"""
from __future__ import annotations

import atexit
import os
import sys
import time

import numpy as np

from hostreduce.config import Config
from tests.marks import mark, wait_for_marks


def make(reducer: str):
    if reducer == "mpi":
        from hostreduce.reducers.mpi.reducer import MPIReducer

        return MPIReducer(config=Config(reducer="mpi", timeout_s=float(os.environ.get("HOSTREDUCE_TIMEOUT_S", 30))))
    from hostreduce.reducers import create_reducer

    return create_reducer(reducer)


def main(argv: list[str]) -> None:
    reducer, mode, steps = argv[0], argv[1], int(argv[2])
    fail_rank, fail_step = (int(argv[3]), int(argv[4])) if len(argv) > 4 else (-1, -1)
    r = make(reducer)
    x = np.full(10_000, r.rank + 1.0, np.float32)
    expected = r.size * (r.size + 1) / 2
    try:
        for step in range(steps):
            if mode != "noclose" and r.rank == fail_rank and step == fail_step:
                print(f"RAISING {r.rank} {time.monotonic()}", flush=True)
                raise ValueError(f"boom at step {step}")
            got = r.allreduce(f"grad/{step % 3}", x)
            assert float(got[0]) == expected, (step, got[0])
            time.sleep(0.01 * ((r.rank + step) % 3))  # ranks drift: some wait inside collectives
    except Exception as e:  # noqa: BLE001 - the 'catch' mode swallows everything
        if mode != "catch" or r.rank == fail_rank:
            raise
        print(f"CAUGHT {r.rank} {type(e).__name__}: {e}", flush=True)
        return
    if mode == "noclose":
        # Ranks leave at different times: rank 0 (the ring's coordinator) first, while
        # the others still work without collectives, as scripts do after training.
        marks = os.environ["JOB_END_MARKS"]
        if r.rank == 0:  # atexit runs after the exit hook that closes the reducer
            atexit.register(mark, marks, "rank0-closed")
        else:
            wait_for_marks(marks, ["rank0-closed"])
    print(f"FINISHED {r.rank} {time.monotonic()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
