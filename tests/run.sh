#!/usr/bin/env bash
# Installs what is missing (Debian packages), builds Fulcrum with CMake and
# Ninja (ccache when present) and runs the whole test suite through ctest.
# Exits non-zero when anything fails. Called by .ci/run.
#
#   tests/run.sh                 build in ./build and run every test, fuzz each
#                                target, then build again with ASan + UBSan in
#                                ./build-asan and run the in-process tests there
#                                (ctest -LE e2e); FULCRUM_NO_SANITIZE=1 skips that
#   tests/run.sh --sanitize      only the ASan + UBSan build, every test
#                                (no CUDA, no fuzzing; benchmarks run as smoke tests)
#   FULCRUM_BUILD_DIR=/tmp/b tests/run.sh
#   FULCRUM_CMAKE_ARGS="-DFULCRUM_CUDA=OFF" tests/run.sh
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
sanitize=""
for arg in "$@"; do
  case "$arg" in
    --sanitize|--sanitize=address) sanitize=address ;;
    *) echo "tests/run.sh: unknown option '$arg' (--sanitize)" >&2; exit 2 ;;
  esac
done
sanitizer_env() {
  # Leaks are reported by LeakSanitizer at exit; gRPC's and protobuf's
  # process-lifetime singletons are not leaks (tests/lsan.supp).
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
  export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$root/tests/lsan.supp:print_suppressions=0}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
}
sanitize_args="-DFULCRUM_SANITIZE=address -DFULCRUM_CUDA=OFF"
if [[ -n "$sanitize" ]]; then
  build=${FULCRUM_BUILD_DIR:-$root/build-asan}
  FULCRUM_CMAKE_ARGS="${FULCRUM_CMAKE_ARGS:-} $sanitize_args"
  sanitizer_env
else
  build=${FULCRUM_BUILD_DIR:-$root/build}
fi

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
if [[ -z "$sanitize" ]]; then
  cd "$root"
  tests/fuzz/run.sh "$build-fuzz"
fi
# The in-process tests again under ASan + UBSan (the process-level e2e tests,
# label e2e, run their binaries unsanitized above; tests/run.sh --sanitize
# runs them sanitized too).
if [[ -z "$sanitize" && ${FULCRUM_NO_SANITIZE:-0} != 1 ]]; then
  cd "$root"
  echo "== ASan + UBSan build ($build-asan)"
  # shellcheck disable=SC2086
  cmake -S "$root" -B "$build-asan" -G Ninja $sanitize_args ${FULCRUM_CMAKE_ARGS:-} >/dev/null
  cmake --build "$build-asan"
  echo "== test under ASan + UBSan (ctest -LE e2e)"
  sanitizer_env
  cd "$build-asan"
  ctest --output-on-failure -j "$(nproc)" --timeout 900 -LE e2e
fi
