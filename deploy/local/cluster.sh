#!/usr/bin/env bash
# Starts or stops a local Fulcrum cluster on 127.0.0.1: one coordinator, N
# parameter servers and M workers, each logging to its own file under one run
# directory.
#
#   cluster.sh start [--servers N] [--workers M] [--dir RUN_DIR] [--port BASE]
#                    [--metrics-port MBASE] [--bin BUILD_DIR] [--data DATA_DIR] [--slots S]
#                    [--insecure] [--no-shared-memory]
#   cluster.sh stop  [--dir RUN_DIR]
#   cluster.sh status [--dir RUN_DIR]
#   cluster.sh targets [--dir RUN_DIR]
#
# The coordinator listens on BASE (default 7070), servers on BASE+1..BASE+N.
# Prometheus metrics: the coordinator on MBASE (default 9400), servers on
# MBASE+1..MBASE+N, workers after them; --metrics-port 0 lets each process
# take any free port. RUN_DIR/prometheus-targets.json lists every endpoint
# (Prometheus file_sd format, with a `role` label) for
# deploy/prometheus/prometheus-local.yml; `targets` writes it again (after
# restarts under --metrics-port 0, whose ports change). RUN_DIR/prometheus.yml
# is that config for this run: `prometheus --config.file=RUN_DIR/prometheus.yml`.
#
# Every process runs under a supervisor, as Kubernetes or systemd would run
# it: when it exits (a crash, kill -9) it is started again with the same
# flags, after 1 s, doubling up to 30 s while it keeps failing within 60 s of
# starting (Kubernetes' CrashLoopBackOff). A restarted server finds its
# checkpoints in its data directory, a restarted coordinator its state, and
# the coordinator rolls jobs back to their last checkpoint. RUN_DIR/pids
# lists the supervisors; RUN_DIR/run/NAME.pid holds each process's current pid.
# RUN_DIR (default /tmp/fulcrum-cluster) holds logs/, coordinator/ (its
# RocksDB state), server-N/ (each server's checkpoints), pids and `env`,
# which fulcrumctl users source.
#
# Workers reach the servers on this host through shared memory, with gRPC
# only to set it up (docs/wire-protocol.md, "Shared memory");
# --no-shared-memory sends everything over gRPC, as between hosts.
# FULCRUM_SHM_POLL (default 500us) sets how long each side polls for the
# other's next message before it sleeps (--shared_memory_poll; 0 never).
# FULCRUM_PREFETCH_HINTS=true has workers send each next batch's keys ahead
# to servers whose tables keep rows on disk (--prefetch_hints; off unless set).
# Workers take the first GPU, else the CPU (--device=auto);
# FULCRUM_WORKER_DEVICES="cuda:0 cpu" gives worker i the i-th word (workers
# beyond the list keep auto), to mix GPU and CPU workers in one job.
#
# Secure by default: on the first start RUN_DIR/tls/ gets a cluster CA, a
# certificate for every process and a token file (deploy/tls/gen-certs.sh);
# every gRPC endpoint then speaks mutual TLS and the job API takes bearer
# tokens (user "demo", and "admin" who sees every job). Later starts reuse
# them. --insecure runs everything in plaintext without tokens. Submit jobs
# with:
#   set -a; source /tmp/fulcrum-cluster/env; set +a
#   build/server/fulcrumctl submit -f deploy/examples/mnist-mlp.yaml
# The same environment gives Python's fulcrum.Client the token and
# fulcrum.Worker (user processes as workers) worker-0's certificate.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

cmd=${1:-}
shift || true
servers=2 workers=2 dir=/tmp/fulcrum-cluster port=7070 mport=9400 bin="$root/build" slots=1 insecure=0 shm=true
data=${FULCRUM_DATA_DIR:-$HOME/.cache/fulcrum/data}
while (($#)); do
  case "$1" in
    --servers) servers=$2; shift 2 ;;
    --workers) workers=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --metrics-port) mport=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --data) data=$2; shift 2 ;;
    --slots) slots=$2; shift 2 ;;
    --insecure) insecure=1; shift ;;
    --no-shared-memory) shm=false; shift ;;
    *) echo "cluster.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done

# supervise NAME CMD...: runs CMD (output to logs/NAME.log), restarting it
# whenever it exits, until the supervisor gets SIGTERM, which it passes on.
supervise() {
  local name=$1 child=0 stopping=0 backoff=1 restarted=0 started rc
  shift
  trap 'stopping=1; ((child > 0)) && kill -TERM "$child" 2>/dev/null' TERM INT
  while ((!stopping)); do
    started=$SECONDS
    "$@" >>"$dir/logs/$name.log" 2>&1 &
    child=$!
    echo "$child" >"$dir/run/$name.pid"
    # A restarted process may serve metrics on a new port (--metrics-port 0).
    if ((restarted && mport == 0)); then (sleep 2 && write_targets) & fi
    rc=0
    # wait returns early when a trapped signal arrives: wait again for the exit.
    wait "$child" || rc=$?
    while kill -0 "$child" 2>/dev/null; do wait "$child" || rc=$?; done
    ((stopping)) && break
    if ((SECONDS - started >= 60)); then backoff=1; fi
    echo "cluster.sh: $name (pid $child) exited with status $rc; restarting in ${backoff}s" >>"$dir/logs/$name.log"
    echo "$(date -u +%FT%TZ) $name exited with status $rc; restarted after ${backoff}s" >>"$dir/logs/restarts.log"
    sleep "$backoff" &
    wait $! || true
    backoff=$((backoff * 2 > 30 ? 30 : backoff * 2))
    restarted=1
  done
}

# metrics_addr N: the metrics address of the Nth process (0 = coordinator).
metrics_addr() { if ((mport == 0)); then echo 127.0.0.1:0; else echo "127.0.0.1:$((mport + $1))"; fi; }

# Writes RUN_DIR/prometheus-targets.json from where each process said it
# serves metrics (the last "metrics on http://..." line of its log).
write_targets() {
  local out="$dir/prometheus-targets.json" first=1 name addr role
  [[ -f "$dir/pids" ]] || return 0
  {
    echo "["
    while read -r _ name; do
      addr=$(grep -o 'metrics on http://[^/]*' "$dir/logs/$name.log" 2>/dev/null | tail -n 1 | sed 's|.*http://||')
      [[ -n "$addr" ]] || continue
      role=${name%%-*}
      ((first)) || echo ","
      first=0
      printf '  {"targets": ["%s"], "labels": {"role": "%s", "process": "%s"}}' "$addr" "$role" "$name"
    done <"$dir/pids"
    echo
    echo "]"
  } >"$out.tmp"
  mv "$out.tmp" "$out"
}

stop() {
  [[ -f "$dir/pids" ]] || { echo "cluster.sh: no cluster recorded in $dir"; return 0; }
  # Workers first, then servers, then the coordinator; each supervisor
  # passes SIGTERM to its process and does not restart it.
  tac "$dir/pids" | while read -r pid name; do
    if kill -0 "$pid" 2>/dev/null; then kill "$pid" 2>/dev/null || true; fi
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      child=$(cat "$dir/run/$name.pid" 2>/dev/null || true)
      echo "cluster.sh: $name (pid ${child:-?}) ignored SIGTERM; killing it"
      kill -9 "$pid" ${child:+"$child"} 2>/dev/null || true
    fi
  done
  rm -f "$dir/pids" "$dir"/run/*.pid
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
    mkdir -p "$dir/logs" "$dir/run"
    : >"$dir/pids"
    coord="127.0.0.1:$port"
    # tls NAME: the flags that give process NAME its certificate.
    if ((insecure)); then
      tls() { echo --insecure; }
      coord_auth=()
      ctl_env=(FULCRUM_INSECURE=1)
    else
      # At least one worker certificate: user processes (fulcrum.Worker)
      # present worker-0's, named in RUN_DIR/env, even with --workers 0.
      "$root/deploy/tls/gen-certs.sh" "$dir/tls" --servers "$servers" --workers "$((workers > 0 ? workers : 1))" \
        >>"$dir/logs/tls.log"
      tls() { echo "--tls_ca_file=$dir/tls/ca.crt --tls_cert_file=$dir/tls/$1.crt --tls_key_file=$dir/tls/$1.key"; }
      coord_auth=(--token_file="$dir/tls/tokens.csv")
      ctl_env=(FULCRUM_TLS_CA_FILE="$dir/tls/ca.crt" FULCRUM_TOKEN_FILE="$dir/tls/token-demo"
               FULCRUM_TLS_CERT_FILE="$dir/tls/worker-0.crt" FULCRUM_TLS_KEY_FILE="$dir/tls/worker-0.key")
    fi
    # shellcheck disable=SC2046  # tls's words are separate flags
    supervise coordinator "$bin/server/fulcrum-coordinator" --listen="$coord" --data_dir="$dir/coordinator" \
      --min_servers="$servers" --metrics_addr="$(metrics_addr 0)" $(tls coordinator) "${coord_auth[@]}" \
      2>>"$dir/logs/supervisors.log" &
    echo "$! coordinator" >>"$dir/pids"
    for ((i = 0; i < servers; i++)); do
      addr="127.0.0.1:$((port + 1 + i))"
      # shellcheck disable=SC2046
      supervise "server-$i" "$bin/server/fulcrum-server" --listen="$addr" --coordinator="$coord" \
        --data_dir="$dir/server-$i" --metrics_addr="$(metrics_addr $((1 + i)))" $(tls "server-$i") \
        --servers_per_host="$servers" \
        --shared_memory_poll="${FULCRUM_SHM_POLL:-500us}" \
        2>>"$dir/logs/supervisors.log" &
      echo "$! server-$i" >>"$dir/pids"
    done
    # Workers share this host's cores with the servers: one compute thread
    # each unless told (FULCRUM_CPU_THREADS). Idle BLAS threads spin, and a
    # spinning thread takes the core a server needs to answer (measured in
    # docs/benchmarks.md).
    read -r -a devices <<<"${FULCRUM_WORKER_DEVICES:-}"
    for ((i = 0; i < workers; i++)); do
      # shellcheck disable=SC2046
      OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} supervise "worker-$i" "$bin/worker/fulcrum-worker" \
        --coordinator="$coord" --data_dir="$data" --slots="$slots" --cpu_threads="${FULCRUM_CPU_THREADS:-1}" \
        --device="${devices[i]:-auto}" \
        --shared_memory="$shm" --shared_memory_poll="${FULCRUM_SHM_POLL:-500us}" \
        --prefetch_hints="${FULCRUM_PREFETCH_HINTS:-false}" \
        --metrics_addr="$(metrics_addr $((1 + servers + i)))" $(tls "worker-$i") 2>>"$dir/logs/supervisors.log" &
      echo "$! worker-$i" >>"$dir/pids"
    done
    printf '%s\n' "FULCRUM_COORDINATOR=$coord" "${ctl_env[@]}" >"$dir/env"
    # Wait until every node registered.
    want=$((servers + workers))
    for _ in $(seq 100); do
      n=$(env "${ctl_env[@]}" "$bin/server/fulcrumctl" --coordinator="$coord" --output=json cluster 2>/dev/null |
        grep -o '"alive":true' | wc -l || true)
      ((n >= want)) && break
      sleep 0.1
    done
    write_targets
    # A Prometheus config for this run: the shipped one, pointed at this
    # run's targets file and the repository's rules.
    sed -e "s|/tmp/fulcrum-cluster/prometheus-targets.json|$dir/prometheus-targets.json|" \
      -e "s|  - rules/|  - $root/deploy/prometheus/rules/|" "$root/deploy/prometheus/prometheus-local.yml" >"$dir/prometheus.yml"
    echo "== cluster up in $dir: coordinator $coord, $servers server(s), $workers worker(s) ($n of $want registered)"
    echo "   metrics: $(grep -c targets "$dir/prometheus-targets.json") endpoints in $dir/prometheus-targets.json;" \
      "scrape them with: prometheus --config.file=$dir/prometheus.yml"
    if ((insecure)); then
      echo "   WARNING: --insecure: plaintext gRPC, no client certificates, no tokens"
    else
      echo "   security: mutual TLS (CA $dir/tls/ca.crt); fulcrumctl as user demo: set -a; source $dir/env; set +a"
    fi
    echo "   logs: $dir/logs/   stop: $0 stop --dir $dir"
    ;;
  stop) stop ;;
  targets) write_targets; cat "$dir/prometheus-targets.json" ;;
  status)
    [[ -f "$dir/env" ]] || { echo "no cluster in $dir"; exit 1; }
    set -a
    # shellcheck disable=SC1091
    source "$dir/env"
    set +a
    "$bin/server/fulcrumctl" cluster ;;
  *) echo "usage: $0 start|stop|status|targets [options]" >&2; exit 2 ;;
esac
