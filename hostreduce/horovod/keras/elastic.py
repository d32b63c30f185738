"""``horovod.tensorflow.keras.elastic``: not supported yet.

Elastic training (``KerasState``, ``run``, the commit/reset callbacks) needs ranks to
join and leave a running job, which hostreduce's engines do not do yet. Every name of
this module raises :class:`hostreduce.errors.UnsupportedCallError` saying so.
"""
from __future__ import annotations

from typing import NoReturn

from ...errors import UnsupportedCallError


def __getattr__(name: str) -> NoReturn:
    if name.startswith("__"):
        raise AttributeError(name)
    raise UnsupportedCallError(
        f"Elastic training (hvd.elastic.{name}) is not yet supported by hostreduce.horovod: its jobs have a fixed "
        "set of ranks. Run without elastic (hvd.DistributedOptimizer, callbacks.BroadcastGlobalVariablesCallback) "
        "and restart the job from a checkpoint to change its size."
    )
