#!/usr/bin/env bash
# The kill loop with fingerprints, for as long and as often as asked: runs
# tests/integration/soak_test (a cluster.sh cluster; a random server, worker
# or the coordinator killed with kill -9 every 3-6 s while MNIST MLP jobs
# train, BSP and ASP in turn) RUNS times with SECONDS of kills each, jobs of
# EPOCHS epochs, and reports per run the seed, the jobs, how many BSP jobs
# ended bit-identical to an undisturbed run of the same spec, the kills (and
# of them the targeted coordinator kills: near an epoch's end, and while a
# killed worker's replacement resumes) and the rollbacks. Exits non-zero when
# any run failed.
#
#   tests/bench/kill_loop.sh [--runs 3] [--seconds 180] [--epochs 2] [--build build]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
runs=3 seconds=180 epochs=2 build="$root/build"
while (($#)); do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --epochs) epochs=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    *) echo "kill_loop.sh: unknown option '$1' (--runs N --seconds S --epochs E --build DIR)" >&2; exit 2 ;;
  esac
done
test -x "$build/tests/soak_test" || { echo "kill_loop.sh: $build/tests/soak_test is not built" >&2; exit 2; }
echo "kill loop: $runs runs of $seconds s of kills, $epochs epochs a job, $(nproc) cores, commit $(git -C "$root" rev-parse --short HEAD)"
echo "| run | seed | result | jobs | BSP jobs bit-identical | kills | targeted | rollbacks | wall s |"
echo "|---|---|---|---|---|---|---|---|---|"
failed=0
for ((i = 1; i <= runs; i++)); do
  log=$(mktemp /tmp/fulcrum-kill-loop.XXXXXX)
  start=$(date +%s)
  if FULCRUM_SOAK_SECONDS=$seconds FULCRUM_SOAK_EPOCHS=$epochs "$build/tests/soak_test" >"$log" 2>&1; then result=passed; else result=FAILED; failed=1; fi
  wall=$(($(date +%s) - start))
  # A figure the log lacks (the run failed before printing it) reads '?'.
  field() { grep -aoE "$1" "$log" | sed -n 1p | sed -E "$2" || true; }
  seed=$(field 'soak seed [0-9]+' 's/soak seed //')
  jobs=$(field 'soak summary: jobs=[0-9]+' 's/.*jobs=//')
  same=$(field 'bsp_identical=[0-9]+' 's/.*=//')
  kills=$(field 'kills=[0-9]+' 's/.*=//')
  targeted=$(field 'targeted=[0-9]+' 's/.*=//')
  rollbacks=$(field 'rollbacks=[0-9]+' 's/.*=//')
  echo "| $i | ${seed:-?} | $result | ${jobs:-?} | ${same:-?} | ${kills:-?} | ${targeted:-?} | ${rollbacks:-?} | $wall |"
  if [[ $result == FAILED ]]; then
    echo "  log: $log"
    grep -aE 'FAILED|with expansion|==' "$log" | head -8 | sed 's/^/    /'
  else
    rm -f "$log"
  fi
done
exit $failed
