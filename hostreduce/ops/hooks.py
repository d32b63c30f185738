"""Horovod's ``BroadcastGlobalVariablesHook`` for TF1 ``MonitoredTrainingSession`` scripts
and for ``hostreduce.estimator.Estimator.train(hooks=...)`` (which gives hooks a TF1 graph
whose global variables are the Estimator's)."""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from .functions import broadcast_global_variables

__all__ = ["BroadcastGlobalVariablesHook"]


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Assigns ``root_rank``'s value to every global variable once the session exists
    (after initialisation or a restore), so every rank starts from the same weights.

    Args:
        root_rank: the rank whose values every rank takes.
        device: accepted; the broadcast runs on the host.
    """

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.bcast_op: Any = None

    def begin(self) -> None:
        if self.bcast_op is None or self.bcast_op.graph is not tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: Any, coord: Any) -> None:
        session.run(self.bcast_op)
