#!/usr/bin/env bash
# Click-through models on generated Criteo-layout data (fulcrum-datagen ctr,
# whose planted model's test AUC is the bound), in the same run:
#   quality     DLRM, Wide & Deep and DeepFM (deploy/examples), one process
#               (fulcrum-train-local): last epoch's test AUC against the
#               planted model's, samples/s and sparse rows pulled per second
#   throughput  DLRM through a local cluster (mutual TLS and shared memory,
#               the local cluster's defaults), 1 server + 1 worker and
#               2 servers + 1 worker, against the same model in one process
#               with no parameter-server network (the median of three runs:
#               start, midway, end, as this machine's speed drifts)
# Every trainer computes on one thread (the local cluster's default).
# Rows pulled per second through a cluster are its samples/s times the rows
# per example the one-process run counted (same data, same batch size).
#
#   [ROWS=2000000] [VOCAB=100] [EPOCHS=2] tests/bench/ctr_bench.sh [BUILD_DIR]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${1:-$root/build}
rows=${ROWS:-2000000}
vocab=${VOCAB:-100}
epochs=${EPOCHS:-2}
for v in rows vocab epochs; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "ctr_bench: ${v^^} must be a positive integer, got '${!v}'" >&2; exit 2; }
done
tmp=$(mktemp -d)
cleanup() {
  for c in "$tmp"/c*; do [[ -d "$c" ]] && "$root/deploy/local/cluster.sh" stop --dir "$c" >/dev/null; done
  [[ -n "${KEEP:-}" ]] || rm -rf "$tmp"
}
trap cleanup EXIT
# shellcheck source=tests/bench/ctr_lib.sh
source "$root/tests/bench/ctr_lib.sh"
echo "generating $rows training rows (vocabulary $vocab) ..." >&2
best=$(ctr_generate "$build" "$tmp/data" "$rows" "$vocab") || { echo "ctr_bench: no data" >&2; exit 1; }
for m in dlrm wide-deep deepfm; do ctr_spec "$m" "$tmp/$m.yaml" "$epochs" >/dev/null; done
export OPENBLAS_NUM_THREADS=1
local_run() { ctr_local_run "$build" "$tmp/$1.yaml" cpu "$tmp/data"; }  # MODEL
cluster_run() { ctr_cluster_run "$build" "$tmp/dlrm.yaml" "$2" "$1" "$tmp/data" "$tmp/c$1"; }  # PORT SERVERS

read -r dlrm_auc base1 rows1 per_example < <(local_run dlrm)
read -r wd_auc wd_sps wd_rows _ < <(local_run wide-deep)
read -r one_auc one < <(cluster_run 7370 1)
read -r _ base2 _ _ < <(local_run dlrm)
read -r dfm_auc dfm_sps dfm_rows _ < <(local_run deepfm)
read -r two_auc two < <(cluster_run 7380 2)
read -r _ base3 _ _ < <(local_run dlrm)
base=$(printf '%s\n' "$base1" "$base2" "$base3" | sort -n | sed -n 2p)

echo "Generated data: $rows training rows, $((rows / 20)) test rows, vocabulary $vocab; planted model's test AUC $best;"
echo "$epochs epochs, batch 128, one worker, $(nproc) cores"
echo
echo "| model | test AUC (last epoch) | planted - model | samples/s | sparse rows pulled/s |"
echo "| --- | ---: | ---: | ---: | ---: |"
echo "| DLRM, one process | $dlrm_auc | $(ctr_fmt "$best - $dlrm_auc" .4f) | $base1 | $rows1 |"
echo "| Wide & Deep, one process | $wd_auc | $(ctr_fmt "$best - $wd_auc" .4f) | $wd_sps | $wd_rows |"
echo "| DeepFM, one process | $dfm_auc | $(ctr_fmt "$best - $dfm_auc" .4f) | $dfm_sps | $dfm_rows |"
echo
echo "| DLRM | samples/s | vs. one process | sparse rows pulled/s | test AUC |"
echo "| --- | ---: | ---: | ---: | ---: |"
echo "| one process, no parameter-server network (median of $base1, $base2, $base3) | $base | 1.00 | $(ctr_fmt "$base * $per_example" .0f) | $dlrm_auc |"
echo "| local cluster, 1 server + 1 worker | $one | $(ctr_fmt "$one / $base" .2f) | $(ctr_fmt "$one * $per_example" .0f) | $one_auc |"
echo "| local cluster, 2 servers + 1 worker | $two | $(ctr_fmt "$two / $base" .2f) | $(ctr_fmt "$two * $per_example" .0f) | $two_auc |"
