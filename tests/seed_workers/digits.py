"""The data of the seed-shaped scripts: scikit-learn's 8x8 digits as MNIST-like uint8
images (0..255), so the scripts' own ``/ 255.0`` normalisation applies unchanged."""
from __future__ import annotations

import os

import numpy as np


def load_data() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """``((x_train, y_train), (x_test, y_test))`` shaped like ``mnist.load_data()``.

    ``SEED_FAIL_RANK``/``SEED_FAIL_AFTER`` make that rank's training data raise after
    so many examples (a worker failing mid-training, as a corrupt input would)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    y = digits.target.astype(np.uint8)
    return (x, y), (x[:0], y[:0])


def load_mnist(test_rows: int = 297) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """``((x_train, y_train), (x_test, y_test))`` with MNIST's shapes: the 8x8 digits
    scaled 3x and padded to 28x28 uint8 images (1500 for training, ``test_rows`` for
    testing), for scripts whose model is built for 28x28 inputs."""
    (x, y), _ = load_data()
    x = np.pad(np.kron(x, np.ones((1, 3, 3), np.uint8)), ((0, 0), (2, 2), (2, 2)))
    split = len(x) - test_rows
    return (x[:split], y[:split]), (x[split:], y[split:])


class FailingRows:
    """Rows of ``x`` that raise ``ValueError`` once ``limit`` were read (in order)."""

    def __init__(self, x: np.ndarray, limit: int) -> None:
        self.x, self.limit, self.read = x, limit, 0

    def __len__(self) -> int:
        return len(self.x)

    def __iter__(self):
        for row in self.x:
            self.read += 1
            if self.read > self.limit:
                raise ValueError(f"corrupt example #{self.read} in this worker's data")
            yield row


def maybe_failing(x: np.ndarray, rank: int) -> object:
    fail_rank = os.environ.get("SEED_FAIL_RANK")
    if fail_rank is None or int(fail_rank) != rank:
        return x
    return FailingRows(x, int(os.environ.get("SEED_FAIL_AFTER", "1000")))
