"""The ``tf.distribute.Strategy`` surface of hostreduce's strategies: what TensorFlow's
multi-worker tutorials call (``scope``, ``run``, ``reduce``, distributed datasets,
``cluster_resolver``, ``extended.should_checkpoint``), on hostreduce's engines.

``hostreduce.MultiWorkerStrategy()`` (the ring, ``TF_CONFIG``) and
``hostreduce.HorovodStrategy()`` (under ``mpirun``) take the place of
``tf.distribute.MultiWorkerMirroredStrategy()``: each worker is one replica, the
strategy's ``scope()`` is a real ``tf.distribute`` scope (so Keras ``compile``/``fit``
and the optimizers' own gradient all-reduce see it), and every cross-worker reduction
goes through the streaming hand-off (:mod:`hostreduce.streaming`) to the strategy's
engine. Importing this package does not import TensorFlow; :func:`tf_strategy_for`
builds the TensorFlow object on first use.
"""
from __future__ import annotations

from typing import Any

__all__ = ["tf_strategy_for"]


def tf_strategy_for(strategy: Any) -> Any:
    """The ``tf.distribute.Strategy`` that stands for hostreduce ``strategy``."""
    from .strategy import HostStrategy

    return HostStrategy(strategy)
