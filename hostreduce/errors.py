"""The exception hierarchy of hostreduce.

Every error the library raises on purpose derives from :class:`HostReduceError`, so
callers can catch the whole family at once and still tell the causes apart.
"""
from __future__ import annotations

from typing import Mapping, Sequence

__all__ = [
    "HostReduceError",
    "ConfigError",
    "ClusterError",
    "TensorMismatchError",
    "PeerLostError",
    "AuthenticationError",
    "CollectiveTimeoutError",
    "UnmatchedCollectiveError",
    "JoinedRankError",
    "ReducerClosedError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "SpecError",
    "CheckpointError",
    "InputNotCheckpointable",
    "NotInitializedError",
    "HorovodUnavailableError",
    "WireError",
    "JobFailedError",
    "NonFiniteGradientError",
    "RoleError",
    "RankFailedError",
    "RankTimeoutError",
    "NotByRowsError",
    "UnsupportedCallError",
    "with_framework_type",
]


class HostReduceError(RuntimeError):
    """Base class of every error raised by hostreduce."""

    # The same initializer RuntimeError has, named so that TensorFlow's AutoGraph, which
    # re-raises an error from a converted function (tf_keras's train step) as its own
    # type only when that type's __init__ is Exception's, keeps ours (else StagingError).
    __init__ = Exception.__init__


class ConfigError(HostReduceError, ValueError):
    """A configuration value, argument or environment variable is invalid."""


class ClusterError(ConfigError):
    """The cluster description (``TF_CONFIG``, mpirun environment, arguments) is invalid."""


class TensorMismatchError(HostReduceError):
    """Ranks submitted a collective whose name, shape, dtype or op disagree."""


class PeerLostError(HostReduceError):
    """A peer died or became unreachable while a collective was in flight."""


class AuthenticationError(HostReduceError):
    """A peer failed to prove that it belongs to this job (wrong or missing secret)."""


class CollectiveTimeoutError(HostReduceError, TimeoutError):
    """A collective did not complete within the configured timeout."""


class UnmatchedCollectiveError(CollectiveTimeoutError):
    """Every rank is waiting for a collective that some other rank has not submitted, so
    none can complete (e.g. ranks submitted different names). Raised on every rank as
    soon as that is known, instead of after the timeout."""


class JoinedRankError(HostReduceError):
    """A collective that cannot run while a rank of the job has joined (``join()``, Horovod's
    ``hvd.join()``): only all-reduces (the joined rank contributes zeros) and barriers
    do. Raised on every rank that submitted it, as Horovod refuses broadcasts,
    all-gathers, all-to-alls and reduce-scatters then; the join itself goes on."""


class ReducerClosedError(HostReduceError):
    """The reducer was closed; no further collectives can be submitted."""


class SpecError(HostReduceError, ValueError):
    """An ``EstimatorSpec`` or ``host_call`` is malformed."""


class CheckpointError(HostReduceError):
    """A checkpoint could not be read or written."""


class InputNotCheckpointable(HostReduceError):
    """The input pipeline's position cannot be saved (the reason is the message)."""


class NotInitializedError(HostReduceError, ValueError):
    """A ``hostreduce.horovod`` call that needs the job came before ``init()``."""


class HorovodUnavailableError(ConfigError, ImportError):
    """Horovod (with TensorFlow support) cannot be imported in this environment."""


class WireError(HostReduceError, ValueError):
    """A parameter-server message that does not decode (truncated, sizes that disagree,
    unknown dtype)."""


class JobFailedError(HostReduceError):
    """The job a ps task served ended by a failure (the chief's, or the chief was lost)."""


class NonFiniteGradientError(HostReduceError, ValueError):
    """A gradient pushed to a parameter server holds NaN or Inf and the ps was started to
    refuse them (``nonfinite="refuse"``); nothing of the push (in sync mode, of its step)
    was applied."""


class RoleError(HostReduceError, PermissionError):
    """An authenticated task made a parameter-server call its role does not allow: only
    the chief registers, holds, opens, saves, restores and ends the job, and it saves
    only under the ``model_dir`` it registered, at a step the ps has reached."""


class HorovodInternalError(HostReduceError):
    """A collective of an elastic job failed because the job's membership broke (a
    worker failed or left): ``hostreduce.horovod.elastic.run`` restores the last commit
    and resets (Horovod's ``horovod.common.exceptions.HorovodInternalError``)."""


class HostsUpdatedInterrupt(HostReduceError):
    """Raised on every worker of an elastic job at the same commit when workers wait to
    join: ``hostreduce.horovod.elastic.run`` resets without losing progress (Horovod's
    ``HostsUpdatedInterrupt``). ``skip_sync``: whether the state may skip its broadcast."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the job's workers changed; resetting at this commit")
        self.skip_sync = skip_sync


class UnsupportedCallError(HostReduceError, NotImplementedError):
    """A name or argument combination of a ported API (TF Adapter's ``npu.distribute``,
    HCCL's ops, Horovod's) that hostreduce keeps but cannot run, or that the peer also
    refuses as not implemented; the message says what to use instead."""


class NotByRowsError(HostReduceError):
    """A table's initial value cannot be computed by blocks of rows; it is computed whole
    (``hostreduce.ps_training.initial_rows``, which handles it: never raised to callers)."""


class RankFailedError(HostReduceError, AssertionError):
    """A rank of ``hostreduce.testing.run_ranks`` raised an exception or died; its
    traceback is part of the message. An ``AssertionError`` too, so a test reports it
    as a failure.

    Attributes:
        rank: the rank that failed.
        exc_type: name of the exception type (e.g. ``PeerLostError``), or ``killed`` /
            ``exited`` when the process died without reporting.
        traceback: the rank's formatted traceback ('' when it died without one).
    """

    def __init__(self, message: str, rank: int, exc_type: str, traceback_text: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.traceback = traceback_text


class RankTimeoutError(HostReduceError, AssertionError):
    """``hostreduce.testing.run_ranks``'s timeout elapsed before every rank finished. The
    message shows every thread's stack of each rank that had not finished, taken before
    it was killed.

    Attributes:
        ranks: the ranks that had not finished.
        stacks: those ranks' stacks, by rank.
    """

    def __init__(self, message: str, ranks: Sequence[int], stacks: Mapping[int, str] | None = None) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.stacks = dict(stacks or {})


_framework_classes: dict[tuple[type, type], type] = {}


def with_framework_type(error: HostReduceError, framework_class: type, init: "object" = None) -> HostReduceError:
    """``error`` re-made as an instance of both its own class and ``framework_class``
    (a framework's exception type, e.g. ``tf.errors.FailedPreconditionError``), so a
    script that catches either keeps working. ``init(new)``, when given, initialises
    the framework's part; the message, cause and traceback are ``error``'s.
    """
    key = (type(error), framework_class)
    cls = _framework_classes.get(key)
    if cls is None:
        cls = _framework_classes[key] = type(type(error).__name__, key, {"__module__": type(error).__module__})
    # Allocate with the builtin exception type whose instance layout is the largest (an
    # OSError for a TimeoutError subclass), which the class's layout is.
    layout = max((b for b in cls.__mro__ if b.__module__ == "builtins" and issubclass(b, BaseException)),
                 key=lambda b: b.__basicsize__)
    new = layout.__new__(cls, str(error))
    if init is not None:
        init(new)  # type: ignore[operator]
    Exception.__init__(new, *error.args)
    new.__dict__.update(error.__dict__)
    new.__cause__ = error.__cause__
    new.__traceback__ = error.__traceback__
    return new
