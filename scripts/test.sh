#!/usr/bin/env bash
# Run hostreduce's whole test suite on a fresh machine: set up the environment, build
# Horovod for its reducer's tests (those tests say why they skip if the build fails;
# nothing else depends on Horovod), then run pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
if ! PYTHON=.venv/bin/python bash scripts/build_horovod.sh; then
    echo "test: Horovod could not be built here; its reducer's tests will skip and say why" >&2
fi
exec .venv/bin/python -m pytest -ra --durations=25 "$@"
