"""The job behind ``hostreduce.horovod``: where this process sits, which engine reduces,
and the names of collectives that the script did not name.

The job is found as the strategies find it: under ``mpirun`` from the launcher's
variables (engine: Horovod's core ops where they load, else MPI, or
``HOSTREDUCE_REDUCER``), otherwise from ``TF_CONFIG`` (``hostreduce run`` sets it; engine:
the ring), otherwise a single process. The engine is created at the first collective,
on the thread that calls it (MPI must be started from the thread that ends it), and
closed by :func:`shutdown` or at exit.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Any, Callable

from ..cluster import ClusterSpec, resolve_cluster
from ..cluster.mpi_env import spec_from_mpi_env
from ..errors import ConfigError, HostReduceError, NotInitializedError
from ..reducers.job_end import add_clean_exit_hook
from ..streaming.names import CollectiveNames
from .sessions import make_room

logger = logging.getLogger("hostreduce.horovod")

__all__ = ["NotInitializedError", "init", "shutdown", "is_initialized", "rank", "size", "local_rank",
           "local_size", "cross_rank", "cross_size", "channel", "collective_name", "eager_counts",
           "advance_eager_counts", "Job", "job"]


class Job:
    """This process's place in the job, its strategy (which owns the reducer) and timeline."""

    def __init__(self, cluster: ClusterSpec) -> None:
        from ..timeline import Timeline, timeline_dir_from_env

        self.cluster = cluster
        self.timeline = Timeline(timeline_dir_from_env(), rank=cluster.rank)
        self._strategy: Any = None
        self._channel: Any = None
        self._reducer: Any = None
        self._lock = threading.Lock()

    @property
    def strategy(self) -> Any:
        """The strategy that owns the engine; chosen at the first collective, so that a
        script using only the process API never reads the engine settings."""
        with self._lock:
            if self._strategy is None:
                self._strategy = _strategy_for(self.cluster)
            return self._strategy

    @property
    def channel(self) -> Any:
        """The process's channel: one for every job this process runs (after
        ``shutdown()`` and ``init()``, or an elastic reset), so that a ``tf.function``
        traced before reaches the engine of the job that runs it."""
        global _channel
        if self._channel is None:
            with _lock:
                if _channel is None:
                    from ..config import Config
                    from ..streaming import Channel

                    # The engine fails a collective after timeout_s with an error naming
                    # the cause; the hand-off's own limit is only a backstop behind it.
                    timeout = Config.from_env().timeout_s * 2 + 30.0
                    _channel = Channel(_current_reducer, self.strategy.ordered_submission, self.timeline, timeout)
            self._channel = _channel
        return self._channel

    def reducer(self) -> Any:
        """The engine, created on first use."""
        reducer = self.strategy.reducer
        if reducer is not self._reducer:
            self._reducer = reducer
            _end_job_at_exit()
        return reducer

    def failure(self) -> BaseException | None:
        """Why the job's engine can run no more collectives (a peer failed or left), or None."""
        reducer = self._reducer
        return None if reducer is None else reducer.failure

    def close(self, barrier: bool = True) -> None:
        """Close the engine; with ``barrier`` (``shutdown()``), first wait until every
        rank is done, as Horovod's ``shutdown()`` does (not after a peer failed)."""
        try:
            reducer = self._reducer
            if (barrier and reducer is not None and not reducer.closed and reducer.size > 1
                    and reducer.failure is None):
                try:
                    reducer.barrier(self.channel.timeout_s)
                except HostReduceError as exc:
                    logger.warning("hostreduce.horovod: the barrier before closing failed: %s", exc)
            if self._strategy is not None:
                self._strategy.close()
        finally:
            self.timeline.flush()


def _strategy_for(cluster: ClusterSpec) -> Any:
    from ..strategies import HorovodStrategy, MultiWorkerStrategy, SingleProcessStrategy

    if cluster.source == "elastic":
        from ..elastic.client import ElasticResolver

        return MultiWorkerStrategy(cluster_resolver=ElasticResolver(cluster), variables_on_host=False)
    if cluster.source == "mpirun":
        return HorovodStrategy(variables_on_host=False)
    if cluster.size > 1:
        return MultiWorkerStrategy(variables_on_host=False)
    return SingleProcessStrategy(variables_on_host=False)


_lock = threading.Lock()
_job: Job | None = None
_channel: Any = None
_elastic: Any = None      # the rendezvous client of an elastic job's worker (hostreduce.elastic)
_flush_registered = False
_exit_hook_registered = False
_on_shutdown: list[Callable[[], None]] = []


def _end_job_at_exit() -> None:
    """Close the job's engine at exit (flushing its timeline) ahead of the reducers
    themselves; a run that ends with an unhandled exception is left to the reducers'
    exit hook, which aborts the job naming the error."""
    global _exit_hook_registered
    with _lock:
        if _exit_hook_registered:
            return
        _exit_hook_registered = True
    add_clean_exit_hook(_close_at_exit)


def _close_at_exit() -> None:
    global _job
    with _lock:
        job, _job = _job, None
    if job is not None:
        try:
            # No barrier at exit: a rank may finish long before its peers, and leaving
            # early is an orderly goodbye that fails none of them.
            job.close(barrier=False)
        except Exception as exc:  # noqa: BLE001 - at exit: the reducers' own hook still runs
            logger.warning("hostreduce.horovod: closing the job at exit failed: %s: %s", type(exc).__name__, exc)


def init(comm: Any = None) -> None:
    """Find this process's place in the job. Safe to call more than once.

    Args:
        comm: accepted for Horovod compatibility; only None (the whole job) is supported.
    """
    global _job, _flush_registered
    if comm is not None:
        raise HostReduceError(
            "`comm` is not supported: hostreduce.horovod.init() always spans the whole job. "
            f"Received: comm={comm!r}"
        )
    with _lock:
        if _job is None:
            _job = Job(_elastic_place() or spec_from_mpi_env(os.environ) or resolve_cluster())
            make_room()
            if _job.timeline.enabled and not _flush_registered:
                _flush_registered = True
                atexit.register(_flush_at_exit)



def _current_reducer() -> Any:
    return job().reducer()


def elastic_client() -> Any:
    """The rendezvous client when this process is a worker of an elastic job, else None."""
    global _elastic
    if _elastic is None:
        from ..elastic.client import RendezvousClient

        _elastic = RendezvousClient.from_env(os.environ)
        if _elastic is not None:
            if spec_from_mpi_env(os.environ) is not None:
                raise ConfigError("An elastic job needs the ring: under mpirun the set of processes is fixed. "
                                  "Start it with `hostreduce run --min-np ...`. Received: HOSTREDUCE_ELASTIC "
                                  "and mpirun's variables both set")
            from ..reducers.job_end import survive_peer_failures

            survive_peer_failures()
    return _elastic


def _elastic_place() -> ClusterSpec | None:
    """This worker's place in the next epoch of its elastic job (None: not elastic)."""
    client = elastic_client()
    if client is None:
        return None
    from ..elastic.wire import elastic_timeout_from_env

    # The launcher stops a member that does not come within --elastic-timeout while the
    # others wait, so a worker waits longer before it gives up itself.
    return client.join(2 * elastic_timeout_from_env(os.environ) + 60.0)


def _flush_at_exit() -> None:
    job = _job
    if job is not None:
        job.timeline.flush()
    if _channel is not None:   # the first job's timeline, which the channel keeps across resets
        _channel.timeline.flush()


def shutdown() -> None:
    """Close the engine and forget the job (``init()`` may be called again)."""
    global _job
    with _lock:
        job, _job = _job, None
    if job is not None:
        for forget in list(_on_shutdown):
            forget()
        job.close()
        # The next job's ranks (an elastic job's new workers among them) count unnamed
        # eager collectives from zero alike.
        _names.reset_eager_counts()


def on_shutdown(fn: Callable[[], None]) -> None:
    """Call ``fn()`` when :func:`shutdown` ends the job (groups made on its engine are
    forgotten there)."""
    if fn not in _on_shutdown:
        _on_shutdown.append(fn)


def is_initialized() -> bool:
    return _job is not None


def job() -> Job:
    current = _job
    if current is None:
        raise NotInitializedError("hostreduce.horovod has not been initialized; call hvd.init() first.")
    return current


def _spec() -> ClusterSpec:
    return job().cluster


def channel() -> Any:
    """The :class:`hostreduce.streaming.Channel` of the job, with its engine started.

    The engine starts here, on the caller's thread (the thread that traces a
    ``tf.function`` or runs eagerly), never inside a TensorFlow op.
    """
    current = job()
    result = current.channel
    current.reducer()
    return result


def rank() -> int:
    """This process's rank in the job, 0 .. size() - 1."""
    return _spec().rank


def size() -> int:
    """Number of processes in the job."""
    return _spec().size


def local_rank() -> int:
    """This process's index among the job's processes on its host."""
    return _spec().local_rank


def local_size() -> int:
    """Number of the job's processes on this host."""
    return _spec().local_size


def _hosts(spec: ClusterSpec) -> list[str]:
    if spec.addresses:
        return list(dict.fromkeys(spec.hosts))
    return [str(i) for i in range(max(1, spec.size // max(1, spec.local_size)))]


def cross_rank() -> int:
    """Index of this process's host among the job's hosts."""
    spec = _spec()
    if spec.addresses:
        return _hosts(spec).index(spec.hosts[spec.rank])
    return spec.rank // max(1, spec.local_size)


def cross_size() -> int:
    """Number of hosts in the job."""
    return len(_hosts(_spec()))


# ----------------------------------------------------------------------------- names
# A collective the script did not name is named alike on every rank
# (``hostreduce/streaming/names.py``).
_names = CollectiveNames("hvd")


def collective_name(kind: str, name: str | None) -> str:
    """``name`` when given, else ``hvd.<function>.<kind>.<n>`` (``hvd.eager...`` eagerly),
    counted per kind."""
    if name is not None:
        if not isinstance(name, str) or not name:
            raise HostReduceError(f"`name` must be a non-empty string or None. Received: name={name!r}")
        return name
    return _names.next(kind)


def eager_counts() -> dict[str, int]:
    """How many unnamed collectives of each kind this process has run eagerly."""
    return _names.eager_counts()


def advance_eager_counts(counts: dict[str, int]) -> None:
    """Raise each kind's eager count to at least ``counts``'s: after a join, where the
    ranks that had not joined ran collectives that the joined ones did not, every rank
    takes the highest count so that the next unnamed collective has one name again."""
    _names.advance_eager_counts(counts)


# Host collectives wait on TensorFlow's inter-op threads: give the pool room as soon as
# this is imported after TensorFlow (TF1 sessions share one pool, sized by the first
# session made, which may come before ``hvd.init()``), and again at ``init()``.
make_room()
