#!/usr/bin/env bash
# The GPU tests in one command, on a GPU machine that has only the CUDA
# toolkit, cmake, ninja and python with torch, in four parts, most wanted
# first (a short lease runs the first ones):
#   tests     gpu_test (every kernel and model against the CPU backend),
#             prebuilt by tests/gpu/bundle.sh into .gpu-bundle/; where torch
#             is installed, one MLP step (tests/gpu/torch_check.py) and
#             one step of each click-through example and every graph op
#             (tests/gpu/graph_torch_check.py) against torch autograd;
#   ctr       click-through models' AUC and DLRM's throughput on the GPU
#             against plain torch (tests/gpu/ctr.sh);
#   bench     the compute benchmark in fp32, bf16 and fp16, whose torch
#             column times the same steps in torch (tests/bench/torch_step.py);
#   selftest  cuda/ built from the CUDA toolkit alone, and its self-test.
# Usage: tests/gpu/run.sh [PART ...] (default: all four, in that order).
# Results go to stdout and, when $OUT is set, to $OUT/gpu-results.txt.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root" || exit 1
bundle=$root/.gpu-bundle
[[ ! -d $bundle && -f $root/.gpu-bundle.tar.xz ]] && tar -C "$root" -xJf "$root/.gpu-bundle.tar.xz"
log=${OUT:-/tmp}/gpu-results.txt
exec > >(tee "$log") 2>&1
status=0
step() { echo; echo "== $*"; }
fail() { echo "FAILED: $*"; status=1; }

parts=("$@")
((${#parts[@]})) || parts=(tests ctr bench selftest)
for part in "${parts[@]}"; do
  case $part in tests | ctr | bench | selftest) ;; *) echo "run.sh: unknown part $part" >&2; exit 2 ;; esac
done
have_torch=0
command -v python3 >/dev/null && python3 -c "import torch" 2>/dev/null && have_torch=1
export LD_LIBRARY_PATH=$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# gpu_test reads the example specs, and the compute bench's torch column
# tests/bench/torch_step.py, from this tree.
export FULCRUM_SOURCE_DIR=$root

part_tests() {
  step "gpu_test"
  timeout 240 "$bundle/gpu_test" --durations yes || fail "gpu_test"
  if ((!have_torch)); then
    echo "SKIPPED: torch not installed: no torch cross-check"
    return
  fi
  step "one MLP step against torch autograd"
  timeout 60 python3 tests/gpu/torch_check.py --tool "$bundle/fulcrum-mlp-step" || fail "torch gradient check"
  step "DLRM, Wide & Deep, DeepFM and every graph op against torch autograd"
  timeout 120 python3 tests/gpu/graph_torch_check.py --tool "$bundle/fulcrum-graph-step" \
    --spec deploy/examples/ctr-dlrm.yaml --spec deploy/examples/ctr-wide-deep.yaml \
    --spec deploy/examples/ctr-deepfm.yaml --spec tests/gpu/graph_all_ops.yaml --spec tests/gpu/graph_mf.yaml ||
    fail "graph torch check"
}

part_ctr() {
  step "click-through models on the GPU (tests/gpu/ctr.sh)"
  timeout 300 tests/gpu/ctr.sh --bin "$bundle" || fail "ctr.sh"
}

part_bench() {
  for p in fp32 bf16 fp16; do
    step "fulcrum-compute-bench --device=cuda:0 --precision=$p"
    timeout 90 "$bundle/fulcrum-compute-bench" --device=cuda:0 --precision="$p" || fail "compute bench $p"
  done
}

part_selftest() {
  step "cuda/ from the CUDA toolkit alone"
  if timeout 240 bash -c 'cmake -S cuda -B build-cuda -G Ninja >/dev/null && cmake --build build-cuda >/dev/null'; then
    build-cuda/fulcrum-cuda-selftest || fail "cuda/ self-test"
  else
    fail "cuda/ build from the CUDA toolkit alone"
  fi
}

step "GPU"
nvidia-smi -L || echo "(nvidia-smi unavailable)"
[[ -x $bundle/gpu_test ]] ||
  fail "$bundle/gpu_test missing: run tests/gpu/bundle.sh on the build machine and carry .gpu-bundle"
for part in "${parts[@]}"; do
  case $part in
    selftest) part_selftest ;;  # needs only the toolkit, not the bundle
    *) [[ -x $bundle/gpu_test ]] || continue ;;&
    tests) part_tests ;;
    ctr) part_ctr ;;
    bench) part_bench ;;
  esac
done
exit $status
