"""``horovod.tensorflow.elastic`` on hostreduce's ring: ``hvd.elastic.run``, the states
and their commit, restore and sync.

Under ``hostreduce run --min-np A --max-np B`` a worker that fails costs the others the
steps since their last ``state.commit()``, not the job: their collectives fail (a
``PeerLostError`` naming the worker; Horovod's :class:`HorovodInternalError` is handled
alike), ``run`` restores the committed state, the survivors form
a new ring (``hvd.size()`` and ``hvd.rank()`` change; the lowest surviving rank becomes
rank 0) and take rank 0's state, and the wrapped function starts again. Workers that
the launcher adds wait until the next commit, where every member raises
:class:`HostsUpdatedInterrupt` together and the ring is formed again with them.

Outside an elastic job the states work as in a fixed job (commit, restore, sync), and a
failed collective is raised as it is: there is no one to form a new ring with.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterable

from ..errors import (AuthenticationError, ClusterError, CollectiveTimeoutError, ConfigError, HorovodInternalError,
                      HostsUpdatedInterrupt, PeerLostError, ReducerClosedError, TensorMismatchError,
                      UnmatchedCollectiveError, UnsupportedCallError)
from ..host.kerases import optimizer_variables
from ..ops import job as _job
from ..ops.functions import broadcast_object
from ..ops.job import rank, shutdown
from ..ops.process_sets import init

__all__ = ["run", "State", "ObjectState", "TensorFlowState", "TensorFlowKerasState", "HorovodInternalError",
           "HostsUpdatedInterrupt"]

log = logging.getLogger("hostreduce.horovod")


def _updates() -> int:
    """The launcher's count of workers that asked to join (0 outside an elastic job)."""
    client = _job.elastic_client()
    return 0 if client is None else client.updates()


def _epoch_updates() -> int:
    """That count when the current epoch formed: the workers it counts are members."""
    client = _job.elastic_client()
    return 0 if client is None else client.epoch_updates


class State:
    """What an elastic job keeps across resets (Horovod's ``horovod.common.elastic.State``).

    Args:
        bcast_object: ``fn(obj) -> obj``, rank 0's object on every rank.
        get_rank: ``fn() -> int``, this worker's rank.
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._known_updates = 0
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` after every reset (a worker lost or added), e.g. to
        scale the learning rate to the new ``hvd.size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Keep the state as it is now (in host memory), then raise
        :class:`HostsUpdatedInterrupt` on every worker if workers wait to join."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every worker, together, if workers wait
        to join (rank 0 asks the launcher; every rank takes its answer)."""
        if self._rank() == 0:
            # Joins counted before this epoch formed are in it (it may have formed after a
            # reset that began before those joins were seen at a commit).
            self._known_updates = max(self._known_updates, _epoch_updates())
        seen = _updates() if self._rank() == 0 else 0
        previous, now = self._bcast_object((self._known_updates, seen))
        self._known_updates = now
        if now > previous:
            raise HostsUpdatedInterrupt(False)

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self) -> None:
        raise NotImplementedError()

    def reset(self) -> None:
        """Called after a reset, before the state is synchronized (nothing by default)."""


class ObjectState(State):
    """State of plain Python values, given as keyword arguments and kept as attributes.

    Args:
        bcast_object: ``fn(obj) -> obj``, rank 0's object on every rank.
        get_rank: ``fn() -> int``, this worker's rank.
        **kwargs: the values (e.g. ``epoch=0, batch=0``).
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int], **kwargs: Any) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


def _eager() -> bool:
    import tensorflow as tf

    return bool(tf.executing_eagerly())


def _graph_mode(what: str) -> UnsupportedCallError:
    return UnsupportedCallError(f"hvd.elastic.{what} runs eagerly (TensorFlow 2); TF1 graph mode with a session is "
                                "not supported by hostreduce's elastic states. Received: a call in graph mode")


class _Variables:
    """Copies of variables in host memory: taken at save, put back at restore."""

    def __init__(self, variables: Callable[[], list[Any]]) -> None:
        self._variables = variables
        self._saved: list[Any] = []

    def save(self) -> None:
        self._saved = [v.numpy() for v in self._variables()]

    def restore(self) -> None:
        variables = self._variables()
        if len(variables) != len(self._saved):   # e.g. slots built after the last commit: left as they are
            log.info("hvd.elastic: restoring %d saved values into %d variables (pairs in order, as Horovod)",
                     len(self._saved), len(variables))
        for var, value in zip(variables, self._saved):
            var.assign(value)

    def sync(self) -> None:
        from ..ops.tensors import broadcast_variables

        variables = self._variables()
        if variables:
            broadcast_variables(variables, root_rank=0)


class _VariablesState(ObjectState):
    """An ObjectState that also keeps host copies of variables (``self._variables``)."""

    def __init__(self, variables: Callable[[], list[Any]], **kwargs: Any) -> None:
        self._variables = _Variables(variables)
        self._variables.save()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def save(self) -> None:
        self._variables.save()
        super().save()

    def restore(self) -> None:
        self._variables.restore()
        super().restore()

    def sync(self) -> None:
        self._variables.sync()
        self._variables.save()
        super().sync()


class TensorFlowKerasState(_VariablesState):
    """State of a Keras model and its optimizer (Keras 3 or tf_keras), and of keyword values.

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default: ``model.optimizer``); its slots are part of
            the state once they exist (after a first step).
        backend: accepted for Horovod's TF1 form; only eager execution is supported.
        **kwargs: further values kept as attributes (e.g. ``batch=0, epoch=0``).
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any) -> None:
        if not _eager():
            raise _graph_mode(type(self).__name__)
        self.model = model
        if hasattr(model, "build") and not model.built:
            raise ConfigError("Model must be built first. Run `model.build(input_shape)`. Received: an unbuilt "
                              f"{type(model).__name__}")
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self.backend = backend
        super().__init__(lambda: list(self.model.variables) + optimizer_variables(self.optimizer), **kwargs)


class TensorFlowState(_VariablesState):
    """State of a list of ``tf.Variable`` and of keyword values (eager TensorFlow 2).

    Args:
        variables: the variables (required: TensorFlow 2 has no global collection).
        session: accepted for Horovod's TF1 form; only eager execution is supported.
        **kwargs: further values kept as attributes.
    """

    def __init__(self, variables: Any = None, session: Any = None, **kwargs: Any) -> None:
        if not _eager() or session is not None:
            raise _graph_mode(type(self).__name__)
        if variables is None:
            raise ConfigError("`variables` must be given: eager TensorFlow has no global variables. "
                              "Received: variables=None")
        self.variables = list(variables)
        self.session = None
        super().__init__(lambda: self.variables, **kwargs)


def _lost_membership(exc: BaseException) -> bool:
    """Whether ``exc`` came from the job's membership breaking (a worker failed or left,
    also while the epoch's ring came up: a member that never connects is a
    ``ClusterError`` there), not from the script (ranks that disagree on a collective
    fail alike in every epoch)."""
    failure = _job.job().failure() if _job.is_initialized() else None
    for error in (exc, failure):
        if isinstance(error, (UnmatchedCollectiveError, TensorMismatchError)):
            return False
    if isinstance(exc, (HorovodInternalError, PeerLostError, ReducerClosedError, CollectiveTimeoutError,
                        ClusterError, AuthenticationError)):
        return True
    return failure is not None


_told = False


def _say_if_not_elastic() -> None:
    """Say once why a job that is not elastic will not survive a lost worker."""
    global _told
    if _told or _job.elastic_client() is not None:
        return
    _told = True
    import os

    from ..cluster.mpi_env import spec_from_mpi_env

    how = ("under mpirun the job's processes are fixed (elastic jobs need the ring)"
           if spec_from_mpi_env(os.environ) is not None else "the job was not started with --min-np/--max-np")
    log.warning("hvd.elastic.run: this job is not elastic (%s): a lost worker ends it. Start it with "
                "`hostreduce run -np N --min-np A --max-np B` to go on without lost workers.", how)


def _reset() -> None:
    shutdown()
    init()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``func(state, ...)`` until it returns, across resets.

    Before each try the state is synchronized from rank 0. A collective that fails
    because a worker was lost restores the last commit; a :class:`HostsUpdatedInterrupt`
    keeps the state as it is. Either way the job's ring is formed again with the
    workers that are there, the state's reset callbacks run, and ``func`` starts again.
    Outside an elastic job a failed collective is raised as it is.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        _say_if_not_elastic()
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as e:
                log.info("hvd.elastic: workers wait to join; resetting at this commit")
                skip_sync = e.skip_sync
            except Exception as e:  # noqa: BLE001 - only a broken membership is handled
                if _job.elastic_client() is None or not _lost_membership(e):
                    raise
                log.warning("hvd.elastic: the job lost a worker (%s); restoring the last commit",
                            str(_job.job().failure() if _job.is_initialized() and _job.job().failure() else e)[:300])
                state.restore()
                skip_sync = False
            _reset()
            state.on_reset()

    return wrapper
