#!/usr/bin/python3
"""Push+pull from Python (fulcrum.Tables) against fulcrum-bench, same run.

Starts 1 and then 2 fulcrum-server processes with a static shard map,
pushes and pulls a dense fp32 tensor of each size from Python, one call
after the other, for about `--seconds` each (the best of three windows, as
fulcrum-bench reports), then runs fulcrum-bench
against server processes with the same settings (unary calls, 4
connections per server, 1 MiB messages, no shared memory, one step in
flight) and prints the rates side by side with their ratio.

Usage: python_tables_bench.py BUILD_DIR [--seconds=S] [--quick]
"""
import os
import re
import subprocess
import sys
import tempfile
import time

BUILD = sys.argv[1]
SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(BUILD, "python"))
sys.path.insert(0, os.path.join(SRC, "tests", "testing"))
import numpy as np  # noqa: E402  pylint: disable=wrong-import-position
import fulcrum  # noqa: E402  pylint: disable=wrong-import-position
from free_ports import free_block  # noqa: E402  pylint: disable=wrong-import-position

QUICK = "--quick" in sys.argv
SECONDS = 0.5 if QUICK else 3.0
for a in sys.argv[2:]:
    if a.startswith("--seconds="):
        SECONDS = float(a.split("=", 1)[1])
SIZES = [(1 << 20, "1 MiB")] if QUICK else [(1 << 20, "1 MiB"), (4 << 20, "4 MiB")]


def start_servers(n, work):
    base = free_block(2 * n)
    addresses = [f"127.0.0.1:{base + i}" for i in range(n)]
    procs = []
    for i, address in enumerate(addresses):
        log = os.path.join(work, f"server-{n}-{i}.log")
        procs.append((subprocess.Popen([os.path.join(BUILD, "server/fulcrum-server"), f"--listen={address}",
                                        f"--server_index={i}", "--shard_map=" + ",".join(addresses),
                                        f"--metrics_addr=127.0.0.1:{base + n + i}", "--insecure",
                                        "--shared_memory=false"],
                                       stdout=open(log, "w"), stderr=subprocess.STDOUT), log))
    for p, log in procs:
        deadline = time.time() + 30
        while "listening on" not in open(log).read():
            if p.poll() is not None or time.time() > deadline:
                sys.exit(f"fulcrum-server did not start: {open(log).read()}")
            time.sleep(0.05)
    return addresses, [p for p, _ in procs]


def python_rate(addresses, size_bytes, job_id):
    t = fulcrum.Tables(addresses, worker_id="bench-py", shared_memory=False, channels_per_server=4)
    n = size_bytes // 4
    t.create_job({"job_id": job_id, "num_workers": 1, "consistency": {"model": "asp"},
                  "tables": [{"name": "w", "kind": "dense", "shape": [n],
                              "optimizer": {"kind": "sgd", "learning_rate": 0.001}}]})
    g = np.ones(n, dtype=np.float32)
    w = np.empty(n, dtype=np.float32)
    for step in range(3):  # connect, warm up
        t.push(job_id, step, dense={"w": g})
        t.pull(job_id, step + 1, dense={"w": w})
    # The best of three windows, as fulcrum-bench measures.
    best, step = 0.0, 3
    for _ in range(3):
        done = 0
        start = time.perf_counter()
        while time.perf_counter() - start < SECONDS / 3:
            t.push(job_id, step, dense={"w": g})
            t.pull(job_id, step + 1, dense={"w": w})
            step += 1
            done += 1
        best = max(best, done / (time.perf_counter() - start))
    t.delete_job(job_id)
    return best


def bench_rates():
    """fulcrum-bench's serial fp32 push+pull/s per (servers, tensor)."""
    args = [os.path.join(BUILD, "tests/bench/fulcrum-bench"), "--dense_only", "--dtype=fp32", "--pattern=serial",
            "--transport=unary", "--server_binary=" + os.path.join(BUILD, "server/fulcrum-server"),
            "--max_mib=4"] + (["--quick"] if QUICK else [])
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, check=True).stdout
    rates = {}
    for m in re.finditer(r"^\| dense \| (\d) \| 1 \| ([0-9]+ [KM]iB) \| fp32 \| ([0-9]+) \|", out, re.M):
        rates[(int(m.group(1)), m.group(2))] = float(m.group(3))
    return rates, out


def main():
    work = tempfile.mkdtemp(prefix="fulcrum-pybench-")
    rows = []
    for n in (1, 2):
        addresses, procs = start_servers(n, work)
        try:
            for size, label in SIZES:
                rows.append((n, label, python_rate(addresses, size, f"py-{n}-{size}")))
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)
    rates, out = bench_rates()
    print(f"# Python push+pull (fulcrum.Tables) vs fulcrum-bench on {os.cpu_count()} cores: fp32, unary calls, "
          "4 connections per server, 1 MiB messages, no shared memory, one step in flight, server processes\n")
    print("| servers | tensor | Python push+pull/s | fulcrum-bench push+pull/s | x fulcrum-bench |")
    print("|---|---|---|---|---|")
    ok = True
    for n, label, rate in rows:
        peer = rates.get((n, label))
        if peer is None:
            print(f"| {n} | {label} | {rate:.0f} | - | - |")
            ok = False
            continue
        print(f"| {n} | {label} | {rate:.0f} | {peer:.0f} | {rate / peer:.2f} |")
    if not ok:
        print("fulcrum-bench printed no row for some sizes:\n" + out)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
