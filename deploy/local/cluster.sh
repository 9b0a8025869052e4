#!/usr/bin/env bash
# Starts or stops a local Fulcrum cluster on 127.0.0.1: one coordinator, N
# parameter servers and M workers, each logging to its own file under one run
# directory.
#
#   cluster.sh start [--servers N] [--workers M] [--dir RUN_DIR] [--port BASE]
#                    [--bin BUILD_DIR] [--data DATA_DIR] [--slots S]
#   cluster.sh stop  [--dir RUN_DIR]
#   cluster.sh status [--dir RUN_DIR]
#
# The coordinator listens on BASE (default 7070), servers on BASE+1..BASE+N.
# RUN_DIR (default /tmp/fulcrum-cluster) holds logs/, coordinator/ (its
# RocksDB state), server-N/ (each server's checkpoints), pids and `env` (FULCRUM_COORDINATOR=...), which fulcrumctl
# users can source. Submit jobs with:
#   build/server/fulcrumctl --coordinator=127.0.0.1:7070 submit -f deploy/examples/mnist-mlp.yaml
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

cmd=${1:-}
shift || true
servers=2 workers=2 dir=/tmp/fulcrum-cluster port=7070 bin="$root/build" slots=1
data=${FULCRUM_DATA_DIR:-$HOME/.cache/fulcrum/data}
while (($#)); do
  case "$1" in
    --servers) servers=$2; shift 2 ;;
    --workers) workers=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --data) data=$2; shift 2 ;;
    --slots) slots=$2; shift 2 ;;
    *) echo "cluster.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done

stop() {
  [[ -f "$dir/pids" ]] || { echo "cluster.sh: no cluster recorded in $dir"; return 0; }
  # Workers first, then servers, then the coordinator.
  tac "$dir/pids" | while read -r pid name; do
    if kill -0 "$pid" 2>/dev/null; then kill "$pid" 2>/dev/null || true; fi
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "cluster.sh: $name ($pid) ignored SIGTERM; killing it"
      kill -9 "$pid" 2>/dev/null || true
    fi
  done
  rm -f "$dir/pids"
  echo "== cluster in $dir stopped"
}

case "$cmd" in
  start)
    for b in server/fulcrum-coordinator server/fulcrum-server worker/fulcrum-worker; do
      [[ -x "$bin/$b" ]] || { echo "cluster.sh: $bin/$b is missing; build first (tests/run.sh or cmake --build build)" >&2; exit 1; }
    done
    if [[ -f "$dir/pids" ]]; then
      echo "cluster.sh: a cluster is already recorded in $dir; run '$0 stop --dir $dir' first" >&2
      exit 1
    fi
    mkdir -p "$dir/logs"
    : >"$dir/pids"
    coord="127.0.0.1:$port"
    "$bin/server/fulcrum-coordinator" --listen="$coord" --data_dir="$dir/coordinator" \
      --min_servers="$servers" >"$dir/logs/coordinator.log" 2>&1 &
    echo "$! coordinator" >>"$dir/pids"
    for ((i = 0; i < servers; i++)); do
      addr="127.0.0.1:$((port + 1 + i))"
      "$bin/server/fulcrum-server" --listen="$addr" --coordinator="$coord" --data_dir="$dir/server-$i" \
        >"$dir/logs/server-$i.log" 2>&1 &
      echo "$! server-$i" >>"$dir/pids"
    done
    # Workers share this host's cores with the servers: one compute thread
    # each unless told (FULCRUM_CPU_THREADS). Idle BLAS threads spin, and a
    # spinning thread takes the core a server needs to answer (measured in
    # docs/benchmarks.md).
    for ((i = 0; i < workers; i++)); do
      OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} "$bin/worker/fulcrum-worker" --coordinator="$coord" \
        --data_dir="$data" --slots="$slots" --cpu_threads="${FULCRUM_CPU_THREADS:-1}" \
        >"$dir/logs/worker-$i.log" 2>&1 &
      echo "$! worker-$i" >>"$dir/pids"
    done
    echo "FULCRUM_COORDINATOR=$coord" >"$dir/env"
    # Wait until every node registered.
    want=$((servers + workers))
    for _ in $(seq 100); do
      n=$("$bin/server/fulcrumctl" --coordinator="$coord" --output=json cluster 2>/dev/null |
        grep -o '"alive":true' | wc -l || true)
      ((n >= want)) && break
      sleep 0.1
    done
    echo "== cluster up in $dir: coordinator $coord, $servers server(s), $workers worker(s) ($n of $want registered)"
    echo "   logs: $dir/logs/   stop: $0 stop --dir $dir"
    ;;
  stop) stop ;;
  status)
    [[ -f "$dir/env" ]] || { echo "no cluster in $dir"; exit 1; }
    # shellcheck disable=SC1091
    source "$dir/env"
    "$bin/server/fulcrumctl" --coordinator="$FULCRUM_COORDINATOR" cluster ;;
  *) echo "usage: $0 start|stop|status [options]" >&2; exit 2 ;;
esac
