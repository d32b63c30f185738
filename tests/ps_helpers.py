"""Shared pieces of the ps tests: an in-process cluster of ps threads, and the
reference training (one process applying the global batch's summed gradient with Keras)."""
from __future__ import annotations

import secrets
import threading
from typing import Any

import numpy as np

from hostreduce.processes import free_ports
from hostreduce.ps.client import PSClient
from hostreduce.ps.rows import sum_duplicates
from hostreduce.ps.server import ParameterServer

EMB_ROWS, EMB_DIM = 4000, 8


class LocalCluster:
    """``num_ps`` ps servers in this process, on loopback ports."""

    def __init__(self, num_ps: int, num_workers: int, *, mode: str = "sync", timeout_s: float = 5.0,
                 secret: str | None = None, **server_kwargs: Any) -> None:
        self.secret = secret or secrets.token_hex(16)
        self.addresses = [f"127.0.0.1:{p}" for p in free_ports(num_ps)]
        self.num_workers = num_workers
        self.servers = [ParameterServer(m, self.addresses, num_workers, self.secret, mode=mode, timeout_s=timeout_s,
                                        **server_kwargs) for m in range(num_ps)]
        self.threads = [threading.Thread(target=s.serve, daemon=True) for s in self.servers]
        for t in self.threads:
            t.start()

    def client(self, rank: int, *, timeout_s: float = 5.0, secret: str | None = None) -> PSClient:
        return PSClient(self.addresses, rank, self.num_workers, secret or self.secret, timeout_s=timeout_s,
                        connect_timeout_s=10.0)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def stop_and_join(self) -> None:
        """Stop every ps and check that each one's serving thread ended."""
        self.stop()
        for t in self.threads:
            t.join(30)  # a hang guard
        assert not any(t.is_alive() for t in self.threads), "a ps still serves after stop()"

    def snapshots(self) -> list[dict[str, np.ndarray]]:
        """Every array of every ps (values, slots, apply counts) and its step."""
        return [dict(s.store.snapshot(), step=np.array(s.store.step)) for s in self.servers]


def model_values(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"dense/kernel": rng.normal(size=(16, 4)).astype(np.float32),
            "dense/bias": rng.normal(size=(4,)).astype(np.float32),
            "emb": rng.normal(size=(EMB_ROWS, EMB_DIM)).astype(np.float32)}


def worker_grads(rank: int, step: int, batch: int = 64) -> tuple[dict, dict]:
    """Deterministic gradients of worker ``rank`` at ``step``: dense ones, and embedding
    rows with repeated ids (as an embedding lookup's IndexedSlices)."""
    rng = np.random.default_rng(1000 * step + rank)
    dense = {"dense/kernel": rng.normal(size=(16, 4)).astype(np.float32),
             "dense/bias": rng.normal(size=(4,)).astype(np.float32)}
    ids = rng.integers(0, 50, size=batch)          # few distinct ids: many duplicates
    ids[: batch // 4] = rng.integers(0, EMB_ROWS, size=batch // 4)
    rows = {"emb": (ids, rng.normal(size=(batch, EMB_DIM)).astype(np.float32))}
    return dense, rows


def keras_reference(optimizer_config: dict, num_workers: int, steps: int) -> dict[str, np.ndarray]:
    """One process applying, each step, the sum of every worker's gradients with Keras
    (the embedding's as IndexedSlices), which is data-parallel global-batch training."""
    import keras
    import tensorflow as tf

    cls = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam, "adagrad": keras.optimizers.Adagrad}
    cfg = {k: v for k, v in optimizer_config.items() if k not in ("name", "sparse")}
    opt = cls[optimizer_config["name"]](**cfg)
    variables = {n: tf.Variable(v) for n, v in model_values().items()}
    for step in range(1, steps + 1):
        grads = []
        for name, var in variables.items():
            if name == "emb":
                ids = np.concatenate([worker_grads(r, step)[1]["emb"][0] for r in range(num_workers)])
                vals = np.concatenate([worker_grads(r, step)[1]["emb"][1] for r in range(num_workers)])
                ids, vals = sum_duplicates(ids, vals)    # the lookup's gradient: duplicates summed
                grads.append(tf.IndexedSlices(tf.constant(vals), tf.constant(ids), tf.constant(var.shape)))
            else:
                grads.append(tf.constant(sum(worker_grads(r, step)[0][name] for r in range(num_workers))))
        opt.apply_gradients(zip(grads, variables.values()))
    return {n: v.numpy() for n, v in variables.items()}


def max_rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(1e-12, float(np.max(np.abs(b)))))


def assert_same_bits(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> None:
    """Two ``LocalCluster.snapshots()`` hold the same arrays, bit for bit."""
    assert [sorted(x) for x in a] == [sorted(y) for y in b]
    for m, (x, y) in enumerate(zip(a, b)):
        for name in x:
            assert x[name].dtype == y[name].dtype and x[name].tobytes() == y[name].tobytes(), (m, name)
