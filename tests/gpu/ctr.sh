#!/usr/bin/env bash
# Click-through models on a GPU, on generated Criteo-layout data
# (fulcrum-datagen ctr, whose planted model's test AUC is the bound):
#   quality     DLRM and DeepFM (deploy/examples, batch 128, 2 epochs) in one
#               process on the GPU: last epoch's test AUC against the
#               planted model's
#   throughput  DLRM at batch 128, 2048 and 8192 (1 epoch) in one process on
#               the GPU, against plain PyTorch's eager loop over the same
#               model on the same GPU (tests/gpu/dlrm_torch.py, batches made
#               beforehand on the device) and TorchRec's published 740k
#               records/s (DLRM, one A100: facebookresearch/dlrm,
#               torchrec_dlrm); then through a local cluster (mutual TLS and
#               shared memory, the local cluster's defaults) of 1 and
#               2 servers and one GPU worker
#   dcnv2       the MLPerf-shaped DLRM-DCNv2 example at batch 8192 (1
#               epoch) in one process, against MLPerf Training v4.0's
#               per-GPU rate on the same GPU model
# On a GPU machine (CUDA toolkit, python with torch), from a bundle made by
# tests/gpu/bundle.sh and carried as .gpu-bundle.tar.xz:
#   tests/gpu/ctr.sh
# Here, against the CPU backend on 100 000 rows, to check the script itself:
#   tests/gpu/ctr.sh --dry-run
# Options: --bin DIR (binaries laid out like build/). ROWS and VOCAB set
# the generated data (default 2 000 000 rows, 100 values per field).
# Results go to stdout and, when $OUT is set, to $OUT/gpu-ctr.txt; the
# trainers' own output to $OUT/gpu-ctr-trainers.log.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root" || exit 1
dry=0 bin=""
while (($#)); do
  case $1 in
    --dry-run) dry=1; shift ;;
    --bin) bin=$2; shift 2 ;;
    *) echo "ctr.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
if ((dry)); then
  bin=${bin:-$root/build} dev=cpu rows=${ROWS:-100000} batches="128 2048" steps=20
else
  bin=${bin:-$root/.gpu-bundle} dev=cuda:0 rows=${ROWS:-2000000} batches="128 2048 8192" steps=300
  [[ ! -d $bin && -f $root/.gpu-bundle.tar.xz ]] && tar -C "$root" -xJf "$root/.gpu-bundle.tar.xz"
  export LD_LIBRARY_PATH=$bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
vocab=${VOCAB:-100}
for b in worker/fulcrum-train-local worker/fulcrum-datagen server/fulcrumctl; do
  [[ -x $bin/$b ]] || { echo "ctr.sh: $bin/$b missing (tests/gpu/bundle.sh makes the bundle)" >&2; exit 1; }
done
export CTR_LOG=${OUT:-/tmp}/gpu-ctr-trainers.log CTR_TIMEOUT=300
: >"$CTR_LOG"
exec > >(tee "${OUT:-/tmp}/gpu-ctr.txt") 2>&1
tmp=$(mktemp -d)
cleanup() {
  for c in "$tmp"/c*; do [[ -d $c ]] && "$root/deploy/local/cluster.sh" stop --dir "$c" >/dev/null 2>&1; done
  rm -rf "$tmp"
}
trap cleanup EXIT
# shellcheck source=tests/bench/ctr_lib.sh
source "$root/tests/bench/ctr_lib.sh"
export OPENBLAS_NUM_THREADS=1
have_torch=0
python3 -c "import torch" 2>/dev/null && have_torch=1

echo "# tests/gpu/ctr.sh on $(hostname), $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(nproc) cores"
nvidia-smi -L 2>/dev/null
best=$(ctr_generate "$bin" "$tmp/data" "$rows" "$vocab") || { echo "ctr.sh: no data" >&2; exit 1; }

spec() {  # spec EXAMPLE BATCH EPOCHS -> the example for one worker (dry run: a few steps an epoch)
  local f
  f=$(ctr_spec "$1" "$tmp/$1-$2-$3.yaml" "$3" "$2")
  ((dry)) && echo "max_steps_per_epoch: $steps" >>"$f"
  echo "$f"
}

echo
echo "| model, batch 128, 2 epochs, $dev | test AUC | planted - model | samples/s |"
echo "| --- | ---: | ---: | ---: |"
for m in dlrm deepfm; do
  read -r auc sps _ _ < <(ctr_local_run "$bin" "$(spec "$m" 128 2)" "$dev" "$tmp/data")
  echo "| $m | $auc | $(ctr_fmt "$best - ${auc:-0}" .4f) | $sps |"
done

echo
echo "| DLRM, 1 epoch, $dev | batch | Fulcrum samples/s | torch samples/s | Fulcrum / torch | / TorchRec's 740k | test AUC |"
echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
declare -A one
for b in $batches; do
  read -r auc sps _ _ < <(ctr_local_run "$bin" "$(spec dlrm "$b" 1)" "$dev" "$tmp/data")
  one[$b]=${sps:-0}
  t=0
  ((have_torch)) && t=$(timeout 120 python3 tests/gpu/dlrm_torch.py --batch "$b" --rows_per_field "$vocab" \
    --steps "$steps" --device "$dev" | sed -n 's/.*: \([0-9]*\) samples\/s/\1/p')
  echo "| one process | $b | ${one[$b]} | ${t:-0} | $(ctr_fmt "${one[$b]} / max(${t:-0}, 1)" .2f) | $(ctr_fmt "${one[$b]} / 740000" .2f) | $auc |"
done
b=2048
for s in 1 2; do
  read -r auc sps < <(ctr_cluster_run "$bin" "$(spec dlrm $b 1)" "$s" $((7400 + 20 * s)) "$tmp/data" "$tmp/c$s")
  echo "| local cluster, $s server(s) + 1 worker | $b | $sps | - | $(ctr_fmt "$sps / max(${one[$b]}, 1)" .2f) of one process | $(ctr_fmt "$sps / 740000" .2f) | $auc |"
done

# DLRM-DCNv2 in MLPerf's shape against MLPerf Training v4.0's per-GPU rate
# (HugeCTR, all in GPU memory, batch 55 296: about 1.73 M samples/s per
# H100 and 1.88 M per H200); here one worker, batch 8 192, generated data.
echo
echo "| DLRM-DCNv2 (ctr-dcnv2.yaml), 1 epoch, $dev | batch | samples/s | MLPerf v4.0 per GPU | ratio | test AUC |"
echo "| --- | ---: | ---: | ---: | ---: | ---: |"
b=8192
((dry)) && b=256
mlperf=0
case "$(nvidia-smi -L 2>/dev/null)" in
  *H200*) mlperf=1880000 ;;
  *H100*) mlperf=1730000 ;;
esac
read -r auc sps _ _ < <(ctr_local_run "$bin" "$(spec dcnv2 "$b" 1)" "$dev" "$tmp/data")
if ((mlperf > 0)); then
  echo "| one process | $b | ${sps:-0} | $mlperf | $(ctr_fmt "${sps:-0} / $mlperf" .2f) | $auc |"
else
  echo "| one process | $b | ${sps:-0} | - (not an H100 or H200) | - | $auc |"
fi
