"""Room in TensorFlow's inter-op thread pool for host collectives that wait.

A host collective's op waits on one of TensorFlow's inter-op threads until every rank
has submitted it (TensorFlow has no asynchronous Python op; Horovod's C++ ops are
asynchronous kernels and need no thread). A TF1 session starts the independent ops of
one run in any order, so with fewer threads than collectives that may wait at once (the
default pool has one thread per core) every thread of a rank can end up waiting for a
collective that the other ranks have not reached. :func:`make_room` (run when the job
module is imported, and by ``hvd.init()``) gives the pool :data:`INTER_OP_THREADS`
threads: through TensorFlow's ``TF_NUM_INTEROP_THREADS`` when TensorFlow is not imported
yet (a script that imports it after ``hvd.init()``: TensorFlow reads the variable when
it makes its pools), through ``tf.config.threading`` when it is imported but has not
started, otherwise as the default of every TF1 session made afterwards whose config does
not size the pool itself. A script that sized the pool (``TF_NUM_INTEROP_THREADS``,
``tf.config.threading``, a session's ``ConfigProto(inter_op_parallelism_threads=...)``)
keeps its size.
"""
from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from typing import Any

__all__ = ["INTER_OP_THREADS", "make_room"]

INTER_OP_THREADS = 32
_log = logging.getLogger("hostreduce.horovod")
_lock = threading.Lock()
_sessions_sized = False


def make_room() -> None:
    if os.environ.get("TF_NUM_INTEROP_THREADS"):
        return
    tf = sys.modules.get("tensorflow")
    if tf is None:  # TensorFlow reads it when it makes its thread pools
        os.environ["TF_NUM_INTEROP_THREADS"] = str(INTER_OP_THREADS)
        return
    try:
        if tf.config.threading.get_inter_op_parallelism_threads() == 0:
            tf.config.threading.set_inter_op_parallelism_threads(INTER_OP_THREADS)
        return
    except RuntimeError:  # TensorFlow has started: size the TF1 sessions made from now on
        pass
    _size_sessions()


def _size_sessions() -> None:
    global _sessions_sized
    from tensorflow.python.client import session  # the class every TF1 session is made by

    with _lock:
        if _sessions_sized:
            return
        _sessions_sized = True
        original = session.BaseSession.__init__

        @functools.wraps(original)
        def init(self: Any, target: str = "", graph: Any = None, config: Any = None) -> None:
            return original(self, target, graph, _with_room(config))

        session.BaseSession.__init__ = init
    _log.debug("hostreduce.horovod: TF1 sessions get %d inter-op threads unless their config sizes the pool",
               INTER_OP_THREADS)


def _with_room(config: Any) -> Any:
    import tensorflow as tf

    if config is None:
        return tf.compat.v1.ConfigProto(inter_op_parallelism_threads=INTER_OP_THREADS)
    if config.inter_op_parallelism_threads or len(config.session_inter_op_thread_pool):
        return config
    sized = tf.compat.v1.ConfigProto()
    sized.CopyFrom(config)
    sized.inter_op_parallelism_threads = INTER_OP_THREADS
    return sized
