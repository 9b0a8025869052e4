#!/usr/bin/env bash
# The GPU tests in one command, on a GPU machine that has only the CUDA
# toolkit, cmake, ninja and python with torch:
#   1. builds cuda/ from the CUDA toolkit alone and runs its self-test;
#   2. runs gpu_test (every kernel and model against the CPU backend) and
#      the compute benchmark, prebuilt by tests/gpu/bundle.sh into .gpu-bundle/;
#   3. where torch is installed, compares one MLP step's gradients with
#      torch autograd (tests/gpu/torch_check.py); the compute benchmark's
#      torch column times the same steps in torch (tests/bench/torch_step.py).
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

step "GPU"
nvidia-smi -L || echo "(nvidia-smi unavailable)"

step "cuda/ from the CUDA toolkit alone"
if cmake -S cuda -B build-cuda -G Ninja >/dev/null && cmake --build build-cuda >/dev/null; then
  build-cuda/fulcrum-cuda-selftest || fail "cuda/ self-test"
else
  fail "cuda/ build from the CUDA toolkit alone"
fi

if [[ -x $bundle/gpu_test ]]; then
  export LD_LIBRARY_PATH=$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  step "gpu_test"
  "$bundle/gpu_test" --durations yes || fail "gpu_test"
  if command -v python3 >/dev/null && python3 -c "import torch" 2>/dev/null; then
    step "one MLP step against torch autograd"
    python3 tests/gpu/torch_check.py --tool "$bundle/fulcrum-mlp-step" || fail "torch gradient check"
    step "DLRM, Wide & Deep, DeepFM and every graph op against torch autograd"
    python3 tests/gpu/graph_torch_check.py --tool "$bundle/fulcrum-graph-step" \
      --spec deploy/examples/ctr-dlrm.yaml --spec deploy/examples/ctr-wide-deep.yaml \
      --spec deploy/examples/ctr-deepfm.yaml --spec tests/gpu/graph_all_ops.yaml || fail "graph torch check"
  else
    echo "SKIPPED: torch not installed: no torch cross-check"
  fi
  export FULCRUM_SOURCE_DIR=$root  # the compute bench's torch column finds tests/bench/torch_step.py here
  for p in fp32 bf16 fp16; do
    step "fulcrum-compute-bench --device=cuda:0 --precision=$p"
    "$bundle/fulcrum-compute-bench" --device=cuda:0 --precision=$p || fail "compute bench $p"
  done
else
  fail "$bundle/gpu_test missing: run tests/gpu/bundle.sh on the build machine and carry .gpu-bundle"
fi
exit $status
