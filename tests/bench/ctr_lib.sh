# shellcheck shell=bash
# Click-through runs shared by tests/bench/ctr_bench.sh (the CPU) and
# tests/gpu/ctr.sh (a GPU): sourced, not run. Set CTR_LOG to keep the
# trainers' logs (default: discarded), CTR_TIMEOUT to bound each one-process
# run in seconds (default: none).
ctr_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

# ctr_generate BIN DATA_DIR ROWS VOCAB -> the planted model's test AUC
#   fulcrum-datagen ctr writes DATA_DIR/ctr/{train,test}.tsv.gz (ROWS and
#   ROWS / 20 rows); its report goes to stderr
ctr_generate() {
  mkdir -p "$2/ctr"
  local report
  report=$("$1/worker/fulcrum-datagen" ctr --train="$2/ctr/train.tsv.gz" --test="$2/ctr/test.tsv.gz" \
    --train_rows="$3" --test_rows=$(($3 / 20)) --vocab="$4") || return 1
  echo "$report" >&2
  local best
  best=$(sed -n 's/.*best AUC \([0-9.]*\).*/\1/p' <<<"$report")
  [[ -n $best ]] || { echo "no planted AUC in fulcrum-datagen's report" >&2; return 1; }
  echo "$best"
}

# ctr_spec EXAMPLE OUT EPOCHS [BATCH] -> OUT: deploy/examples/ctr-EXAMPLE.yaml
#   for one worker, EPOCHS epochs and (when given) batch BATCH
ctr_spec() {
  sed "s/^epochs: .*/epochs: $3/; s/^num_workers: .*/num_workers: 1/${4:+; s/^batch_size: .*/batch_size: $4/}" \
    "$ctr_root/deploy/examples/ctr-$1.yaml" >"$2"
  echo "$2"
}

# ctr_fmt EXPRESSION FORMAT: a Python expression's value, formatted
ctr_fmt() { python3 -c "print(f'{$1:$2}')"; }

# ctr_local_run BIN SPEC DEVICE DATA_DIR
#   -> "AUC SAMPLES_PER_S ROWS_PER_S ROWS_PER_EXAMPLE" of fulcrum-train-local
#   (the last epoch's test AUC, the best epoch's rates), on one compute thread
ctr_local_run() {
  timeout "${CTR_TIMEOUT:-0}" "$1/worker/fulcrum-train-local" --spec="$2" --device="$3" --cpu_threads=1 --data_dir="$4" \
    2>&1 | tee -a "${CTR_LOG:-/dev/null}" | python3 -c '
import re, sys
auc, sps, rps, rpe = 0, 0, 0, 0
for line in sys.stdin:
    if m := re.match(r"epoch \d+: test AUC ([0-9.]+)", line): auc = float(m[1])
    if m := re.match(r"epoch \d+: (\d+) samples/s", line): sps = max(sps, int(m[1]))
    if m := re.search(r"sparse rows pulled: (\d+)/s, ([0-9.]+) per example", line): rps, rpe = max(rps, int(m[1])), float(m[2])
print(auc, sps, rps, rpe)'
}

# ctr_cluster_run BIN SPEC SERVERS PORT DATA_DIR RUN_DIR
#   -> "AUC SAMPLES_PER_S" of SPEC on a local cluster of SERVERS servers and
#   one worker (the first GPU where there is one, as deploy/local/cluster.sh
#   starts workers)
ctr_cluster_run() {
  local bin=$1 spec=$2 servers=$3 port=$4 data=$5 dir=$6
  "$ctr_root/deploy/local/cluster.sh" start --servers "$servers" --workers 1 --dir "$dir" --port "$port" --bin "$bin" \
    --data "$data" >>"${CTR_LOG:-/dev/null}" 2>&1 || { echo "0 0"; return; }
  local ctl=(env)
  mapfile -t -O 1 ctl <"$dir/env"
  ctl+=("$bin/server/fulcrumctl")
  "${ctl[@]}" submit -f "$spec" >>"${CTR_LOG:-/dev/null}" 2>&1
  local id
  id=$("${ctl[@]}" list | awk '{print $1}' | head -1)
  "${ctl[@]}" --output=json status "$id" | python3 -c '
import json, sys
s = json.load(sys.stdin)["status"]
print("%.4f" % s.get("test_auc", 0), round(max([e["samples_per_second"] for e in s.get("epochs", [])] or [0])))'
  "$ctr_root/deploy/local/cluster.sh" stop --dir "$dir" >/dev/null 2>&1
}
