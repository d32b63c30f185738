"""Shared test setup. The repository root is on ``sys.path`` (pyproject's ``pythonpath``),
so the package and the helpers under ``tests/`` import from this source tree, here and
in every rank started from here."""
from __future__ import annotations

# Ranks started by hostreduce.testing fork from one server process that imported
# TensorFlow once, instead of each importing it afresh (seconds of CPU per rank).
from hostreduce.testing import preload

preload(["tensorflow"])
