"""What a ps task does when the script reaches training (``Estimator.train``,
``train_and_evaluate``, Keras ``fit`` on a ``ParameterServerStrategy``): it serves its
shards until the chief ends the job, then ends its process (status 0; 1 with the reason
when the job failed), so the rest of the script never runs there."""
from __future__ import annotations

from typing import Any, NoReturn

from ..errors import ClusterError
from ..progress import progress

__all__ = ["serve_and_exit", "training_task"]


def serve_and_exit(strategy: Any) -> NoReturn:
    progress("ps task %d: serving parameter-server shards until the chief ends the job", strategy.cluster.task_index)
    strategy.serve()
    progress("ps task %d: the chief ended the job", strategy.cluster.task_index)
    raise SystemExit(0)


def training_task(strategy: Any, what: str) -> None:
    """Where a script reaches ``what`` (the optimizer or the training loop of a Keras job
    on parameter servers): a ps task serves from here on (``serve_and_exit``); a training
    task goes on; any other task is refused."""
    role = strategy.role
    if role == "ps":
        serve_and_exit(strategy)
    if role != "worker":
        raise ClusterError(f"A Keras job on parameter servers has ps and training tasks only; this task reached "
                           f"{what}. Received: task.type={strategy.cluster.task_type!r}")
