"""Which training tasks the Estimator's own collectives span while it trains: the start
step, the variables' first values, when the data ends, logging, checkpoint timing and
input positions.

Normally every worker of the strategy, in step. In asynchronous parameter-server mode
each worker trains on its own: the ps apply each push as it arrives, and a worker that
fails or is lost must not stop the others, so a worker's training involves no other
worker at all. The chief still decides the checkpoints (its own input position only);
every worker starts from the ps's values and step (``PSTrainProgram.connect``), and the
other workers' variables that the ps do not hold (not trained through ``host_call``)
keep their own initial values. ``evaluate()`` still combines every worker's metrics over
the strategy's ring.
"""
from __future__ import annotations

from typing import Any

__all__ = ["Alone", "training_team"]


class Alone:
    """One worker as its own team of one: collectives over it are the identity."""

    size = 1
    rank = 0

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self._reducer: Any = None

    @property
    def is_chief(self) -> bool:
        return self.strategy.is_chief

    @property
    def reducer(self) -> Any:
        if self._reducer is None:
            from ..reducers.local import LocalReducer

            self._reducer = LocalReducer()
        return self._reducer


def training_team(strategy: Any) -> Any:
    """``strategy`` itself, or :class:`Alone` for an asynchronous parameter-server job."""
    if getattr(strategy, "parameter_servers", False) and not strategy.sync:
        return Alone(strategy)
    return strategy
