"""Helpers for testing code that runs as several ranks of one job."""
from __future__ import annotations

from .spawn import RankFailedError, RankOutcome, RankTimeoutError, run_ranks, run_ranks_allow_failure

__all__ = ["run_ranks", "run_ranks_allow_failure", "RankFailedError", "RankTimeoutError", "RankOutcome"]
