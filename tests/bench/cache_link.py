#!/usr/bin/env python3
"""The worker's row cache across a rate-limited link (docs/benchmarks.md,
"The worker's row cache").

One coordinator and one fulcrum-server run in a network namespace of their
own; one fulcrum-worker runs in this one. A veth pair joins them, each end
shaped to --rate with tc tbf, as a NIC between two hosts (no shared memory).
The same FM job on a Zipf click log trains twice on that cluster: without a
cache, then with `cache: {rows: R, max_staleness_steps: S}`, R being --cache
(1%) of the rows the first run created. Both runs use ssp with staleness S,
so the cache is the only difference. Per run: bytes that crossed the link
toward the worker per step (the veth's own counters), samples/s, test AUC
and the cache's hit rate from the worker's metrics.

  sudo tests/bench/cache_link.py [--out DIR] [--bin BUILD] [--rows N] [--vocab V]
                                 [--zipf 1.05] [--dim 16] [--batch B] [--rate 1gbit]

Goals (issue: tables larger than memory): bytes per step cut at least 3x,
samples/s up at least 1.5x, test AUC within 0.002. Exits 1 when one is
missed, 77 when the namespace or link cannot be made (needs root).
"""
import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lifecycle_stream as ls  # noqa: E402  (data generation, logging)


def sh(*argv, check=True):
    return subprocess.run(argv, check=check, capture_output=True, text=True)


class Link:
    """A namespace joined to this one by a shaped veth pair."""

    def __init__(self, rate):
        pid = os.getpid()
        self.ns, self.host_if, self.ns_if = f"fulcrum-cache-{pid}", f"fch{pid}", f"fcn{pid}"
        octet = pid % 250 + 1
        self.host_ip, self.ns_ip = f"10.232.{octet}.1", f"10.232.{octet}.2"
        if sh("ip", "netns", "add", self.ns, check=False).returncode != 0:
            print("SKIP: cache_link.py: cannot create a network namespace (needs root or CAP_NET_ADMIN)",
                  file=sys.stderr)
            sys.exit(77)
        try:
            sh("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            sh("ip", "link", "set", self.ns_if, "netns", self.ns)
            sh("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            sh("ip", "link", "set", self.host_if, "up")
            self.exec("ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if)
            self.exec("ip", "link", "set", self.ns_if, "up")
            self.exec("ip", "link", "set", "lo", "up")
            if rate != "none":
                m = re.fullmatch(r"(\d+)(kbit|mbit|gbit)", rate)
                if not m:
                    raise SystemExit(f"cache_link.py: --rate '{rate}': want e.g. 500mbit, 1gbit or none")
                scale = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}[m[2]]
                burst = max(65536, int(m[1]) * scale // 8 // 500)  # 2 ms of traffic, as shaped_link.sh
                tbf = ["root", "tbf", "rate", rate, "burst", str(burst), "latency", "20ms"]
                sh("tc", "qdisc", "add", "dev", self.host_if, *tbf)
                self.exec("tc", "qdisc", "add", "dev", self.ns_if, *tbf)
        except subprocess.CalledProcessError as e:
            self.close()
            print(f"SKIP: cache_link.py: cannot build the link: {e.stderr.strip()}", file=sys.stderr)
            sys.exit(77)

    def exec(self, *argv):
        return sh("ip", "netns", "exec", self.ns, *argv)

    def received(self):
        """Bytes that reached this side of the link (from the servers)."""
        return int(open(f"/sys/class/net/{self.host_if}/statistics/rx_bytes").read())

    def sent(self):
        return int(open(f"/sys/class/net/{self.host_if}/statistics/tx_bytes").read())

    def close(self):
        sh("ip", "link", "del", self.host_if, check=False)
        sh("ip", "netns", "del", self.ns, check=False)


class Cluster:
    """A coordinator and a server behind the link, a worker on this side."""

    def __init__(self, args, link):
        self.args, self.link, self.procs = args, link, []
        self.dir = os.path.join(args.out, "cluster")
        sh("rm", "-rf", self.dir)
        os.makedirs(os.path.join(self.dir, "logs"))
        b, p, ip = args.bin, args.port, link.ns_ip
        coord = f"{ip}:{p}"
        self.worker_metrics = f"127.0.0.1:{p + 102}"
        self.start("coordinator", ["ip", "netns", "exec", link.ns, f"{b}/server/fulcrum-coordinator",
                                   f"--listen={coord}", f"--data_dir={self.dir}/coordinator", "--min_servers=1",
                                   f"--metrics_addr={ip}:{p + 100}", "--insecure"])
        self.start("server", ["ip", "netns", "exec", link.ns, f"{b}/server/fulcrum-server", f"--listen={ip}:{p + 1}",
                              f"--coordinator={coord}", f"--data_dir={self.dir}/server",
                              f"--metrics_addr={ip}:{p + 101}", "--insecure"])
        self.start("worker", [f"{b}/worker/fulcrum-worker", f"--coordinator={coord}",
                              f"--data_dir={os.path.join(args.out, 'data')}", "--shared_memory=false",
                              f"--cpu_threads={args.cpu_threads}", f"--metrics_addr={self.worker_metrics}",
                              "--insecure"], env={"OPENBLAS_NUM_THREADS": "1"})
        self.env = dict(os.environ, FULCRUM_COORDINATOR=coord, FULCRUM_INSECURE="1")
        deadline = time.time() + 60
        while True:
            r = subprocess.run([f"{b}/server/fulcrumctl", "--output=json", "cluster"], env=self.env,
                               capture_output=True, text=True)
            if r.returncode == 0 and len(json.loads(r.stdout).get("nodes", [])) >= 2:
                break
            if time.time() > deadline:
                raise RuntimeError(f"cluster not up in 60 s: {r.stdout}{r.stderr}")
            time.sleep(0.5)

    def start(self, name, argv, env=None):
        log = open(os.path.join(self.dir, "logs", name + ".log"), "w")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                           env=dict(os.environ, **(env or {}))))

    def ctl(self, *argv):
        r = subprocess.run([f"{self.args.bin}/server/fulcrumctl", *argv], env=self.env, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"fulcrumctl {' '.join(argv)}: {r.stdout}{r.stderr}")
        return r.stdout

    def worker_counter(self, name):
        text = urllib.request.urlopen(f"http://{self.worker_metrics}/metrics", timeout=5).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    def stop(self):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def spec(name, args, cache_rows):
    text = (f"name: {name}\nmodel: {{type: fm, factors: {args.dim}}}\n"
            f"data:\n  train: {{format: criteo, path: stream/train.tsv.gz, hash_bits: 32}}\n"
            f"  test:  {{format: criteo, path: stream/test.tsv.gz, hash_bits: 32}}\n"
            f"optimizer: {{kind: adagrad, learning_rate: 0.03}}\n"
            f"consistency: {{model: ssp, staleness: {args.staleness}}}\n"
            f"num_workers: 1\nbatch_size: {args.batch}\nepochs: 1\n")
    if cache_rows:
        text += f"cache: {{rows: {cache_rows}, max_staleness_steps: {args.staleness}}}\n"
    return text


def run(c, name, text):
    path = os.path.join(c.dir, name + ".yaml")
    with open(path, "w") as f:
        f.write(text)
    rx0, tx0 = c.link.received(), c.link.sent()
    job = c.ctl("submit", "--no_wait", "-f", path).strip().split()[-1]
    ls.log(f"{name}: job {job} submitted")
    hits = misses = 0
    while True:
        st = json.loads(c.ctl("--output=json", "status", job))["status"]
        if st.get("state") in ("SUCCEEDED", "FAILED", "CANCELLED"):
            break
        # The worker reports the cache while it holds the job's assignment.
        try:
            hits = max(hits, c.worker_counter("fulcrum_worker_cache_hits_total"))
            misses = max(misses, c.worker_counter("fulcrum_worker_cache_misses_total"))
        except OSError:
            pass
        time.sleep(1)
    if st.get("state") != "SUCCEEDED":
        raise RuntimeError(f"{name}: {st.get('state')}: {st.get('message', '')}")
    steps = max(1, int(st.get("step", 0)))
    out = {
        "auc": st.get("test_auc", 0),
        "samples_per_second": max([e.get("samples_per_second", 0) for e in st.get("epochs", [])] or [0]),
        "steps": steps,
        "received_per_step": (c.link.received() - rx0) / steps,
        "sent_per_step": (c.link.sent() - tx0) / steps,
        "hits": hits,
        "misses": misses,
        "status": st,
    }
    ls.log(f"{name}: AUC {out['auc']:.4f}, {out['samples_per_second']:,.0f} samples/s, "
           f"{out['received_per_step'] / 2**20:.2f} MiB/step to the worker")
    return out


def oracle(path, batch, cache_rows):
    """The best any cache of cache_rows rows could do on this data: the
    share of each batch's distinct keys that are among the cache_rows most
    frequent ones (the 13 integer features are keys of every batch)."""
    counts, batches = {}, []
    with gzip.open(path, "rt") as f:
        cur = set()
        for i, line in enumerate(f):
            cols = line.rstrip("\n").split("\t")
            for j, v in enumerate(cols[14:40]):
                if v:
                    k = (j, v)
                    counts[k] = counts.get(k, 0) + 1
                    cur.add(k)
            if (i + 1) % batch == 0:
                batches.append(cur)
                cur = set()
    top = set(sorted(counts, key=counts.get, reverse=True)[:max(0, cache_rows - 13)])
    hot = sum(len(b & top) for b in batches) + 13 * len(batches)
    return hot / (sum(len(b) for b in batches) + 13 * len(batches))


def table_rows(st):
    """The largest sparse table's rows at the end of a run."""
    rows = {}
    for t in st.get("sparse_tables", []):
        rows[t.get("table")] = rows.get(t.get("table"), 0) + int(t.get("rows", 0))
    return max(rows.values() or [0])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/fulcrum-cache-link")
    p.add_argument("--bin", default=os.path.join(ROOT, "build"))
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--test_rows", type=int, default=100_000)
    p.add_argument("--vocab", type=int, default=1_000_000)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--drift", type=float, default=0)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--staleness", type=int, default=4)
    p.add_argument("--cache", type=float, default=0.01, help="share of the table's rows cached")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--port", type=int, default=7870)
    p.add_argument("--cpu_threads", type=int, default=1)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    best = ls.generate(args, "stream", args.rows)
    ls.log(f"data: {args.rows:,} rows, vocabulary {args.vocab:,}, Zipf {args.zipf}; planted model's AUC {best:.4f}")
    link = Link(args.rate)
    c = None
    try:
        c = Cluster(args, link)
        base = run(c, "nocache", spec("nocache", args, 0))
        rows = table_rows(base["status"])
        if rows == 0:
            raise RuntimeError("the first run reports no sparse rows (status sparse_tables)")
        cache_rows = max(1, int(rows * args.cache))
        cached = run(c, "cached", spec("cached", args, cache_rows))
    finally:
        if c is not None:
            c.stop()
        link.close()
    ls.log("counting the data's most frequent ids (the bound)")
    share = oracle(os.path.join(args.out, "data", "stream", "train.tsv.gz"), args.batch, cache_rows)
    cut = base["received_per_step"] / max(1.0, cached["received_per_step"])
    speed = cached["samples_per_second"] / max(1e-9, base["samples_per_second"])
    dauc = cached["auc"] - base["auc"]
    hit = cached["hits"] / max(1.0, cached["hits"] + cached["misses"])
    print(f"# link {args.rate}; {args.rows:,} rows, vocabulary {args.vocab:,}, Zipf {args.zipf}, dim {args.dim}, "
          f"batch {args.batch}, ssp staleness {args.staleness}; cache {cache_rows:,} rows per table "
          f"({args.cache:.0%} of {rows:,})")
    print("| run | test AUC | samples/s | bytes to the worker per step | bytes from it per step | cache hit rate |")
    print("|---|---|---|---|---|---|")
    for name, r in (("no cache", base), ("cache", cached)):
        print(f"| {name} | {r['auc']:.4f} | {r['samples_per_second']:,.0f} | {r['received_per_step']:,.0f} "
              f"| {r['sent_per_step']:,.0f} | {'-' if r is base else f'{hit:.1%}'} |")
    print(f"bytes per step cut {cut:.2f}x (goal >= 3), samples/s {speed:.2f}x (goal >= 1.5), "
          f"AUC {dauc:+.4f} (goal within 0.002)")
    rate = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}.get(args.rate[-4:], 0) * float(args.rate[:-4] or 0) / 8 \
        if args.rate != "none" else 0
    for name, r in (("no cache", base), ("cache", cached)):
        down = r["received_per_step"] * r["samples_per_second"] / args.batch
        up = r["sent_per_step"] * r["samples_per_second"] / args.batch
        print(f"{name}: the link carried {down / 1e6:.1f} MB/s to the worker and {up / 1e6:.1f} MB/s from it"
              + (f" ({down / rate:.0%} and {up / rate:.0%} of its rate)" if rate else ""))
    print(f"bound: the {cache_rows:,} most frequent ids are {share:.1%} of a batch's distinct ids, so a cache of "
          f"that size that never refreshed would cut the rows pulled at most {1 / (1 - share):.2f}x; the cache hit "
          f"{hit:.1%} ({hit / share:.2f} of that) while refreshing every row within {args.staleness} steps")
    failures = [m for ok, m in ((cut >= 3, f"bytes cut {cut:.2f}x < 3"), (speed >= 1.5, f"samples/s {speed:.2f}x < 1.5"),
                                (abs(dauc) <= 0.002, f"AUC {dauc:+.4f}")) if not ok]
    if failures:
        print("MISSED: " + "; ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
