#!/usr/bin/env bash
# Runs deploy/slurm/fulcrum.sbatch on a one-node Slurm cluster started here:
# munged, slurmctld and slurmd (Debian's slurm-wlm and munge) with their own
# configuration, key, ports and state in a temporary directory. The batch
# job starts the coordinator, two servers and two workers with srun and
# trains the digits softmax job; the test passes when Slurm reports the job
# COMPLETED with exit code 0 and the job's output shows it SUCCEEDED.
#   slurm_test.sh BUILD_DIR DATA_DIR
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=$1 data=$2
for b in munged slurmctld slurmd sbatch sacct scontrol; do
  command -v "$b" >/dev/null || { echo "FAIL: $b is missing (tests/run.sh installs slurm-wlm and munge)"; exit 1; }
done
if [[ $(id -u) -ne 0 ]]; then
  echo "FAIL: the one-node Slurm cluster needs root (slurmd runs jobs as their users)"
  exit 1
fi
work=$(mktemp -d /tmp/fulcrum-slurm-XXXXXX)
chmod 755 "$work"
pids=()
keep=${FULCRUM_KEEP_WORK:-0}
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [[ $keep == 1 ]]; then echo "(work directory kept: $work)"; else rm -rf "$work"; fi
}
trap cleanup EXIT
free_port() { /usr/bin/python3 "$root/tests/testing/free_ports.py" 1; }
host=$(hostname -s)

# munge with its own key and socket.
mkdir -p "$work/munge" && chmod 700 "$work/munge"
dd if=/dev/urandom of="$work/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$work/munge/munge.key"
munged --force --socket="$work/munge/munge.sock" --key-file="$work/munge/munge.key" \
  --pid-file="$work/munge/munged.pid" --log-file="$work/munge/munged.log" --seed-file="$work/munge/seed" \
  --foreground &
pids+=($!)

mkdir -p "$work/state" "$work/spool"
cat >"$work/slurm.conf" <<CONF
ClusterName=fulcrumtest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$work/munge/munge.sock
CredType=cred/munge
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
PlugStackConfig=$work/plugstack.conf
NodeName=$host NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
: >"$work/plugstack.conf"
export SLURM_CONF="$work/slurm.conf"
for _ in $(seq 50); do [[ -S "$work/munge/munge.sock" ]] && break; sleep 0.1; done
slurmctld -D -i -f "$SLURM_CONF" &
pids+=($!)
slurmd -D -f "$SLURM_CONF" -N "$host" &
pids+=($!)
state=
for _ in $(seq 100); do
  state=$(sinfo -h -N -o '%T' 2>/dev/null | head -n 1 || true)
  [[ $state == idle* ]] && break
  sleep 0.2
done
echo "== one-node Slurm cluster on $host: node $state"
[[ $state == idle* ]] || { keep=1; tail -20 "$work"/*.log; echo "FAIL: slurmd did not come up"; exit 1; }

# The batch job, as a user would submit it.
export FULCRUM_JOB_SPEC="$root/deploy/examples/digits-softmax.yaml" FULCRUM_BIN="$build" \
  FULCRUM_DATA="$data" FULCRUM_RUN_DIR="$work/run" FULCRUM_SERVERS_PER_NODE=2 FULCRUM_WORKERS_PER_NODE=2 \
  FULCRUM_METRICS_PORT=0
# fulcrum.sbatch listens on PORT and the next ones (one per server).
FULCRUM_PORT=$(/usr/bin/python3 "$root/tests/testing/free_ports.py" 3)  # the coordinator and 2 servers
export FULCRUM_PORT
export OPENBLAS_NUM_THREADS=1
out="$work/job.out"
rc=0
sbatch --wait --nodes=1 --chdir="$work" --output="$out" --time=15 "$root/deploy/slurm/fulcrum.sbatch" || rc=$?
echo "== sbatch --wait exited with status $rc; the job's output:"
cat "$out" || true
jobstate=$(scontrol -o show job 2>/dev/null | grep -o 'JobState=[A-Z]*' | head -n 1 || true)
echo "== $jobstate"
ok=1
[[ $rc -eq 0 ]] || { echo "FAIL: the batch job exited with $rc"; ok=0; }
grep -q "SUCCEEDED" "$out" || { echo "FAIL: the job's output does not say SUCCEEDED"; ok=0; }
grep -q "fulcrumctl submit exited with status 0" "$out" || { echo "FAIL: fulcrumctl did not exit 0"; ok=0; }
n_logs=$(find "$work/run/logs" -name 'server-*.log' -o -name 'worker-*.log' | wc -l)
[[ $n_logs -eq 4 ]] || { echo "FAIL: expected 4 server/worker step logs, found $n_logs"; ok=0; }
if ((!ok)); then
  keep=1
  for f in "$work"/run/logs/*.log "$work"/slurmd.log "$work"/slurmctld.log; do echo "--- $f"; tail -n 15 "$f"; done
  exit 1
fi
echo "PASS: fulcrum.sbatch trained the job on a one-node Slurm cluster"

# A server that cannot listen (its port is taken) ends its step: the batch
# job says so with the server's log at once, not after its 300 s wait.
FULCRUM_PORT=$(/usr/bin/python3 "$root/tests/testing/free_ports.py" 2)
export FULCRUM_PORT FULCRUM_SERVERS_PER_NODE=1 FULCRUM_WORKERS_PER_NODE=1 FULCRUM_RUN_DIR="$work/run-taken"
/usr/bin/python3 -c 'import socket, sys, time
s = socket.socket(); s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(); time.sleep(600)' $((FULCRUM_PORT + 1)) &
pids+=($!)
out="$work/job-taken.out"
rc=0
start=$SECONDS
sbatch --wait --nodes=1 --chdir="$work" --output="$out" --time=15 "$root/deploy/slurm/fulcrum.sbatch" || rc=$?
took=$((SECONDS - start))
echo "== with the server's port taken: sbatch --wait exited with status $rc after $took s; the job's output:"
cat "$out" || true
ok=1
[[ $rc -ne 0 ]] || { echo "FAIL: the batch job exited 0 though its server could not listen"; ok=0; }
grep -q "fulcrum.sbatch: the servers step ended before the cluster came up" "$out" ||
  { echo "FAIL: the job's output does not name the servers step"; ok=0; }
grep -q "cannot listen on 0.0.0.0:$((FULCRUM_PORT + 1))" "$out" ||
  { echo "FAIL: the job's output does not show the server's error"; ok=0; }
((took < 120)) || { echo "FAIL: it took $took s to give up (the wait is 300 s)"; ok=0; }
((ok)) || { keep=1; exit 1; }
echo "PASS: fulcrum.sbatch gives up at once, with the log, when a server cannot listen"
