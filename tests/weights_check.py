"""Checks shared by the training-equivalence tests: every rank's weights equal the
reference run's (one process on the global batch) and each other's."""
from __future__ import annotations

import numpy as np


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.max(np.abs(actual - expected)) / max(float(np.max(np.abs(expected))), 1e-12))


def check_training(weights_by_rank: list[list[np.ndarray]], expected: list[np.ndarray], what: str,
                   tolerance: float = 1e-5) -> None:
    """Each rank's weights within ``tolerance`` (relative) of ``expected``, and bitwise
    equal to rank 0's."""
    for rank, weights in enumerate(weights_by_rank):
        errors = [rel_err(w, e) for w, e in zip(weights, expected)]
        assert len(weights) == len(expected) and max(errors) <= tolerance, \
            f"{what}, rank {rank}: rel. errors {errors}"
        for w, w0 in zip(weights, weights_by_rank[0]):
            assert np.array_equal(w, w0), f"{what}: rank {rank}'s weights differ from rank 0's"
