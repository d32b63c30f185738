#!/usr/bin/env bash
# The main job: a 2-worker MNIST training run over hostreduce's gRPC ring, started by
# `hostreduce run -np 2`. Prints progress and the test accuracy, and writes one Chrome
# trace per worker under timeline/. Extra arguments go to examples/mnist/train.py
# (for example --data-dir DIR with a local mnist.npz). TensorFlow's start-up notices are
# left out of the output by the launcher (hostreduce run --verbose keeps them).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
exec .venv/bin/hostreduce run -np 2 -- .venv/bin/python examples/mnist/train.py --timeline-dir timeline "$@"
