#!/usr/bin/env bash
# Click-through quality against plain torch on data shaped like real click
# logs: fulcrum-datagen ctr with a realistic vocabulary (the largest field
# VOCAB ids, field j VOCAB >> (j mod 8); Zipf ZIPF, so most ids are rare),
# then each example model (deploy/examples, one process: fulcrum-train-local)
# beside its torch peer with the same layers, optimizer (Adagrad at the
# example's rate and initial accumulator), batch and epochs and exact ids
# (tests/bench/ctr_torch_peer.py), in the same run. Variants of the Fulcrum
# spec (VARIANTS, space-separated) show what each knob is worth:
#   acc:VALUE  Adagrad's initial_accumulator at VALUE (torch's own default is 0)
#   hash24     criteo hash_bits 24 (fewer ids share a row than at the default 20)
#
#   [ROWS=1000000] [VOCAB=1000000] [ZIPF=1.1] [EPOCHS=1] [MODELS="dlrm deepfm wide-deep"] [SEEDS=1]
#   [VARIANTS="acc:1e-10 acc:0.1 hash24"] tests/bench/ctr_quality.sh [BUILD_DIR]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${1:-$root/build}
rows=${ROWS:-1000000} vocab=${VOCAB:-1000000} zipf=${ZIPF:-1.1} epochs=${EPOCHS:-1}
models=${MODELS:-dlrm deepfm wide-deep} seeds=${SEEDS:-1} variants=${VARIANTS-acc:1e-10 acc:0.1 hash24}
tmp=$(mktemp -d)
trap '[[ -n "${KEEP:-}" ]] || rm -rf "$tmp"' EXIT
mkdir -p "$tmp/ctr"
export OPENBLAS_NUM_THREADS=1
echo "generating $rows training rows and $((rows / 5)) test rows, vocabulary $vocab, Zipf $zipf ..." >&2
report=$("$build/worker/fulcrum-datagen" ctr --train="$tmp/ctr/train.tsv.gz" --test="$tmp/ctr/test.tsv.gz" \
  --train_rows="$rows" --test_rows=$((rows / 5)) --vocab="$vocab" --zipf="$zipf")
best=$(sed -n 's/.*best AUC \([0-9.]*\).*/\1/p' <<<"$report")
[[ -n $best ]] || { echo "ctr_quality: no planted AUC in fulcrum-datagen's report" >&2; exit 1; }

# spec MODEL VARIANT OUT: the example with `epochs`, one worker, the variant.
spec() {
  sed -e "s/^epochs: .*/epochs: $epochs/" -e 's/^num_workers: .*/num_workers: 1/' "$root/deploy/examples/ctr-$1.yaml" >"$3"
  case "$2" in
    acc:*) sed -i -E -e 's/, initial_accumulator: [0-9.e-]+//' \
         -e "s/^optimizer: \\{kind: adagrad, (.*)\\}\$/optimizer: {kind: adagrad, \\1, initial_accumulator: ${2#acc:}}/" "$3" ;;
    hash24) sed -i -E 's/(path: ctr\/(train|test)\.tsv\.gz)\}/\1, hash_bits: 24}/' "$3" ;;
  esac
}
fulcrum_auc() {  # SPEC
  "$build/worker/fulcrum-train-local" --spec="$1" --device=cpu --cpu_threads=1 --data_dir="$tmp" 2>&1 |
    sed -n 's/^epoch [0-9]*: test AUC \([0-9.]*\).*/\1/p' | tail -n 1
}
echo "Data: $rows training rows, vocabulary $vocab (field j: $vocab >> (j mod 8)), Zipf $zipf; planted model's test AUC $best; $epochs epoch(s); commit $(git -C "$root" rev-parse --short HEAD), $(nproc) cores"
echo "| model | seed | torch (exact ids, the example's optimizer) | Fulcrum as shipped | torch - Fulcrum |$(for v in $variants; do printf ' %s | - |' "$v"; done)"
echo "|---|---|---|---|---|$(for _ in $variants; do printf -- '---|---|'; done)"
for m in $models; do
  lr=$(sed -n 's/^optimizer: {kind: adagrad, learning_rate: \([0-9.e-]*\).*/\1/p' "$root/deploy/examples/ctr-$m.yaml")
  batch=$(sed -n 's/^batch_size: //p' "$root/deploy/examples/ctr-$m.yaml")
  acc=$(sed -n 's/^optimizer: {kind: adagrad, .*initial_accumulator: \([0-9.e-]*\).*/\1/p' "$root/deploy/examples/ctr-$m.yaml")
  for ((s = 0; s < seeds; s++)); do
    torch_auc=$(/usr/bin/python3 "$root/tests/bench/ctr_torch_peer.py" --train "$tmp/ctr/train.tsv.gz" \
      --test "$tmp/ctr/test.tsv.gz" --model "$m" --lr "$lr" --batch "$batch" --epochs "$epochs" --seed "$s" \
      --initial_accumulator "${acc:-0.1}" |
      sed -n 's/.*test AUC \([0-9.]*\).*/\1/p' | tail -n 1)
    spec "$m" shipped "$tmp/$m.yaml"
    sed -i "s/^seed: .*//; \$a seed: $((s + 1))" "$tmp/$m.yaml"
    shipped=$(fulcrum_auc "$tmp/$m.yaml")
    line="| $m | $s | $torch_auc | $shipped | $(awk -v a="$torch_auc" -v b="$shipped" 'BEGIN{printf "%.4f", a-b}') |"
    for v in $variants; do
      spec "$m" "$v" "$tmp/$m-$v.yaml"
      sed -i "\$a seed: $((s + 1))" "$tmp/$m-$v.yaml"
      a=$(fulcrum_auc "$tmp/$m-$v.yaml")
      line+=" $a | $(awk -v a="$torch_auc" -v b="$a" 'BEGIN{printf "%.4f", a-b}') |"
    done
    echo "$line"
  done
done
