#!/usr/bin/env bash
# Hosts that are really apart: one parameter server runs in a network
# namespace of its own, joined to this one by a veth pair, so its traffic
# crosses a link that can be cut (no loopback, no shared memory). A BSP job
# (the MNIST MLP, 2 epochs, 2 workers, 2 servers, a cut every 150 steps) trains
# undisturbed, then again with the link down for a while mid-job:
#   3 s   below the coordinator's node timeout (5 s): the job stalls and
#         goes on;
#   15 s  past it: the server is declared dead and the job rolls back to
#         its last checkpoint once the server is back; cut before the first
#         checkpoint, the job starts again from step 0 on the server left,
#         and the one that comes back joins the cluster without holding up
#         the job's cuts.
# Each run must succeed with the weights fingerprint of the undisturbed
# run: a partition costs time, never an update lost or applied twice.
#   partition_test.sh BUILD_DIR DATA_DIR [SECONDS@STEP...]   (default 3@200 15@200 15@10)
# Needs root (or CAP_NET_ADMIN) for the namespace; exits 77 with a message
# where one cannot be made. Processes talk in plaintext here (mutual TLS
# across the namespace is left to security_e2e_test's local cluster).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=$1 data=$2
shift 2
# Each cut is SECONDS@STEP: the link goes down for SECONDS once the job is
# at STEP (or soon after): past its first cut (150 steps), or before it.
cuts=("$@")
((${#cuts[@]})) || cuts=(3@200 15@200 15@10)

ns=fulcrum-part-$$
host_if=fph$$ ns_if=fpn$$
octet=$(($$ % 250 + 1))
host_ip=10.232.$octet.1 ns_ip=10.232.$octet.2
work=$(mktemp -d /tmp/fulcrum-partition-XXXXXX)
pids=()
# shellcheck source=tests/testing/netns.sh
source "$root/tests/testing/netns.sh"

skip() {
  echo "SKIP: partition_test.sh: $1"
  exit 77
}
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  netns_unlink "$ns" "$host_if"
  if [[ ${FULCRUM_KEEP_WORK:-0} == 1 ]]; then echo "(kept $work)"; else rm -rf "$work"; fi
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  for f in "$work"/*/logs/*.log; do
    [[ -f $f ]] && { echo "---- $f"; tail -n 15 "$f"; }
  done
  exit 1
}

netns_link "$ns" "$host_if" "$ns_if" "$host_ip" "$ns_ip"

spec=$work/job.yaml
sed -e 's/^epochs: .*/epochs: 2/' -e 's/^checkpoint: .*/checkpoint: {every_steps: 150, keep: 2}/' \
  "$root/deploy/examples/mnist-mlp.yaml" >"$spec"

# run NAME CUT_SECONDS: a fresh cluster (coordinator, a server here and one
# in the namespace, 2 workers), the job, the link cut CUT_SECONDS (0: not)
# once it has trained a while; leaves the job's weights fingerprint in
# $work/NAME/fingerprint. The one in the namespace reaches the coordinator
# and the server here (a restore reads cuts from their writers), and is
# reached, across the link; the link is cut on its side.
run() {
  local name=$1 cut=$2 at_step=${3:-0} dir=$work/$1
  mkdir -p "$dir/logs"
  local base
  base=$(/usr/bin/python3 "$root/tests/testing/free_ports.py" 3)
  local coord=127.0.0.1:$base
  pids=()
  "$build/server/fulcrum-coordinator" --listen="0.0.0.0:$base" --data_dir="$dir/coordinator" --min_servers=2 \
    --heartbeat_interval_ms=300 --node_timeout_ms=5000 --insecure --metrics_addr=127.0.0.1:0 \
    >"$dir/logs/coordinator.log" 2>&1 &
  pids+=($!)
  "$build/server/fulcrum-server" --listen="0.0.0.0:$((base + 1))" --advertise="$host_ip:$((base + 1))" \
    --coordinator="$coord" \
    --data_dir="$dir/server-0" --insecure --shared_memory=false --metrics_addr=127.0.0.1:0 \
    >"$dir/logs/server-0.log" 2>&1 &
  pids+=($!)
  ip netns exec "$ns" "$build/server/fulcrum-server" --listen="$ns_ip:$((base + 2))" \
    --coordinator="$host_ip:$base" --data_dir="$dir/server-1" --insecure --shared_memory=false \
    --metrics_addr=127.0.0.1:0 >"$dir/logs/server-1.log" 2>&1 &
  pids+=($!)
  for w in 0 1; do
    FULCRUM_CPU_THREADS=1 "$build/worker/fulcrum-worker" --coordinator="$coord" --device=cpu --data_dir="$data" \
      --slots=1 --insecure --metrics_addr=127.0.0.1:0 >"$dir/logs/worker-$w.log" 2>&1 &
    pids+=($!)
  done
  local ctl=("$build/server/fulcrumctl" --coordinator="$coord" --insecure)
  local id="" t0=$SECONDS state="" step=0
  while [[ -z $id ]] && ((SECONDS - t0 < 30)); do
    id=$("${ctl[@]}" --output=json submit -f "$spec" --no-wait 2>"$dir/submit.err" |
      /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["job_id"])' 2>/dev/null) || id=""
    [[ -n $id ]] || sleep 0.5
  done
  [[ -n $id ]] || { cat "$dir/submit.err"; fail "$name: submit"; }
  job_status() {
    "${ctl[@]}" --output=json status "$id" >"$dir/status.json" 2>/dev/null || true
    /usr/bin/python3 -c 'import json,sys; s=json.load(open(sys.argv[1]))["status"]; print(s["state"], int(s.get("step", 0)))' \
      "$dir/status.json" 2>/dev/null || echo "unknown 0"
  }
  if ((cut > 0)); then
    # The link goes down once the job has trained past its first cut.
    while ((SECONDS - t0 < 120)); do
      read -r state step < <(job_status)
      ((step >= at_step)) && break
      sleep 0.3
    done
    ((step >= at_step)) || fail "$name: the job did not reach step $at_step in 120 s ($state)"
    ip netns exec "$ns" ip link set "$ns_if" down
    echo "$name: link down at step $step for $cut s"
    sleep "$cut"
    ip netns exec "$ns" ip link set "$ns_if" up
  fi
  while ((SECONDS - t0 < 240)); do
    read -r state step < <(job_status)
    [[ $state == SUCCEEDED || $state == FAILED || $state == CANCELLED ]] && break
    sleep 0.5
  done
  [[ $state == SUCCEEDED ]] || fail "$name: the job ended ${state:-unknown}: $(head -c 800 "$dir/status.json")"
  /usr/bin/python3 - "$dir/status.json" "$name" "$dir/fingerprint" <<'PYEOF'
import json, sys
s = json.load(open(sys.argv[1]))["status"]
print(f"{sys.argv[2]}: SUCCEEDED at step {s.get('step')}, restarts {s.get('restarts', 0)}, "
      f"rollbacks {s.get('rollbacks', 0)}, checkpoints {[c['cut_id'] for c in s.get('checkpoints', [])]}, "
      f"fingerprint {s.get('weights_fingerprint', '')}")
open(sys.argv[3], "w").write(s.get("weights_fingerprint", ""))
PYEOF
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}

run undisturbed 0
want=$(cat "$work/undisturbed/fingerprint")
[[ -n $want ]] || fail "the undisturbed run has no weights fingerprint"
for c in "${cuts[@]}"; do
  [[ $c =~ ^([0-9]+)@([0-9]+)$ ]] || { echo "partition_test.sh: cut '$c': want SECONDS@STEP" >&2; exit 2; }
  secs=${BASH_REMATCH[1]} step=${BASH_REMATCH[2]}
  run "cut-$secs-at-$step" "$secs" "$step"
  got=$(cat "$work/cut-$secs-at-$step/fingerprint")
  [[ $got == "$want" ]] ||
    fail "the job with the link cut for $secs s at step $step ended with fingerprint $got, the undisturbed one $want"
  echo "link cut for $secs s at step $step: bit-identical to the undisturbed run ($got)"
done
echo "partition_test: every run bit-identical"
