#!/usr/bin/python3
"""A real Prometheus scraping a real local Fulcrum cluster that trains.

Starts deploy/local/cluster.sh (coordinator, 2 servers, 2 workers with 2
slots, metrics on free ports listed in prometheus-targets.json), starts the
Debian prometheus with the prometheus.yml cluster.sh writes for the run
(deploy/prometheus/prometheus-local.yml pointed at that targets file and
the repository's rules), runs a BSP job with checkpoints
(MNIST MLP), an SSP job (digits), a binary task (sparse LR on heart_scale,
for the AUC panel) and a regression task (a model graph on digits, for the
RMSE panel) at once, then asks Prometheus's HTTP API:

  - every target is up, and every process exports fulcrum_build_info;
  - every recording rule's series has data;
  - every panel expression of every dashboard in deploy/grafana/dashboards
    returns data over the run (GPU panels, marked "GPU:" in their
    description, are skipped with a message on a host without a GPU).

Also runs `promtool check config` on both scrape configs and `promtool check
rules` on the rule files. Usage: prometheus_test.py SOURCE_DIR BUILD_DIR DATA_DIR
"""
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

SRC, BUILD, DATA = sys.argv[1], sys.argv[2], sys.argv[3]
FAILURES = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        FAILURES.append(what)


def free_ports(n):
    """A base port with n consecutive free ports (tests/testing/free_ports.py)."""
    sys.path.insert(0, os.path.join(SRC, "tests", "testing"))
    from free_ports import free_block  # pylint: disable=import-outside-toplevel
    return free_block(n)


def run(args, **kw):
    print("$ " + " ".join(args), flush=True)
    return subprocess.run(args, text=True, capture_output=True, **kw)


def prom_get(base, path, params):
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=30) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{path} {params}: {body}")
    return body["data"]


def main():
    for tool in ("prometheus", "promtool"):
        if shutil.which(tool) is None:
            print(f"FAIL: {tool} is not installed (tests/run.sh installs Debian's prometheus)")
            return 1
    work = tempfile.mkdtemp(prefix="fulcrum-prom-")
    prom_dir = os.path.join(SRC, "deploy/prometheus")
    run_dir = os.path.join(work, "cluster")

    # --- configs and rules as shipped, with the local targets file moved.
    cfg_dir = os.path.join(work, "prometheus")
    shutil.copytree(prom_dir, cfg_dir)
    local_cfg = os.path.join(cfg_dir, "prometheus-local.yml")
    with open(local_cfg) as f:
        text = f.read()
    check("/tmp/fulcrum-cluster/prometheus-targets.json" in text, "local config reads cluster.sh's default targets file")
    with open(local_cfg, "w") as f:
        f.write(text.replace("/tmp/fulcrum-cluster/prometheus-targets.json",
                             os.path.join(run_dir, "prometheus-targets.json")))
    for cfg in (local_cfg, os.path.join(cfg_dir, "prometheus-k8s.yml")):
        r = run(["promtool", "check", "config", cfg])
        check(r.returncode == 0, f"promtool check config {os.path.basename(cfg)}: {r.stdout.strip()[-200:]} {r.stderr.strip()[-300:]}")
    rules = sorted(glob.glob(os.path.join(prom_dir, "rules/*.yml")))
    r = run(["promtool", "check", "rules"] + rules)
    check(r.returncode == 0, f"promtool check rules: {r.stdout.strip()[-300:]} {r.stderr.strip()[-300:]}")

    # --- the cluster
    base = free_ports(3)
    script = os.path.join(SRC, "deploy/local/cluster.sh")
    env = dict(os.environ, FULCRUM_CPU_THREADS="1")
    # Output to a file: the supervisors it leaves running keep a pipe open.
    start_log = os.path.join(work, "start.log")
    with open(start_log, "w") as out:
        rc = subprocess.call([script, "start", "--servers", "2", "--workers", "2", "--slots", "2", "--dir", run_dir,
                              "--port", str(base), "--metrics-port", "0", "--bin", BUILD, "--data", DATA],
                             env=env, stdout=out, stderr=subprocess.STDOUT, timeout=120)
    print(open(start_log).read(), flush=True)
    if rc != 0:
        print("FAIL: cluster.sh start")
        return 1
    # fulcrumctl's address and credentials (cluster.sh runs with mutual TLS
    # and tokens by default).
    with open(os.path.join(run_dir, "env")) as f:
        for line in f:
            k, _, v = line.strip().partition("=")
            if k:
                os.environ[k] = v
    prom = None
    try:
        with open(os.path.join(run_dir, "prometheus-targets.json")) as f:
            targets = json.load(f)
        roles = sorted(t["labels"]["role"] for t in targets)
        check(roles == ["coordinator", "server", "server", "worker", "worker"], f"targets file lists every process: {roles}")

        # --- Prometheus, with the config cluster.sh wrote for this run
        run_cfg = os.path.join(run_dir, "prometheus.yml")
        r = run(["promtool", "check", "config", run_cfg])
        check(r.returncode == 0, f"promtool check config of cluster.sh's prometheus.yml: {r.stdout.strip()[-200:]} {r.stderr.strip()[-200:]}")
        prom_port = free_ports(1)
        prom_log = open(os.path.join(work, "prometheus.log"), "w")
        prom = subprocess.Popen(["prometheus", f"--config.file={run_cfg}",
                                 f"--storage.tsdb.path={os.path.join(work, 'tsdb')}",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=prom_log, stderr=subprocess.STDOUT)
        api = f"http://127.0.0.1:{prom_port}"
        for _ in range(100):
            try:
                urllib.request.urlopen(api + "/-/ready", timeout=2)
                break
            except Exception:
                time.sleep(0.2)
        t_start = time.time() - 5

        # --- jobs at once: BSP with checkpoints, SSP, a binary task under ASP
        ssp = os.path.join(work, "digits-ssp.yaml")
        with open(ssp, "w") as f:
            f.write("name: digits-ssp\nmodel: {type: softmax}\n"
                    "data:\n  train: {format: csv, path: digits/digits.csv.gz, scale: 0.0625}\n  test_fraction: 0.2\n"
                    "optimizer: {kind: sgd, learning_rate: 0.05}\nconsistency: {model: ssp, staleness: 2}\n"
                    "num_workers: 2\nbatch_size: 8\nepochs: 1000\ncheckpoint: {every_seconds: 3}\n")
        # A binary task, for the panels of AUC and log loss; its 13 features
        # are admitted on their second push and capped at 8 rows, for the
        # panels of the sparse row lifecycle (2 000 epochs: long enough for
        # their rates, a few scrapes apart); its workers cache 4 rows, for the
        # panels of the row cache.
        binary = os.path.join(work, "heart-lr.yaml")
        with open(binary, "w") as f:
            f.write("name: heart-lr\nmodel: {type: sparse_lr, admission: {min_count: 2},"
                    " eviction: {max_rows: 8, ttl_steps: 200}}\n"
                    "data:\n  train: {format: libsvm, path: heart_scale/heart_scale}\n  test_fraction: 0.25\n"
                    "optimizer: {kind: adagrad, learning_rate: 0.5}\nconsistency: {model: asp}\n"
                    "num_workers: 1\nbatch_size: 16\nepochs: 2000\ncache: {rows: 4, max_staleness_steps: 2}\n")
        # The same task with 4 rows' worth of memory and the rest on the
        # servers' disks, for the panels of the cold tier.
        spill = os.path.join(work, "heart-spill.yaml")
        with open(spill, "w") as f:
            f.write("name: heart-spill\nmodel: {type: sparse_lr, storage: {memory_bytes: 32, spill: rocksdb}}\n"
                    "data:\n  train: {format: libsvm, path: heart_scale/heart_scale}\n  test_fraction: 0.25\n"
                    "optimizer: {kind: adagrad, learning_rate: 0.5}\nconsistency: {model: asp}\n"
                    "num_workers: 1\nbatch_size: 16\nepochs: 2000\n")
        # A regression task (a model graph: the digit as a real number), for
        # the RMSE panel.
        regression = os.path.join(work, "digits-regression.yaml")
        with open(regression, "w") as f:
            f.write("name: digits-regression\nmodel:\n  type: graph\n  graph:\n"
                    "    - {name: x, op: dense_input, width: 64}\n"
                    "    - {name: m, op: mlp, inputs: [x], layers: [16, 1]}\n"
                    "    - {name: loss, op: loss, inputs: [m], loss: squared_error}\n"
                    "data:\n  train: {format: csv, path: digits/digits.csv.gz, scale: 0.0625, label_kind: real}\n"
                    "  test_fraction: 0.2\noptimizer: {kind: adam, learning_rate: 0.003}\nconsistency: {model: asp}\n"
                    "num_workers: 1\nbatch_size: 16\nepochs: 40\n")
        ctl = os.path.join(BUILD, "server/fulcrumctl")
        coord = f"--coordinator=127.0.0.1:{base}"
        ids = []
        for spec in (os.path.join(SRC, "deploy/examples/mnist-mlp.yaml"), ssp, binary, spill, regression):
            r = run([ctl, coord, "submit", "-f", spec, "--no_wait"])
            check(r.returncode == 0, f"submit {os.path.basename(spec)}: {r.stdout.strip()} {r.stderr.strip()}")
            ids.append(r.stdout.strip().split()[-1])
        print("jobs:", ids, flush=True)
        deadline = time.time() + 400
        states = {}
        while time.time() < deadline:
            r = run([ctl, coord, "--output=json", "list"])
            try:
                jobs = json.loads(r.stdout).get("jobs", [])
            except ValueError:
                jobs = []
            states = {j["id"]: j.get("status", {}).get("state", "") for j in jobs}
            if all(states.get(i) in ("SUCCEEDED", "FAILED", "CANCELLED") for i in ids):
                break
            time.sleep(2)
        check(all(states.get(i) == "SUCCEEDED" for i in ids), f"every job succeeds: {states}")
        time.sleep(6)  # the last scrapes and rule evaluations
        t_end = time.time()

        # --- targets
        active = prom_get(api, "/api/v1/targets", {"state": "active"})["activeTargets"]
        check(len(active) == 5 and all(t["health"] == "up" for t in active),
              "all 5 targets up: " + ", ".join(f"{t['labels'].get('role')}={t['health']}" for t in active))
        build = prom_get(api, "/api/v1/query", {"query": "count by (component) (fulcrum_build_info)"})["result"]
        comps = {b["metric"].get("component"): int(float(b["value"][1])) for b in build}
        check(comps == {"coordinator": 1, "server": 2, "worker": 2}, f"fulcrum_build_info from every process: {comps}")

        def has_data(expr):
            data = prom_get(api, "/api/v1/query_range",
                            {"query": expr, "start": f"{t_start:.3f}", "end": f"{t_end:.3f}", "step": "2"})
            return sum(len(s["values"]) for s in data["result"])

        # --- recording rules: their recorded series exist
        for path in rules:
            for m in re.finditer(r"^\s*- record: (\S+)", open(path).read(), re.M):
                n = has_data(m.group(1))
                check(n > 0, f"recording rule {m.group(1)}: {n} samples")

        # --- every dashboard panel
        gpu = bool(prom_get(api, "/api/v1/query", {"query": "fulcrum_worker_gpu_utilization_ratio"})["result"])
        job_values = "|".join(ids)
        panels = 0
        for path in sorted(glob.glob(os.path.join(SRC, "deploy/grafana/dashboards/*.json"))):
            dash = json.load(open(path))
            for p in dash["panels"]:
                for t in p.get("targets", []):
                    expr = (t["expr"].replace("$__rate_interval", "30s")
                            .replace('job=~"$job"', f'job=~"{job_values}"')
                            .replace("$instance", ".*"))
                    check("$" not in expr.replace("{{", ""), f"{os.path.basename(path)} '{p['title']}': no unknown variable")
                    if p.get("description", "").startswith("GPU:") and not gpu:
                        print(f"SKIPPED: no GPU: {os.path.basename(path)} '{p['title']}': {expr}")
                        continue
                    n = has_data(expr)
                    panels += 1
                    check(n > 0, f"{os.path.basename(path)} '{p['title']}' {t['refId']}: {n} samples: {expr}")
        check(panels >= 30, f"{panels} panel queries checked")
    finally:
        if prom is not None:
            prom.send_signal(signal.SIGTERM)
            try:
                prom.wait(20)
            except subprocess.TimeoutExpired:
                prom.kill()
        subprocess.call([script, "stop", "--dir", run_dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if FAILURES:
            for log in sorted(glob.glob(os.path.join(run_dir, "logs/*.log"))):
                print(f"--- tail of {log}")
                print("".join(open(log, errors="replace").readlines()[-15:]))
            print(f"(work directory kept: {work})")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if FAILURES:
        print(f"{len(FAILURES)} check(s) failed:")
        for f in FAILURES:
            print("  " + f)
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
