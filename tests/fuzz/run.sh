#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan, a separate build tree)
# and runs each for a bounded time from its seed corpus in tests/fuzz/corpus.
# Any crash, sanitizer report, leak, timeout (10 s per input) or input over
# 2 GiB of RSS fails the run; the input is kept and its path printed:
# reproduce with `BUILD/tests/fuzz/fuzz_NAME INPUT`, fix, and add the input
# to tests/fuzz/corpus/NAME.
#
#   tests/fuzz/run.sh [BUILD_DIR]          (default build-fuzz)
#   FULCRUM_FUZZ_SECONDS=300 tests/fuzz/run.sh     (default 30 per target)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${1:-$root/build-fuzz}
seconds=${FULCRUM_FUZZ_SECONDS:-30}
targets=(job_spec readers ps_request checkpoint coordinator)
export CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=1
echo "== fuzz: configure and build ($build, clang-14, ASan + UBSan + libFuzzer)"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_C_COMPILER=clang-14 \
  -DFULCRUM_FUZZ=ON -DFULCRUM_CUDA=OFF -DFULCRUM_BUILD_TESTS=OFF >/dev/null
cmake --build "$build" --target "${targets[@]/#/fuzz_}"
work=$(mktemp -d /tmp/fulcrum-fuzz-XXXXXX)
failed=()
for t in "${targets[@]}"; do
  mkdir -p "$work/$t"
  echo "== fuzz_$t: ${seconds}s from $(find "$root/tests/fuzz/corpus/$t" -type f | wc -l) seeds"
  # The coordinator's inputs are sequences of calls, a few bytes each: let
  # them be long from the start (libFuzzer otherwise grows its length cap
  # slowly, and this target runs ~40 inputs/s).
  extra=(-max_len=65536)
  if [[ $t == coordinator ]]; then extra=(-len_control=0 -max_len=1024); fi
  rc=0
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$build/tests/fuzz/fuzz_$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 "${extra[@]}" \
    -print_final_stats=1 -artifact_prefix="$work/$t-" "$work/$t" "$root/tests/fuzz/corpus/$t" \
    >"$work/$t.log" 2>&1 || rc=$?
  grep -E '^stat::number_of_executed_units|^#[0-9]+ *DONE' "$work/$t.log" | tail -n 2 || true
  if ((rc != 0)); then
    failed+=("$t")
    echo "FAIL: fuzz_$t exited with $rc; its report:"
    grep -v 'libprotobuf' "$work/$t.log" | tail -n 60
    find "$work" -maxdepth 1 -name "$t-*" -printf "  input: %p\n"
  fi
done
if ((${#failed[@]})); then
  echo "== fuzz: ${failed[*]} failed (inputs and logs kept in $work)"
  exit 1
fi
echo "== fuzz: all ${#targets[@]} targets ran ${seconds}s each without a finding"
rm -rf "$work"
