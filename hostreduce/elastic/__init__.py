"""Elastic jobs: the membership service of ``hostreduce run --min-np/--max-np`` and the
workers' side of it.

A job's membership changes in epochs. The launcher runs a rendezvous service
(``rendezvous.py``) that knows which workers are running; each worker asks it for its
place (rank, size, every member's ring address) when its job starts and again after a
reset, and the service answers once every running worker has asked: the new epoch's
ring then comes up between exactly those workers. Survivors keep their order (the
lowest surviving rank becomes rank 0, whose state the others take); workers that join
come last. A running epoch learns that workers wait to join from the service's update
count, which rank 0 reads at each commit (``client.py``). The calls are authenticated
with the job's secret both ways (``wire.py``).
"""
from __future__ import annotations

from .wire import ELASTIC_ADDRESS_VAR, ELASTIC_HOST_VAR, ELASTIC_WORKER_VAR, elastic_from_env

__all__ = ["ELASTIC_ADDRESS_VAR", "ELASTIC_HOST_VAR", "ELASTIC_WORKER_VAR", "elastic_from_env"]
