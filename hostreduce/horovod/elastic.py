"""``horovod.tensorflow.elastic``: not supported yet.

Elastic training (workers that leave or join a running job) is not part of hostreduce
yet; every name of this module raises :class:`hostreduce.errors.UnsupportedCallError`
saying so. Until then, run a fixed set of workers and resume from checkpoints.
"""
from __future__ import annotations

from typing import Any

from ..errors import UnsupportedCallError

MESSAGE = ("hostreduce.horovod.elastic is not supported yet: hostreduce jobs have a fixed set of workers. Run "
           "without elastic (hvd.init(), a fixed -np) and resume from a checkpoint after a failure. Received: "
           "hvd.elastic.{name}")


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise UnsupportedCallError(MESSAGE.format(name=name))
