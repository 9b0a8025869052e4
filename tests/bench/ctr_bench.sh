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
mkdir -p "$tmp/data/ctr"
echo "generating $rows training rows (vocabulary $vocab) ..." >&2
gen=$("$build/worker/fulcrum-datagen" ctr --train="$tmp/data/ctr/train.tsv.gz" --test="$tmp/data/ctr/test.tsv.gz" \
  --train_rows="$rows" --test_rows=$((rows / 20)) --vocab="$vocab")
best=$(sed -n 's/.*best AUC \([0-9.]*\).*/\1/p' <<<"$gen")
[[ -n "$best" ]] || { echo "ctr_bench: no planted AUC in fulcrum-datagen's output: $gen" >&2; exit 1; }

make_spec() {  # make_spec EXAMPLE -> the example for one worker and EPOCHS epochs
  sed "s/^epochs: .*/epochs: $epochs/; s/^num_workers: .*/num_workers: 1/" "$root/deploy/examples/ctr-$1.yaml" >"$tmp/$1.yaml"
}
for m in dlrm wide-deep deepfm; do make_spec "$m"; done
export OPENBLAS_NUM_THREADS=1

# shellcheck source=tests/bench/ctr_lib.sh
source "$root/tests/bench/ctr_lib.sh"
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

f() { python3 -c "print(f'{$1:$2}')"; }
echo "Generated data: $rows training rows, $((rows / 20)) test rows, vocabulary $vocab; planted model's test AUC $best;"
echo "$epochs epochs, batch 128, one worker, $(nproc) cores"
echo
echo "| model | test AUC (last epoch) | planted - model | samples/s | sparse rows pulled/s |"
echo "| --- | ---: | ---: | ---: | ---: |"
echo "| DLRM, one process | $dlrm_auc | $(f "$best - $dlrm_auc" .4f) | $base1 | $rows1 |"
echo "| Wide & Deep, one process | $wd_auc | $(f "$best - $wd_auc" .4f) | $wd_sps | $wd_rows |"
echo "| DeepFM, one process | $dfm_auc | $(f "$best - $dfm_auc" .4f) | $dfm_sps | $dfm_rows |"
echo
echo "| DLRM | samples/s | vs. one process | sparse rows pulled/s | test AUC |"
echo "| --- | ---: | ---: | ---: | ---: |"
echo "| one process, no parameter-server network (median of $base1, $base2, $base3) | $base | 1.00 | $(f "$base * $per_example" .0f) | $dlrm_auc |"
echo "| local cluster, 1 server + 1 worker | $one | $(f "$one / $base" .2f) | $(f "$one * $per_example" .0f) | $one_auc |"
echo "| local cluster, 2 servers + 1 worker | $two | $(f "$two / $base" .2f) | $(f "$two * $per_example" .0f) | $two_auc |"
