#!/usr/bin/env bash
# Run on a build machine (Debian 12, nvcc present, no GPU needed): builds the
# GPU tests and tools and the four daemons with CUDA and packs them, with
# the shared libraries a GPU machine lacks (Abseil, protobuf, gRPC,
# RocksDB, OpenBLAS...) and MNIST gzipped, into .gpu-bundle/ (git-ignored)
# for tests/gpu/run.sh and tests/gpu/bench.sh on the GPU machine. The
# daemons sit as in build/ (server/, worker/), so deploy/local/cluster.sh
# --bin .gpu-bundle starts a cluster from it. glibc, libstdc++ and the CUDA
# libraries come from the GPU machine itself.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${BUILD_DIR:-$root/build}
cmake -S "$root" -B "$build" -G Ninja -DFULCRUM_CUDA=ON >/dev/null
cmake --build "$build" --target gpu_test fulcrum-compute-bench fulcrum-mlp-step fulcrum-graph-step fulcrum-cuda-selftest \
  fulcrum-coordinator fulcrum-server fulcrum-worker fulcrumctl fulcrum-train-local fulcrum-datagen
out=$root/.gpu-bundle
rm -rf "$out"
mkdir -p "$out/lib" "$out/server" "$out/worker" "$out/data/mnist"
bins=("$build/tests/gpu_test" "$build/tests/bench/fulcrum-compute-bench" "$build/tests/bench/fulcrum-mlp-step"
      "$build/tests/bench/fulcrum-graph-step")
cp "${bins[@]}" "$out/"
daemons=("$build/server/fulcrum-coordinator" "$build/server/fulcrum-server" "$build/server/fulcrumctl")
cp "${daemons[@]}" "$out/server/"
tools=("$build/worker/fulcrum-worker" "$build/worker/fulcrum-train-local" "$build/worker/fulcrum-datagen")
cp "${tools[@]}" "$out/worker/"
bins+=("${daemons[@]}" "${tools[@]}")
data=${FULCRUM_DATA_DIR:-$HOME/.cache/fulcrum/data}
"$root/deploy/local/fetch_data.sh" "$data" mnist >/dev/null
for f in "$data"/mnist/*-ubyte; do gzip -c "$f" >"$out/data/mnist/$(basename "$f").gz"; done
touch "$out/data/mnist/.complete"
for b in "${bins[@]}"; do
  ldd "$b" | awk '/=> \//{print $3}'
done | sort -u | grep -vE '/(libc|libm|libpthread|libdl|librt|libgcc_s|libstdc\+\+|ld-linux[^/]*)\.so|/libcud|/libcublas' |
  while read -r lib; do cp -L "$lib" "$out/lib/"; done
strip --strip-unneeded "$out"/lib/*.so* "$out"/gpu_test "$out"/fulcrum-* "$out"/server/* "$out"/worker/* 2>/dev/null || true
du -sh "$out"
# A carried tree may hold 64 MiB: the bundle travels as one xz archive
# (about 30 MB), which tests/gpu/run.sh and bench.sh unpack when
# .gpu-bundle/ is missing.
tar -C "$root" -cJf "$root/.gpu-bundle.tar.xz" .gpu-bundle
du -sh "$root/.gpu-bundle.tar.xz"
