"""Under mpirun: the Open MPI setting a new MPI reducer makes before MPI starts.

Prints ``NBC rank R: VALUE`` (the nonblocking all-reduce algorithm in this process's
environment once the reducer exists) and checks a large all-reduce against numpy.
"""
from __future__ import annotations

import os

import numpy as np

from hostreduce.config import Config
from hostreduce.reducers.mpi.reducer import NBC_ALLREDUCE_VAR, MPIReducer


def main() -> None:
    reducer = MPIReducer(config=Config(reducer="mpi"))
    rank, size = reducer.rank, reducer.size
    buf = np.arange((1 << 20) + 3, dtype=np.float32) + rank
    reducer.allreduce("nbc.check", buf, op="sum", out=buf)
    expected = size * np.arange((1 << 20) + 3, dtype=np.float32) + size * (size - 1) / 2
    assert np.array_equal(buf, expected)
    print(f"NBC rank {rank}: {os.environ.get(NBC_ALLREDUCE_VAR)}", flush=True)
    reducer.close()


if __name__ == "__main__":
    main()
