#!/usr/bin/env bash
# End-to-end training throughput of the MNIST MLP (deploy/examples/mnist-mlp.yaml,
# one epoch) on a local cluster, against the same model trained in one process
# with no parameter-server network (fulcrum-train-local), in the same run:
#   baseline   one process, LocalPsClient
#   1x1        coordinator + 1 server + 1 worker processes over 127.0.0.1
#   2x2        2 servers + 2 workers (both workers on this host's cores)
# Every trainer uses the same compute settings (OPENBLAS_NUM_THREADS=1, the
# backend's threads = cores / workers on the host).
#
#   tests/bench/cluster_bench.sh [BUILD_DIR]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${1:-$root/build}
data=${FULCRUM_DATA_DIR:-$HOME/.cache/fulcrum/data}
tmp=$(mktemp -d)
port=7170
cleanup() {
  for c in "$tmp"/c*; do [[ -d "$c" ]] && "$root/deploy/local/cluster.sh" stop --dir "$c" >/dev/null; done
  rm -rf "$tmp"
}
trap cleanup EXIT
"$root/deploy/local/fetch_data.sh" "$data" mnist >/dev/null
spec=$root/deploy/examples/mnist-mlp.yaml
sed 's/^epochs: .*/epochs: 1/; s/^num_workers: .*/num_workers: 1/; s/^name: .*/name: bench-a/' "$spec" >"$tmp/a.yaml"
sed 's/^epochs: .*/epochs: 1/; s/^num_workers: .*/num_workers: 2/; s/^name: .*/name: bench-b/' "$spec" >"$tmp/b.yaml"

export OPENBLAS_NUM_THREADS=1
base=$("$build/worker/fulcrum-train-local" --spec="$tmp/a.yaml" --device=cpu --data_dir="$data" |
  sed -n 's/^samples_per_second=\([0-9]*\).*/\1/p')

run() {  # run NAME SERVERS WORKERS SPEC -> samples/s of the epoch, all workers together
  local name=$1 servers=$2 workers=$3 spec=$4
  "$root/deploy/local/cluster.sh" start --servers "$servers" --workers "$workers" --dir "$tmp/c$name" \
    --port "$port" --bin "$build" --data "$data" >/dev/null
  local ctl=("$build/server/fulcrumctl" "--coordinator=127.0.0.1:$port")
  "${ctl[@]}" submit -f "$spec" >/dev/null
  local id
  id=$("${ctl[@]}" list | awk '{print $1}' | head -1)
  "${ctl[@]}" --output=json status "$id" |
    python3 -c 'import json,sys; print(round(json.load(sys.stdin)["status"]["epochs"][0]["samples_per_second"]))'
  "$root/deploy/local/cluster.sh" stop --dir "$tmp/c$name" >/dev/null
  port=$((port + 10))
}
one=$(run 1 1 1 "$tmp/a.yaml")
two=$(run 2 2 2 "$tmp/b.yaml")
echo "MNIST MLP 784-256-10, batch 32 per worker, 1 epoch, $(nproc) cores"
printf '%-44s %10s %8s\n' "setup" "samples/s" "ratio"
printf '%-44s %10s %8s\n' "one process, no PS network (baseline)" "$base" "1.00"
printf '%-44s %10s %8s\n' "cluster: 1 server + 1 worker" "$one" "$(python3 -c "print(f'{$one/$base:.2f}')")"
printf '%-44s %10s %8s\n' "cluster: 2 servers + 2 workers" "$two" "$(python3 -c "print(f'{$two/$base:.2f}')")"
