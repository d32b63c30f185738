#!/usr/bin/env bash
# Run one of Horovod's own TensorFlow test files on hostreduce, on 2 workers, with only an
# import alias (sitecustomize.py beside this script): the measure of hostreduce.horovod.
#
# Usage:  scripts/horovod_tests/run.sh HOROVOD_SRC FILE ENGINE [pytest args...]
#   HOROVOD_SRC  a checkout of Horovod's source at the release to compare with (v0.28.1);
#                its test/parallel/FILE is run (nothing there is modified)
#   FILE         e.g. test_tensorflow.py, test_tensorflow_process_sets.py
#   ENGINE       ring (hostreduce run -np 2, TF_CONFIG), mpi (mpirun, the MPI engine) or
#                horovod (mpirun, Horovod's core ops)
# Environment: PYTHON (default .venv/bin/python), LOGDIR (default build/horovod_tests),
#   HOSTREDUCE_TIMEOUT_S (default 15: a rank-divergent failure ends sooner).
# Writes LOGDIR/FILE.ENGINE.RANK.log per rank and prints each rank's pytest summary; the
# failing subtests with their first error: python scripts/horovod_tests/failures.py LOG
# Needs pytest's plugins Horovod's tests import: mock, parameterized, cloudpickle.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
SRC="$(cd "$1" && pwd)"; FILE="$2"; ENGINE="$3"; shift 3
PYTHON="${PYTHON:-.venv/bin/python}"
[[ "$PYTHON" = /* ]] || PYTHON="$ROOT/$PYTHON"   # absolute, keeping the venv's symlink
LOGDIR="$(mkdir -p "${LOGDIR:-$ROOT/build/horovod_tests}" && cd "${LOGDIR:-$ROOT/build/horovod_tests}" && pwd)"
export PYTHONPATH="$HERE:$ROOT" TF_CPP_MIN_LOG_LEVEL=2 HOSTREDUCE_TIMEOUT_S="${HOSTREDUCE_TIMEOUT_S:-15}"
unset TF_CONFIG HOSTREDUCE_REDUCER
LOG="$LOGDIR/$FILE.$ENGINE"
cd "$SRC/test/parallel"
case "$ENGINE" in
  ring)
    "$PYTHON" -m hostreduce run -np 2 --timeout 3000 -- bash -c \
      "\"$PYTHON\" -m pytest -q -p no:cacheprovider $FILE -rfE $* > $LOG.\$HOROVOD_RANK.log 2>&1; true" ;;
  mpi|horovod)
    mpirun --allow-run-as-root --oversubscribe -np 2 -x PYTHONPATH -x TF_CPP_MIN_LOG_LEVEL -x HOSTREDUCE_TIMEOUT_S \
      -x HOSTREDUCE_REDUCER="$ENGINE" bash -c \
      "\"$PYTHON\" -m pytest -q -p no:cacheprovider $FILE -rfE $* > $LOG.\$OMPI_COMM_WORLD_RANK.log 2>&1; true" ;;
  *) echo "ENGINE must be ring, mpi or horovod. Received: $ENGINE" >&2; exit 2 ;;
esac
for r in 0 1; do echo "rank $r: $(tail -n 1 "$LOG.$r.log")"; done
