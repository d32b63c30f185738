#!/usr/bin/env bash
# Build and install Horovod 0.28.1 (TensorFlow + MPI + Gloo) into a virtual environment,
# for hostreduce's optional "horovod" reducer.
#
# Horovod 0.28.1 does not build against recent TensorFlow wheels as published: its XLA
# ops include XLA headers under old paths, and TensorFlow's headers need highwayhash and
# farmhash, which the wheel lacks. This script installs those headers and Debian's
# Open MPI 4.1 (Horovod links against it), drops the optional XLA ops from the build and
# installs the patched sdist.
#
# Usage:  scripts/build_horovod.sh
# Environment:
#   PYTHON              the target environment's python   (default: .venv/bin/python)
#   HOROVOD_VERSION     the Horovod release to build       (default: 0.28.1)
#   HOROVOD_BUILD_DIR   where to download and unpack it    (default: build/horovod)
#   HOROVOD_BUILD_LOG   the build log                      (default: $HOROVOD_BUILD_DIR/build.log)
#   MAKEFLAGS / HOROVOD_BUILD_JOBS   parallel compile jobs (default: number of cores)
#
# Idempotent: exits at once when `import horovod.tensorflow` already works.
# Exit status: 0 when Horovod imports afterwards, non-zero (with the reason) otherwise.
set -euo pipefail

PYTHON="${PYTHON:-.venv/bin/python}"
VERSION="${HOROVOD_VERSION:-0.28.1}"
BUILD_DIR="${HOROVOD_BUILD_DIR:-build/horovod}"
LOG="${HOROVOD_BUILD_LOG:-$BUILD_DIR/build.log}"

die() {
    echo "build_horovod: FAILED: $*" >&2
    [[ -f "$LOG" ]] && echo "build_horovod: see the log: $LOG (last lines below)" >&2 && tail -n 25 "$LOG" >&2
    exit 1
}

if [[ ! -x "$PYTHON" ]]; then
    die "python '$PYTHON' not found or not executable; set PYTHON to the target environment's python"
fi

if "$PYTHON" -c "import horovod.tensorflow" >/dev/null 2>&1; then
    echo "build_horovod: horovod.tensorflow already importable with $PYTHON; nothing to do"
    exit 0
fi

mkdir -p "$BUILD_DIR"
BUILD_DIR="$(cd "$BUILD_DIR" && pwd)"
LOG="$(mkdir -p "$(dirname "$LOG")" && cd "$(dirname "$LOG")" && pwd)/$(basename "$LOG")"
: >"$LOG"
echo "build_horovod: building horovod $VERSION for $PYTHON in $BUILD_DIR (log: $LOG)"
start=$SECONDS

# 1. System packages: headers TensorFlow's wheel lacks, and the Open MPI Horovod links to.
APT_PACKAGES=(libhighwayhash-dev libfarmhash-dev libopenmpi-dev openmpi-bin cmake g++ make)
if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "build_horovod: installing ${APT_PACKAGES[*]} with apt-get"
    {
        apt-get update &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${APT_PACKAGES[@]}"
    } >>"$LOG" 2>&1 || die "apt-get install of ${APT_PACKAGES[*]} failed"
else
    echo "build_horovod: not root (or no apt-get): skipping system packages;" \
        "make sure ${APT_PACKAGES[*]} are installed"
fi
for header in /usr/include/highwayhash/highwayhash.h /usr/include/farmhash.h; do
    [[ -f "$header" ]] || die "missing $header (install libhighwayhash-dev libfarmhash-dev)"
done
command -v cmake >/dev/null 2>&1 || die "cmake not found (apt-get install cmake)"

# 2. Python build dependencies (TensorFlow itself must already be installed).
"$PYTHON" -c "import tensorflow" >>"$LOG" 2>&1 ||
    die "TensorFlow is not importable with $PYTHON; install tensorflow (or tensorflow-cpu) first"
echo "build_horovod: installing Python build dependencies"
"$PYTHON" -m pip install "setuptools>=61" wheel packaging cloudpickle psutil pyyaml >>"$LOG" 2>&1 ||
    die "pip install of the build dependencies failed"

# 3. Source: the sdist, patched so that the optional XLA ops are not compiled.
SRC="$BUILD_DIR/horovod-$VERSION"
if [[ ! -d "$SRC" ]]; then
    echo "build_horovod: downloading the horovod $VERSION sdist"
    "$PYTHON" -m pip download --no-deps --no-binary :all: -d "$BUILD_DIR" "horovod==$VERSION" >>"$LOG" 2>&1 ||
        die "pip download of horovod==$VERSION failed"
    tar -xzf "$BUILD_DIR/horovod-$VERSION.tar.gz" -C "$BUILD_DIR" || die "could not unpack the sdist"
fi
CMAKELISTS="$SRC/horovod/tensorflow/CMakeLists.txt"
[[ -f "$CMAKELISTS" ]] || die "$CMAKELISTS not found in the sdist"
sed -i '/xla_mpi_ops\.cc/d' "$CMAKELISTS"
if grep -q 'xla_mpi_ops' "$CMAKELISTS"; then
    die "could not remove xla_mpi_ops.cc from $CMAKELISTS"
fi

# 4. Build and install against Debian's Open MPI (mpicc/mpicxx from /usr/bin first in PATH).
echo "build_horovod: compiling (a few minutes)"
export PATH="/usr/bin:$PATH"
export MAKEFLAGS="${MAKEFLAGS:--j${HOROVOD_BUILD_JOBS:-$(nproc)}}"
HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    "$PYTHON" -m pip install --no-build-isolation --no-cache-dir -v "$SRC" >>"$LOG" 2>&1 ||
    die "compiling horovod $VERSION failed"

# 5. Verify.
if ! "$PYTHON" -c "import horovod.tensorflow" >>"$LOG" 2>&1; then
    die "horovod installed but 'import horovod.tensorflow' fails"
fi
echo "build_horovod: OK: horovod $VERSION installed in $(( SECONDS - start )) s"
