# Click-through runs shared by tests/bench/ctr_bench.sh (the CPU) and
# tests/gpu/ctr.sh (a GPU): sourced, not run. Set CTR_LOG to keep the
# trainers' logs (default: discarded).

# ctr_local_run BIN SPEC DEVICE DATA_DIR
#   -> "AUC SAMPLES_PER_S ROWS_PER_S ROWS_PER_EXAMPLE" of fulcrum-train-local
#   (the last epoch's test AUC, the best epoch's rates), on one compute thread
ctr_local_run() {
  "$1/worker/fulcrum-train-local" --spec="$2" --device="$3" --cpu_threads=1 --data_dir="$4" \
    2>>"${CTR_LOG:-/dev/null}" | tee -a "${CTR_LOG:-/dev/null}" | python3 -c '
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
  "$root/deploy/local/cluster.sh" start --servers "$servers" --workers 1 --dir "$dir" --port "$port" --bin "$bin" \
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
  "$root/deploy/local/cluster.sh" stop --dir "$dir" >/dev/null 2>&1
}
