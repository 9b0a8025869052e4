#!/usr/bin/env bash
# End-to-end training throughput of the MNIST MLP (deploy/examples/mnist-mlp.yaml)
# on a local cluster, against the same model trained in one process with no
# parameter-server network (fulcrum-train-local), in the same run:
#   baseline   one process, LocalPsClient (run three times: start, midway, end)
#   1x1        coordinator + 1 server + 1 worker processes over 127.0.0.1
#   2x2        2 servers + 2 workers (both workers on this host's cores)
# each under BSP (the example's model) and under SSP with bound 1 (the worker
# sends the next step's pull when a step starts: under SSP(1) the server
# answers it at once and the push completes in the background, under BSP the
# server holds it until the step is applied);
# clusters run with plaintext gRPC (--insecure) and with mutual TLS (the
# local cluster's default), and SSP once more with bf16 on the wire; each
# over gRPC alone (cluster.sh --no-shared-memory, as between hosts) and with
# shared memory between the worker and the servers on this host (the local
# cluster's default).
# Every trainer uses the same compute settings: one compute thread (the
# local cluster's default, deploy/local/cluster.sh). Each figure is the best
# of EPOCHS epochs (default 3) of one run, as this machine's speed swings by
# +-20% from one minute to the next. BATCH (default 32, the example's) sets
# the batch size per worker for every row, baseline included: the bytes on
# the wire per step stay the same while the compute per step grows with it.
#
#   [BATCH=128] [EPOCHS=3] tests/bench/cluster_bench.sh [BUILD_DIR]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${1:-$root/build}
data=${FULCRUM_DATA_DIR:-$HOME/.cache/fulcrum/data}
epochs=${EPOCHS:-3}
batch=${BATCH:-32}
[[ "$batch" =~ ^[1-9][0-9]*$ ]] || { echo "cluster_bench: BATCH must be a positive integer, got '$batch'" >&2; exit 2; }
tmp=$(mktemp -d)
cleanup() {
  for c in "$tmp"/c*; do [[ -d "$c" ]] && "$root/deploy/local/cluster.sh" stop --dir "$c" >/dev/null; done
  [[ -n "${KEEP:-}" ]] || rm -rf "$tmp"
}
trap cleanup EXIT
"$root/deploy/local/fetch_data.sh" "$data" mnist >/dev/null
spec=$root/deploy/examples/mnist-mlp.yaml
make_spec() {  # make_spec NAME WORKERS MODEL [STALENESS [WIRE_DTYPE]]
  local extra=""
  [[ -n "${4:-}" ]] && extra="\\n  staleness: $4"
  sed "s/^epochs: .*/epochs: $epochs/; s/^batch_size: .*/batch_size: $batch/; s/^num_workers: .*/num_workers: $2/; s/^name: .*/name: $1/; s/^  model: bsp\$/  model: $3$extra/" \
    "$spec" >"$tmp/$1.yaml"
  grep -q "^  model: $3\$" "$tmp/$1.yaml" || { echo "cluster_bench: no '  model: bsp' line in $spec" >&2; exit 1; }
  grep -q "^batch_size: $batch\$" "$tmp/$1.yaml" || { echo "cluster_bench: no 'batch_size:' line in $spec" >&2; exit 1; }
  [[ -n "${5:-}" ]] && echo "wire_dtype: $5" >>"$tmp/$1.yaml"
  return 0
}
make_spec bsp1 1 bsp
make_spec bsp2 2 bsp
make_spec ssp1 1 ssp 1
make_spec ssp1bf 1 ssp 1 bf16

export OPENBLAS_NUM_THREADS=1
local_run() {  # local_run SPEC -> best samples/s over the epochs
  "$build/worker/fulcrum-train-local" --spec="$1" --device=cpu --cpu_threads=1 --data_dir="$data" 2>/dev/null |
    sed -n 's/^epoch [0-9]*: \([0-9]*\) samples.*/\1/p' | sort -n | tail -1
}

# cluster_run PORT SERVERS WORKERS SPEC tls|plain grpc|shm -> best
# samples/s over the epochs, all workers together. tls is the local
# cluster's default (mutual TLS and a token); plain starts it with
# --insecure. grpc sends pushes and pulls over gRPC only; shm through shared
# memory (the default).
cluster_run() {
  local port=$1 servers=$2 workers=$3 spec=$4 dir=$tmp/c$1 security=()
  [[ "$5" == plain ]] && security=(--insecure)
  [[ "$6" == grpc ]] && security+=(--no-shared-memory)
  "$root/deploy/local/cluster.sh" start --servers "$servers" --workers "$workers" --dir "$dir" \
    --port "$port" --bin "$build" --data "$data" "${security[@]}" >/dev/null
  # The address and credentials cluster.sh wrote.
  local ctl=(env)
  mapfile -t -O 1 ctl <"$dir/env"
  ctl+=("$build/server/fulcrumctl")
  "${ctl[@]}" submit -f "$spec" >/dev/null
  local id
  id=$("${ctl[@]}" list | awk '{print $1}' | head -1)
  "${ctl[@]}" --output=json status "$id" |
    python3 -c 'import json,sys; print(round(max(e["samples_per_second"] for e in json.load(sys.stdin)["status"]["epochs"])))'
  grep -h "took" "$dir"/logs/worker-*.log >&2 || true
  "$root/deploy/local/cluster.sh" stop --dir "$dir" >/dev/null
}
# The baseline runs three times, at the start, midway and at the end, and
# the ratios divide by the median: this machine's speed drifts by 20-40%
# within minutes, and one baseline run can land on a fast or a slow patch.
base1=$(local_run "$tmp/bsp1.yaml")
one=$(cluster_run 7170 1 1 "$tmp/bsp1.yaml" plain grpc)
one_tls=$(cluster_run 7180 1 1 "$tmp/bsp1.yaml" tls grpc)
one_shm=$(cluster_run 7240 1 1 "$tmp/bsp1.yaml" plain shm)
one_tls_shm=$(cluster_run 7250 1 1 "$tmp/bsp1.yaml" tls shm)
two=$(cluster_run 7190 2 2 "$tmp/bsp2.yaml" plain grpc)
two_tls=$(cluster_run 7200 2 2 "$tmp/bsp2.yaml" tls grpc)
two_shm=$(cluster_run 7260 2 2 "$tmp/bsp2.yaml" plain shm)
base2=$(local_run "$tmp/bsp1.yaml")
sbase=$(local_run "$tmp/ssp1.yaml")
sone=$(cluster_run 7210 1 1 "$tmp/ssp1.yaml" plain grpc)
sone_tls=$(cluster_run 7220 1 1 "$tmp/ssp1.yaml" tls grpc)
sone_bf=$(cluster_run 7230 1 1 "$tmp/ssp1bf.yaml" plain grpc)
sone_shm=$(cluster_run 7270 1 1 "$tmp/ssp1.yaml" plain shm)
base3=$(local_run "$tmp/bsp1.yaml")
base=$(printf '%s\n' "$base1" "$base2" "$base3" | sort -n | sed -n 2p)
# This machine's loopback throughput and the cost of one gRPC round trip,
# measured now: with them, the most a 1 server + 1 worker BSP cluster can
# reach (below the table).
bounds=$("$build/tests/bench/fulcrum-bench" --bounds_only)
ratio() { python3 -c "print(f'{$1/$2:.2f}')"; }
echo "MNIST MLP 784-256-10, batch $batch per worker, best of $epochs epochs, $(nproc) cores"
row() { printf '| %s | %s | %s |\n' "$1" "$2" "$(ratio "$2" "$base")"; }
echo "| setup | samples/s | vs. BSP baseline |"
echo "| --- | ---: | ---: |"
row "BSP: one process, no parameter-server network (median of $base1, $base2, $base3)" "$base"
row "BSP: cluster, 1 server + 1 worker, plaintext, gRPC only" "$one"
row "BSP: cluster, 1 server + 1 worker, mutual TLS, gRPC only" "$one_tls"
row "BSP: cluster, 1 server + 1 worker, plaintext, shared memory" "$one_shm"
row "BSP: cluster, 1 server + 1 worker, mutual TLS, shared memory" "$one_tls_shm"
row "BSP: cluster, 2 servers + 2 workers, plaintext, gRPC only" "$two"
row "BSP: cluster, 2 servers + 2 workers, mutual TLS, gRPC only" "$two_tls"
row "BSP: cluster, 2 servers + 2 workers, plaintext, shared memory" "$two_shm"
row "SSP(1): one process" "$sbase"
row "SSP(1): cluster, 1 server + 1 worker, plaintext, gRPC only" "$sone"
row "SSP(1): cluster, 1 server + 1 worker, mutual TLS, gRPC only" "$sone_tls"
row "SSP(1): cluster, 1 server + 1 worker, plaintext, gRPC only, bf16 on the wire" "$sone_bf"
row "SSP(1): cluster, 1 server + 1 worker, plaintext, shared memory" "$sone_shm"
# The BSP ceiling, estimated from its parts. A 1 server + 1 worker step
# takes the baseline's step (the same compute and the same Adam), plus one
# round trip (step s+1's pull is sent with step s's push and answered once
# step s is applied: fulcrum-bench's "worker" pattern), plus the model's fp32
# bytes crossing once each way at iperf3's rate, one after the other. The
# parts are measured minutes apart on a machine whose speed swings by 20-40%,
# so this is an estimate, not a hard bound.
gbps=$(sed -n 's/^loopback bound: iperf3 -c [^ ]* = \([0-9.]*\) GB\/s.*/\1/p' <<<"$bounds")
rtt_us=$(sed -n 's/^round trip: empty unary gRPC call .* = \([0-9]*\) us.*/\1/p' <<<"$bounds")
if [[ -n "$gbps" && -n "$rtt_us" && "$gbps" != "0.00" ]]; then
  python3 - "$base" "$batch" "$gbps" "$rtt_us" "$one" <<'PY'
import sys
base, batch, gbps, rtt_us, one = (float(a) for a in sys.argv[1:])
params = (784 * 256 + 256) + (256 * 10 + 10)   # the 784-256-10 MLP's weights and biases
step = batch / base
wire = 2 * params * 4 / (gbps * 1e9)
floor = step + rtt_us * 1e-6 + wire
print(f"\nBSP 1 server + 1 worker, estimated ceiling on this machine: {step * 1e3:.2f} ms baseline step "
      f"+ {rtt_us / 1e3:.2f} ms gRPC round trip + {wire * 1e3:.2f} ms for {2 * params * 4 / 1e6:.2f} MB at "
      f"{gbps:.2f} GB/s = {floor * 1e3:.2f} ms a step, {step / floor:.2f} of the baseline; "
      f"measured {one / base:.2f} (plaintext, gRPC only), {one / base / (step / floor):.2f} of the estimate")
PY
else
  echo "BSP ceiling: not estimated (fulcrum-bench --bounds_only printed no loopback bound or round trip)"
fi
