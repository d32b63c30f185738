"""Local job launcher: start N workers of one data-parallel job on this host."""
from __future__ import annotations

from ..processes import free_ports, tf_config
from .runner import run_workers

__all__ = ["run_workers", "free_ports", "tf_config"]
