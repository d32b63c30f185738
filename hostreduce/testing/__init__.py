"""Helpers for testing code that runs as several ranks of one job."""
from __future__ import annotations

from .preloading import preload
from .spawn import RankFailedError, RankOutcome, RankTimeoutError, run_ranks, run_ranks_allow_failure

__all__ = ["run_ranks", "preload", "run_ranks_allow_failure", "RankFailedError", "RankTimeoutError", "RankOutcome"]
