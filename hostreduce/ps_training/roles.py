"""What a ps task does when the script reaches training (``Estimator.train``,
``train_and_evaluate``, Keras ``fit`` on a ``ParameterServerStrategy``): it serves its
shards until the chief ends the job, then ends its process (status 0; 1 with the reason
when the job failed), so the rest of the script never runs there."""
from __future__ import annotations

from typing import Any, NoReturn

from ..progress import progress

__all__ = ["serve_and_exit"]


def serve_and_exit(strategy: Any) -> NoReturn:
    progress("ps task %d: serving parameter-server shards until the chief ends the job", strategy.cluster.task_index)
    strategy.serve()
    progress("ps task %d: the chief ended the job", strategy.cluster.task_index)
    raise SystemExit(0)
