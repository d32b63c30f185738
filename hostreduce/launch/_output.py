"""What the launcher does with worker output lines: keep TensorFlow's start-up notices out
of the user's way, and remember the line that says why a worker failed.

TensorFlow prints a handful of notices from C++ as it loads (no CUDA driver, ``cuInit``
failed on a machine without a GPU, the CPU instructions it was not built for, oneDNN
numerics). They come from every worker, before Python can configure logging, and
``TF_CPP_MIN_LOG_LEVEL=2`` does not silence all of them (``cuInit`` is logged as an
error). Only these known notices are dropped; every other line, TensorFlow's real errors
included, passes through. ``hostreduce run --verbose`` keeps them all.
"""
from __future__ import annotations

import re

__all__ = ["is_startup_notice", "error_summary"]

# One pattern per notice; each matches the notice's own words, not just its source file.
_NOTICES = re.compile(
    rb"|".join((
        rb"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR",
        rb"cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine",
        rb"cuda_platform\.cc:\d+\] failed call to cuInit",
        rb"cuda_executor\.cc:\d+\] could not open file to read NUMA node",
        rb"Unable to register cu(DNN|FFT|BLAS) factory: Attempting to register factory",
        rb"computation_placer\.cc:\d+\] computation placer already registered",
        rb"TF-TRT Warning: Could not find TensorRT",
        rb"oneDNN custom operations are on\.",
        rb"This TensorFlow binary is optimized to use available CPU instructions",
        rb"^To enable the following instructions: .* rebuild TensorFlow with the appropriate compiler flags\.",
        rb"cpu_feature_guard\.cc:\d+\] ",
    ))
)

# The last line of a Python traceback: "pkg.module.SomeError: message" (or a bare name).
_EXCEPTION_LINE = re.compile(rb"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit))(: .*)?$")


def is_startup_notice(line: bytes) -> bool:
    """Whether ``line`` is one of TensorFlow's known start-up notices."""
    return _NOTICES.search(line) is not None


def error_summary(line: bytes) -> str | None:
    """The exception a traceback's last line names (``"ConfigError: ..."``), else None."""
    match = _EXCEPTION_LINE.match(line.rstrip(b"\r\n"))
    if match is None:
        return None
    return line.rstrip(b"\r\n").decode("utf-8", "replace")
