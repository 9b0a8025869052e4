#!/usr/bin/env bash
# The GPU benchmark in one command: named MNIST jobs trained through a local
# Fulcrum cluster of real processes (coordinator, servers, GPU workers;
# mutual TLS and shared memory, the local cluster's defaults), and the same
# model, data, optimizer, batch and epochs in plain PyTorch on the same GPU.
# Prints one table: samples/s, GPU utilisation (nvidia-smi, sampled every
# 100 ms while the job trains), test accuracy, and Fulcrum's samples/s as a
# ratio to torch's.
#
# On a GPU machine (CUDA toolkit, python with torch and numpy; none of
# Fulcrum's Debian libraries), from a bundle made by tests/gpu/bundle.sh on
# the build machine and carried as .gpu-bundle:
#   tests/gpu/bench.sh
# Here, against the CPU backend, one short epoch each and no torch where it
# is not installed, to check the script itself:
#   tests/gpu/bench.sh --dry-run
# Options: --bin DIR (binaries laid out like build/; default .gpu-bundle,
# build with --dry-run), --epochs N (default 5; 1 with --dry-run), --jobs
# "NAME ..." (a subset). Results also go to $OUT/gpu-bench.txt when $OUT is
# set.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root" || exit 1
dry=0 bin="" epochs="" only=""
while (($#)); do
  case $1 in
    --dry-run) dry=1; shift ;;
    --bin) bin=$2; shift 2 ;;
    --epochs) epochs=$2; shift 2 ;;
    --jobs) only=$2; shift 2 ;;
    *) echo "bench.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
if ((dry)); then
  bin=${bin:-$root/build}
  epochs=${epochs:-1}
  data=${FULCRUM_DATA_DIR:-$HOME/.cache/fulcrum/data}
  "$root/deploy/local/fetch_data.sh" "$data" mnist >/dev/null || exit 1
else
  bin=${bin:-$root/.gpu-bundle}
  [[ ! -d $bin && -f $root/.gpu-bundle.tar.xz ]] && tar -C "$root" -xJf "$root/.gpu-bundle.tar.xz"
  epochs=${epochs:-5}
  data=$bin/data
  export LD_LIBRARY_PATH=$bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # The bundle carries MNIST gzipped (tests/gpu/bundle.sh).
  for f in "$data"/mnist/*.gz; do
    [[ -e $f && ! -e ${f%.gz} ]] && gunzip -k "$f"
  done
fi
[[ "$epochs" =~ ^[1-9][0-9]*$ ]] || { echo "bench.sh: --epochs must be a positive integer" >&2; exit 2; }
for b in server/fulcrum-coordinator server/fulcrum-server worker/fulcrum-worker server/fulcrumctl; do
  [[ -x $bin/$b ]] || { echo "bench.sh: $bin/$b missing (tests/gpu/bundle.sh makes the bundle)" >&2; exit 1; }
done
[[ -f $data/mnist/train-images-idx3-ubyte ]] || { echo "bench.sh: no MNIST under $data/mnist" >&2; exit 1; }
log=${OUT:-/tmp}/gpu-bench.txt
exec > >(tee "$log") 2>&1
tmp=$(mktemp -d)
cleanup() {
  for c in "$tmp"/c-*; do [[ -d $c ]] && "$root/deploy/local/cluster.sh" stop --dir "$c" >/dev/null 2>&1; done
  [[ -n ${KEEP:-} ]] && echo "kept $tmp" || rm -rf "$tmp"
}
trap cleanup EXIT
have_torch=0
python3 -c "import torch, numpy" 2>/dev/null && have_torch=1
have_smi=0
command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && have_smi=1
echo "# tests/gpu/bench.sh on $(hostname), $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
((have_smi)) && nvidia-smi -L
((dry)) && echo "# dry run: CPU backend, $epochs epoch(s), at most 20 steps an epoch"

# name servers workers hidden batch precision sync security devices
#   sync: bsp (per-step, Adam 1e-3 on the servers); local16 (local steps,
#   H = 16, rounds overlapped, inner Adam 1e-3, outer SGD at rate 1: with one
#   worker the trajectory of plain training); local16-ssp (H = 16, SSP(2)
#   rounds, outer Nesterov 0.5 at 1.0, for workers of different speeds).
#   security: tls (the local cluster's default, mutual TLS) or plain
#   (--insecure). devices: auto, or one --device per worker joined by
#   commas (cuda:0,cpu: a GPU worker beside a CPU worker). A name ending
#   in -notest leaves the test set out: no evaluation between epochs, so
#   the sampled GPU utilisation is the training's alone.
jobs=(
  "mlp1024-local16 1 1 1024,1024 512 fp32 local16 tls auto"
  "mlp4096-bf16-local16 4 1 4096,4096 2048 bf16 local16 tls auto"
  "mlp1024-local16-plain 1 1 1024,1024 512 fp32 local16 plain auto"
  "mixed-gpu-cpu 2 2 1024,1024 512 fp32 local16-ssp tls cuda:0,cpu"
  "mlp1024-bsp 1 1 1024,1024 512 fp32 bsp tls auto"
  "mlp1024-bsp-plain 1 1 1024,1024 512 fp32 bsp plain auto"
  "mlp4096-bf16-bsp 4 1 4096,4096 2048 bf16 bsp tls auto"
  "mlp1024-local16-notest 1 1 1024,1024 512 fp32 local16 tls auto"
  "mlp4096-bf16-local16-notest 4 1 4096,4096 2048 bf16 local16 tls auto"
)
target=0.975  # time to this test accuracy, training seconds (evaluations not counted)

spec() {  # spec NAME WORKERS HIDDEN BATCH PRECISION SYNC -> a job spec file
  local f=$tmp/$1.yaml
  {
    echo "name: $1"
    echo "model: {type: mlp, hidden: [$3], activation: relu}"
    echo "precision: $5"
    # 16-bit compute, 16-bit traffic: gradients, pseudo-gradients and pulled weights travel as bf16.
    [[ $5 == bf16 ]] && echo "wire_dtype: DTYPE_BF16"
    echo "data:"
    echo "  train: {format: idx, path: mnist/train-images-idx3-ubyte, labels: mnist/train-labels-idx1-ubyte}"
    [[ $1 == *-notest ]] ||
      echo "  test:  {format: idx, path: mnist/t10k-images-idx3-ubyte, labels: mnist/t10k-labels-idx1-ubyte}"
    case $6 in
      bsp)
        echo "optimizer: {kind: adam, learning_rate: 0.001}"
        echo "consistency: {model: bsp}" ;;
      local16)
        echo "optimizer: {kind: sgd, learning_rate: 1.0}"
        echo "consistency: {model: local, sync_every_steps: 16, overlap_rounds: true, inner_optimizer: {kind: adam, learning_rate: 0.001}}" ;;
      local16-ssp)
        echo "optimizer: {kind: momentum, nesterov: true, momentum: 0.5, learning_rate: 1.0}"
        echo "consistency: {model: local, sync_every_steps: 16, staleness: 2, inner_optimizer: {kind: adam, learning_rate: 0.001}}" ;;
      *) echo "bench.sh: unknown sync $6" >&2; return 1 ;;
    esac
    echo "num_workers: $2"
    echo "batch_size: $4"
    echo "epochs: $epochs"
    echo "seed: 7"
    ((dry)) && echo "max_steps_per_epoch: 20"
  } >"$f"
  echo "$f"
}

# GPU utilisation (nvidia-smi's, sampled every 100 ms into a file) while a
# command runs; `busy` averages the samples that saw any work, leaving out
# start-up before the first kernel.
sample_gpu() {  # sample_gpu FILE COMMAND...
  local file=$1 pid=""
  shift
  if ((have_smi)); then
    nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 100 >"$file" 2>/dev/null &
    pid=$!
  fi
  "$@"
  local rc=$?
  [[ -n $pid ]] && kill "$pid" 2>/dev/null
  return $rc
}
busy() {  # busy FILE -> mean utilisation over the non-zero samples, 0-1, or -
  python3 - "$1" <<'PY'
import sys
try:
    u = [float(x) for x in open(sys.argv[1]) if x.strip()]
except OSError:
    u = []
busy = [x for x in u if x > 0]
print(f"{sum(busy) / len(busy) / 100:.2f}" if busy else "-")
PY
}

rows=()
port=7400
declare -A torch_cache  # one torch run per model, batch and precision
header="| job | sync | security | Fulcrum samples/s | GPU utilisation | Fulcrum test accuracy | torch samples/s | torch test accuracy | Fulcrum / torch | s to $target, Fulcrum / torch | job state, wall |"
for j in "${jobs[@]}"; do
  read -r name servers workers hidden batch precision sync security devices <<<"$j"
  [[ -n $only && " $only " != *" $name "* ]] && continue
  f=$(spec "$name" "$workers" "$hidden" "$batch" "$precision" "$sync") || exit 2
  dir=$tmp/c-$name
  port=$((port + 10))
  env_args=(FULCRUM_WORKER_DEVICES="${devices//,/ }")
  [[ $devices == auto ]] && env_args=()
  if ((dry)); then
    env_args+=(FULCRUM_CPU_THREADS=1 FULCRUM_WORKER_DEVICES=)  # the CPU backend for every worker
  elif [[ $devices == *cpu* ]]; then
    env_args+=(FULCRUM_CPU_THREADS=8)  # the CPU worker's compute threads beside a GPU worker
  fi
  flags=()
  [[ $security == plain ]] && flags+=(--insecure)
  if ! env "${env_args[@]}" "$root/deploy/local/cluster.sh" start --servers "$servers" --workers "$workers" \
      --dir "$dir" --port "$port" --metrics-port 0 --bin "$bin" --data "$data" "${flags[@]}" >"$tmp/$name-start.log" 2>&1; then
    echo "FAILED: cluster for $name did not start:"; tail -5 "$tmp/$name-start.log"
    rows+=("| $name | $sync | $security | - | - | - | - | - | - | - | cluster did not start |")
    continue
  fi
  ctl=(env)
  mapfile -t -O 1 ctl <"$dir/env"
  ctl+=("$bin/server/fulcrumctl")
  t0=$(date +%s.%N)
  id=$("${ctl[@]}" submit -f "$f" --no_wait 2>"$tmp/$name-submit.err" | sed -n 's/^submitted job //p')
  sample_gpu "$tmp/$name-util.txt" timeout 150 "${ctl[@]}" watch "$id" >"$tmp/$name-watch.log" 2>&1
  t1=$(date +%s.%N)
  "${ctl[@]}" --output=json status "$id" >"$tmp/$name-status.json" 2>/dev/null
  "$root/deploy/local/cluster.sh" stop --dir "$dir" >/dev/null 2>&1
  cp -r "$dir/logs" "$tmp/$name-logs" 2>/dev/null
  fulcrum=$(python3 - "$tmp/$name-status.json" "$tmp/$name-util.txt" "$target" "$tmp/$name-logs" <<'PY'
import json, sys
try:
    st = json.load(open(sys.argv[1]))["status"]
except Exception as e:  # the job did not report
    print(f"- - - - no status ({e})")
    sys.exit(0)
epochs = st.get("epochs", [])
eps = [e["samples_per_second"] for e in epochs if e.get("samples_per_second")]
# The first epoch holds start-up (uploads, cuBLAS heuristics): the rest, when there are more.
rate = sorted(eps[1:] or eps)[len(eps[1:] or eps) // 2] if eps else 0
util = "-"
try:
    u = [float(x) for x in open(sys.argv[2]) if x.strip()]
    busy = [x for x in u if x > 0]
    util = f"{sum(busy) / len(busy) / 100:.2f}" if busy else "-"
except OSError:
    pass
# Training seconds (epochs' own time, evaluations not counted) until the test accuracy first reached the target.
reach, spent = "-", 0.0
for e in epochs:
    spent += e.get("seconds", 0)
    if e.get("tested") and e.get("test_accuracy", 0) >= float(sys.argv[3]):
        reach = f"{spent:.2f}"
        break
print(f"{rate:.0f} {util} {st.get('test_accuracy', 0):.4f} {reach} {st.get('state', '?')}")
# Detail lines (stderr): each epoch, each rank.
for e in epochs:
    print(f"  epoch {e.get('epoch', 0)}: {e.get('seconds', 0):.2f} s, {e.get('samples_per_second', 0):.0f} samples/s, "
          f"test accuracy {e.get('test_accuracy', 0):.4f}", file=sys.stderr)
# Each worker's own account of its epochs (its log): the share of the
# epochs after the first spent computing, against pulling, pushing and
# waiting for data.
import glob, re
for log in sorted(glob.glob(sys.argv[4] + "/worker-*.log")):
    took = [tuple(map(float, m)) for m in re.findall(
        r"took ([0-9.e-]+) s: pull ([0-9.e-]+) s, compute ([0-9.e-]+) s, push ([0-9.e-]+) s, data ([0-9.e-]+) s",
        open(log, errors="replace").read())][1:]
    if took:
        total = sum(t[0] for t in took)
        print(f"  {log.split('/')[-1]}: epochs after the first: {total:.3f} s, compute "
              f"{sum(t[2] for t in took) / total:.2f}, pull {sum(t[1] for t in took) / total:.2f}, "
              f"push {sum(t[3] for t in took) / total:.2f}, data {sum(t[4] for t in took) / total:.2f}",
              file=sys.stderr)
for w in st.get("workers", []):
    print(f"  rank {w.get('rank', 0)} on {w.get('device', '?')}: {w.get('samples_per_second', 0):.0f} samples/s, "
          f"{w.get('step', 0)} steps, data wait {w.get('data_wait_seconds', 0):.2f} s, "
          f"GPU busy {w.get('gpu_busy_seconds', 0):.2f} s idle {w.get('gpu_idle_seconds', 0):.2f} s", file=sys.stderr)
PY
)
  read -r f_rate f_util f_acc f_reach f_state <<<"$fulcrum"
  [[ -s $tmp/$name-submit.err ]] && { echo "$name: submit said:"; cat "$tmp/$name-submit.err"; }
  t_rate="-" t_acc="-" t_reach="-" ratio="-"
  key="$hidden-$batch-$precision"
  if ((have_torch)) && [[ $devices != *cpu* || $dry == 1 ]]; then
    if [[ -z ${torch_cache[$key]:-} ]]; then
      torch_cache[$key]=$(sample_gpu "$tmp/$name-torch-util.txt" python3 "$root/tests/gpu/torch_train.py" \
        --data "$data/mnist" --hidden "$hidden" --batch "$batch" --precision "$precision" --epochs "$epochs" \
        --target "$target" $( ((dry)) && echo "--max_steps 20 --device cpu") 2>"$tmp/$name-torch.err")
      ((have_smi)) && echo "  torch's GPU utilisation for $key: $(busy "$tmp/$name-torch-util.txt")"
    fi
    read -r t_rate t_acc t_reach <<<"${torch_cache[$key]}"
    [[ -z $t_rate ]] && { t_rate="-"; t_acc="error: $(tail -1 "$tmp/$name-torch.err")"; }
    [[ $t_rate != "-" && $f_rate != "-" && $t_rate != 0 ]] && ratio=$(python3 -c "print(f'{$f_rate / $t_rate:.2f}')")
  elif ((!have_torch)); then
    t_acc="torch not installed"
  fi
  wall=$(python3 -c "print(f'{$t1 - $t0:.1f}')")
  row="| $name ($servers server(s), $workers worker(s) on $devices, batch $batch, $precision) | $sync | $security | $f_rate | $f_util | $f_acc | $t_rate | $t_acc | $ratio | ${f_reach:--} / ${t_reach:--} | $f_state, ${wall} s |"
  echo "$header"; echo "$row"  # each row as it lands, so a run cut short keeps what it measured
  rows+=("$row")
done

echo
echo "$header"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
[[ -n ${OUT:-} ]] && tar -C "$tmp" -czf "$OUT/gpu-bench-logs.tar.gz" --exclude='c-*' . 2>/dev/null
bad=0
for r in "${rows[@]}"; do [[ $r == *SUCCEEDED* ]] || bad=1; done
exit $bad
