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
    "ReducerClosedError",
    "SpecError",
    "CheckpointError",
    "InputNotCheckpointable",
    "NotInitializedError",
    "HorovodUnavailableError",
    "NotSupportedError",
    "WireError",
    "JobFailedError",
    "RankFailedError",
    "RankTimeoutError",
    "NotByRowsError",
]


class HostReduceError(RuntimeError):
    """Base class of every error raised by hostreduce."""


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


class NotSupportedError(HostReduceError, NotImplementedError):
    """A Horovod feature hostreduce does not provide (yet); the message names what to use."""


class WireError(HostReduceError, ValueError):
    """A parameter-server message that does not decode (truncated, sizes that disagree,
    unknown dtype)."""


class JobFailedError(HostReduceError):
    """The job a ps task served ended by a failure (the chief's, or the chief was lost)."""


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
