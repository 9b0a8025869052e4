#!/usr/bin/env bash
# Installs what is missing (Debian packages), builds Fulcrum with CMake and
# Ninja (ccache when present) and runs the whole test suite through ctest.
# Exits non-zero when anything fails. Called by .ci/run.
#
#   tests/run.sh                 build in ./build and run every test
#   FULCRUM_BUILD_DIR=/tmp/b tests/run.sh
#   FULCRUM_CMAKE_ARGS="-DFULCRUM_CUDA=OFF" tests/run.sh
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${FULCRUM_BUILD_DIR:-$root/build}

# shellcheck source=deploy/local/packages.sh
source "$root/deploy/local/packages.sh"
fulcrum_install_packages

export CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=1
echo "== configure ($build)"
# shellcheck disable=SC2086
cmake -S "$root" -B "$build" -G Ninja ${FULCRUM_CMAKE_ARGS:-}
echo "== build"
cmake --build "$build"
echo "== test"
cd "$build"
ctest --output-on-failure -j "$(nproc)" --timeout 900
# libFuzzer targets, a bounded time each (FULCRUM_FUZZ_SECONDS, default 30).
cd "$root"
tests/fuzz/run.sh "$build-fuzz"
