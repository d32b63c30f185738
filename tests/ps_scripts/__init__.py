"""Helpers and scripts of the tests in ``tests/`` (importable as ``tests.ps_scripts``)."""
