"""Shared test setup: make the package importable from the source tree."""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Ranks started by hostreduce.testing fork from one server process that imported
# TensorFlow once, instead of each importing it afresh (seconds of CPU per rank).
from hostreduce.testing import preload  # noqa: E402

preload(["tensorflow"])
