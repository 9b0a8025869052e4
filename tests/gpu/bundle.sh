#!/usr/bin/env bash
# Run on a build machine (Debian 12, nvcc present, no GPU needed): builds the
# GPU tests and tools with CUDA and packs them, with the shared libraries a
# GPU machine lacks (Abseil, protobuf, gRPC, OpenBLAS...), into .gpu-bundle/
# (git-ignored) for tests/gpu/run.sh on the GPU machine. glibc, libstdc++
# and the CUDA libraries come from the GPU machine itself.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${BUILD_DIR:-$root/build}
cmake -S "$root" -B "$build" -G Ninja -DFULCRUM_CUDA=ON >/dev/null
cmake --build "$build" --target gpu_test fulcrum-compute-bench fulcrum-mlp-step fulcrum-cuda-selftest
out=$root/.gpu-bundle
rm -rf "$out"
mkdir -p "$out/lib"
bins=("$build/tests/gpu_test" "$build/tests/bench/fulcrum-compute-bench" "$build/tests/bench/fulcrum-mlp-step")
cp "${bins[@]}" "$out/"
for b in "${bins[@]}"; do
  ldd "$b" | awk '/=> \//{print $3}'
done | sort -u | grep -vE '/(libc|libm|libpthread|libdl|librt|libgcc_s|libstdc\+\+|ld-linux[^/]*)\.so|/libcud|/libcublas' |
  while read -r lib; do cp -L "$lib" "$out/lib/"; done
strip --strip-unneeded "$out"/lib/*.so* "$out"/gpu_test "$out"/fulcrum-* 2>/dev/null || true
du -sh "$out"
