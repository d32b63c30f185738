"""Local job launcher: start N workers of one data-parallel job on this host."""
from __future__ import annotations

from .runner import free_ports, run_workers, tf_config

__all__ = ["run_workers", "free_ports", "tf_config"]
