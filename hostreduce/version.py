"""The release of hostreduce (kept equal to ``version`` in pyproject.toml)."""
__version__ = "0.1.0"
