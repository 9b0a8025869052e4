#!/usr/bin/env bash
# The GPU benchmark in one command: named MNIST jobs trained through a local
# Fulcrum cluster of real processes (coordinator, servers, GPU workers;
# mutual TLS and shared memory, the local cluster's defaults), and the same
# model, data, optimizer, batch and epochs in plain PyTorch on the same GPU.
# Prints one table: samples/s, GPU utilisation (nvidia-smi, sampled every
# 200 ms while the job trains), test accuracy, and Fulcrum's samples/s as a
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
# build with --dry-run), --epochs N (default 3; 1 with --dry-run), --jobs
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
  epochs=${epochs:-3}
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

# name servers workers hidden batch precision
jobs=(
  "demo 2 2 256 32 fp32"
  "mlp1024-fp32 1 1 1024,1024 512 fp32"
  "mlp1024-bf16 1 1 1024,1024 512 bf16"
  "mlp4096-bf16 4 1 4096,4096 2048 bf16"
)

spec() {  # spec NAME WORKERS HIDDEN BATCH PRECISION -> a job spec file
  local f=$tmp/$1.yaml
  {
    echo "name: $1"
    echo "model: {type: mlp, hidden: [$3], activation: relu}"
    echo "precision: $5"
    echo "data:"
    echo "  train: {format: idx, path: mnist/train-images-idx3-ubyte, labels: mnist/train-labels-idx1-ubyte}"
    echo "  test:  {format: idx, path: mnist/t10k-images-idx3-ubyte, labels: mnist/t10k-labels-idx1-ubyte}"
    echo "optimizer: {kind: adam, learning_rate: 0.001}"
    echo "consistency: {model: bsp}"
    echo "num_workers: $2"
    echo "batch_size: $4"
    echo "epochs: $epochs"
    echo "seed: 7"
    ((dry)) && echo "max_steps_per_epoch: 20"
  } >"$f"
  echo "$f"
}

rows=()
port=7400
for j in "${jobs[@]}"; do
  read -r name servers workers hidden batch precision <<<"$j"
  [[ -n $only && " $only " != *" $name "* ]] && continue
  f=$(spec "$name" "$workers" "$hidden" "$batch" "$precision")
  dir=$tmp/c-$name
  port=$((port + 10))
  env_args=()
  ((dry)) && env_args=(FULCRUM_CPU_THREADS=1)
  if ! env "${env_args[@]}" "$root/deploy/local/cluster.sh" start --servers "$servers" --workers "$workers" \
      --dir "$dir" --port "$port" --metrics-port 0 --bin "$bin" --data "$data" >"$tmp/$name-start.log" 2>&1; then
    echo "FAILED: cluster for $name did not start:"; tail -5 "$tmp/$name-start.log"
    rows+=("| $name | - | - | - | - | - | cluster did not start |")
    continue
  fi
  ctl=(env)
  mapfile -t -O 1 ctl <"$dir/env"
  ctl+=("$bin/server/fulcrumctl")
  smi_pid=""
  if ((have_smi)); then
    nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 200 >"$tmp/$name-util.txt" 2>/dev/null &
    smi_pid=$!
  fi
  t0=$(date +%s.%N)
  id=$("${ctl[@]}" submit -f "$f" --no_wait 2>"$tmp/$name-submit.err" | sed -n 's/^submitted job //p')
  "${ctl[@]}" watch "$id" >"$tmp/$name-watch.log" 2>&1
  t1=$(date +%s.%N)
  [[ -n $smi_pid ]] && kill "$smi_pid" 2>/dev/null
  "${ctl[@]}" --output=json status "$id" >"$tmp/$name-status.json" 2>/dev/null
  "$root/deploy/local/cluster.sh" stop --dir "$dir" >/dev/null 2>&1
  fulcrum=$(python3 - "$tmp/$name-status.json" "$tmp/$name-util.txt" <<'PY'
import json, sys
try:
    st = json.load(open(sys.argv[1]))["status"]
except Exception as e:  # the job did not report
    print(f"- - - no status ({e})")
    sys.exit(0)
eps = [e["samples_per_second"] for e in st.get("epochs", []) if e.get("samples_per_second")]
# The first epoch holds start-up (uploads, cuBLAS heuristics): the rest, when there are more.
rate = sorted(eps[1:] or eps)[len(eps[1:] or eps) // 2] if eps else 0
util = "-"
try:
    u = [float(x) for x in open(sys.argv[2]) if x.strip()]
    busy = [x for x in u if x > 0] or u
    util = f"{sum(busy) / len(busy) / 100:.2f}" if busy else "-"
except OSError:
    pass
print(f"{rate:.0f} {util} {st.get('test_accuracy', 0):.4f} {st.get('state', '?')}")
PY
)
  read -r f_rate f_util f_acc f_state <<<"$fulcrum"
  [[ -s $tmp/$name-submit.err ]] && { echo "$name: submit said:"; cat "$tmp/$name-submit.err"; }
  t_rate="-" t_acc="-" ratio="-"
  if ((have_torch)); then
    torch_out=$(python3 "$root/tests/gpu/torch_train.py" --data "$data/mnist" --hidden "$hidden" --batch "$batch" \
      --precision "$precision" --epochs "$epochs" $( ((dry)) && echo "--max_steps 20 --device cpu") 2>"$tmp/$name-torch.err")
    read -r t_rate t_acc <<<"$torch_out"
    [[ -z $t_rate ]] && { t_rate="-"; t_acc="error: $(tail -1 "$tmp/$name-torch.err")"; }
    [[ $t_rate != "-" && $f_rate != "-" && $t_rate != 0 ]] && ratio=$(python3 -c "print(f'{$f_rate / $t_rate:.2f}')")
  else
    t_acc="torch not installed"
  fi
  wall=$(python3 -c "print(f'{$t1 - $t0:.1f}')")
  rows+=("| $name ($servers server(s), $workers worker(s), batch $batch, $precision) | $f_rate | $f_util | $f_acc | $t_rate | $t_acc | $ratio | $f_state, ${wall} s |")
done

echo
echo "| job | Fulcrum samples/s | GPU utilisation | Fulcrum test accuracy | torch samples/s | torch test accuracy | Fulcrum / torch | job state, wall |"
echo "|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
bad=0
for r in "${rows[@]}"; do [[ $r == *SUCCEEDED* ]] || bad=1; done
exit $bad
