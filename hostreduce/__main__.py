"""``python -m hostreduce``: the same command line as the ``hostreduce`` program."""
from __future__ import annotations

import sys

from .launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
