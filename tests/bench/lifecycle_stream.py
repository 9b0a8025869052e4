#!/usr/bin/env python3
"""A click log whose ids never stop arriving, trained under a row cap.

Generates a log with fulcrum-datagen ctr --drift (new ids every row, an id's
popularity fading with its age), then on a local cluster (deploy/local/
cluster.sh, 2 servers, 1 worker, plaintext) trains a factorization machine on
it, one epoch, testing on the rows that follow the log (its last segment):

  uncapped   every id a row, kept: the rows the job needs (R) and its AUC;
  capped     each table capped at --cap_fraction of R (eviction --policy, LRU by default), a cut
             every --cut_seconds: runs to the end; each server's resident
             memory sampled every --sample_seconds, and its peak (VmHWM,
             cuts included) checked against its cap: what its tables
             count at the cap plus what the process held before the job,
             plus 20%;
  spilled    with --spill: each table's rows past --cap_fraction of R (in
             bytes of the "factors" table's rows) moved to the servers'
             disks (storage: {memory_bytes, spill: rocksdb}) instead of
             dropped: its AUC and samples/s against uncapped, and each
             server's peak resident memory against what its tables count
             in memory plus RocksDB's own memory for the tier (memtables,
             indexes, filters, block cache) plus the process before the
             job, plus 20%; with --hints_too, the spilled run again
             with the worker's prefetch hints on (FULCRUM_PREFETCH_HINTS=
             true): samples/s with hints against without, and the rows
             hints read ahead;
  admission  on a shorter log (--admission_rows): min_count 1, 2, 5 and 10,
             no cap: table memory, rejected gradient rows, the sketch's
             false admissions against exact counts (keys made rows whose
             count in the log is below min_count, over the keys below it),
             and AUC; with --sketch_widths, min_count 2, 5 and 10 again with
             wider sketches.

Prints Markdown tables (docs/benchmarks.md, "Embeddings without end") and
writes each run's samples to OUT/<run>.tsv. Exits 1 when the capped run
fails, goes over its memory bound, or loses more than 0.003 AUC, or the
spilled run fails, goes over its bound, loses more than 0.002 AUC or runs
at under 0.5x the uncapped run's samples/s.

  tests/bench/lifecycle_stream.py [--rows 20000000] [--drift 0.4] [--vocab 1000000]
      [--admission_rows 4000000] [--out /tmp/fulcrum-lifecycle-stream] [--bin build]
      [--spill --zipf 1.05 --dim 16 --factors 16 --skip capped,admission]
"""
import argparse
import gzip
import json
import os
import re
import struct
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MASK = (1 << 64) - 1


def mix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def criteo_key(field, value, hash_bits):
    # worker/data/readers.cc, CriteoKey
    buckets = 1 << hash_bits
    return 13 + field * buckets + (mix64(value ^ ((0x9E3779B97F4A7C15 * (field + 1)) & MASK)) & (buckets - 1))


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def generate(args, name, rows):
    d = os.path.join(args.out, "data", name)
    done = os.path.join(d, "planted.txt")
    params = f"rows={rows} test={args.test_rows} drift={args.drift} vocab={args.vocab} zipf={args.zipf} dim={args.dim}"
    if os.path.exists(done) and open(done).read().startswith(params):
        return float(re.search(r"best AUC ([0-9.]+)", open(done).read())[1])
    os.makedirs(d, exist_ok=True)
    log(f"generating {name}: {params}")
    r = subprocess.run([os.path.join(args.bin, "worker/fulcrum-datagen"), "ctr", f"--train={d}/train.tsv.gz",
                        f"--test={d}/test.tsv.gz", f"--train_rows={rows}", f"--test_rows={args.test_rows}",
                        f"--vocab={args.vocab}", f"--drift={args.drift}"]
                       + ([f"--zipf={args.zipf}"] if args.zipf else []) + ([f"--dim={args.dim}"] if args.dim else []),
                       capture_output=True, text=True, check=True)
    report = r.stdout + r.stderr
    with open(done, "w") as f:
        f.write(params + "\n" + report)
    return float(re.search(r"best AUC ([0-9.]+)", report)[1])


def spec(name, data, batch, lifecycle="", cut_seconds=0, factors=4):
    model = f"{{type: fm, factors: {factors}" + (", " + lifecycle if lifecycle else "") + "}"
    return (f"name: {name}\nmodel: {model}\n"
            f"data:\n  train: {{format: criteo, path: {data}/train.tsv.gz, hash_bits: 32}}\n"
            f"  test:  {{format: criteo, path: {data}/test.tsv.gz, hash_bits: 32}}\n"
            f"optimizer: {{kind: adagrad, learning_rate: 0.03}}\nnum_workers: 1\nbatch_size: {batch}\nepochs: 1\n"
            + (f"checkpoint: {{every_seconds: {cut_seconds}}}\n" if cut_seconds else ""))


def rss(pid, field="VmRSS"):
    """Resident bytes now (VmRSS), or the most the process ever held (VmHWM)."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def scrape(port):
    """fulcrum_server_sparse_{rows,table_bytes} of the model's "factors" table
    (its "linear" table holds the same keys, 1 float each) and the server's
    counted sparse bytes over both."""
    rows = table = 0
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return 0, 0
    for line in text.splitlines():
        if line.startswith("fulcrum_server_sparse_rows{") and 'table="factors"' in line:
            rows += float(line.rsplit(" ", 1)[1])
        elif line.startswith("fulcrum_server_sparse_table_bytes{"):
            table += float(line.rsplit(" ", 1)[1])
    return int(rows), int(table)


def scrape_gauge(port, name):
    """The sum of a metric's series on one server (0 when it has none)."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return 0
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + " ") or line.startswith(name + "{")))


class Cluster:
    def __init__(self, args, run, env=None):
        self.args, self.dir = args, os.path.join(args.out, "runs", run)
        subprocess.run(["rm", "-rf", self.dir], check=True)
        subprocess.run([os.path.join(ROOT, "deploy/local/cluster.sh"), "start", "--servers", "2", "--workers", "1",
                        "--dir", self.dir, "--port", str(args.port), "--metrics-port", str(args.port + 100), "--bin",
                        args.bin, "--data", os.path.join(args.out, "data"), "--insecure"],
                       check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, **(env or {})))
        self.env = dict(os.environ)
        for line in open(os.path.join(self.dir, "env")):
            k, _, v = line.strip().partition("=")
            self.env[k] = v

    def ctl(self, *argv, check=True):
        r = subprocess.run([os.path.join(self.args.bin, "server/fulcrumctl"), *argv], env=self.env,
                           capture_output=True, text=True)
        if check and r.returncode != 0:
            raise RuntimeError(f"fulcrumctl {' '.join(argv)}: {r.stdout}{r.stderr}")
        return r.stdout

    def server_pid(self, i):
        return int(open(os.path.join(self.dir, "run", f"server-{i}.pid")).read())

    def stop(self):
        subprocess.run([os.path.join(ROOT, "deploy/local/cluster.sh"), "stop", "--dir", self.dir],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def train(args, run, text, samples=None, env=None):
    """Runs one job to its end; returns its status and the samples taken."""
    c = Cluster(args, run, env)
    try:
        path = os.path.join(c.dir, run + ".yaml")
        with open(path, "w") as f:
            f.write(text)
        base = [rss(c.server_pid(i)) for i in range(2)]
        job = c.ctl("submit", "--no_wait", "-f", path).strip().split()[-1]
        log(f"{run}: job {job} submitted")
        rows, t0, last = [], time.time(), 0
        while True:
            st = json.loads(c.ctl("--output=json", "status", job))["status"]
            now = time.time() - t0
            sample = [now, st.get("step", 0)]
            for i in range(2):
                r, b = scrape(args.port + 100 + 1 + i)
                sample += [rss(c.server_pid(i)), r, b]
            sample += [scrape_gauge(args.port + 100 + 1 + i, "fulcrum_server_cold_tier_memory_bytes") for i in range(2)]
            rows.append(sample)
            if now - last >= 60:
                last = now
                log(f"{run}: {now:.0f} s, step {st.get('step', 0)}, rows {sample[3] + sample[6]}, "
                    f"RSS {sample[2] / 2**20:.0f} + {sample[5] / 2**20:.0f} MiB")
            if st.get("state") in ("SUCCEEDED", "FAILED", "CANCELLED"):
                break
            time.sleep(args.sample_seconds)
        # The peak between samples too (a cut lasts seconds): the kernel's
        # high-water mark of each server's resident memory.
        peak = [rss(c.server_pid(i), "VmHWM") for i in range(2)]
        with open(os.path.join(args.out, run + ".tsv"), "w") as f:
            f.write("seconds\tstep\trss0\trows0\ttable_bytes0\trss1\trows1\ttable_bytes1\ttier_memory0\ttier_memory1\n")
            for s in rows:
                f.write("\t".join(str(round(x, 1) if isinstance(x, float) else x) for x in s) + "\n")
        export = None
        if st.get("state") == "SUCCEEDED" and args.export:
            export = os.path.join(c.dir, "final.safetensors")
            c.ctl("export", job, "-o", export)
        return st, rows, base, export, peak
    finally:
        c.stop()


CUT_LINE = re.compile(r"cut (\d+) at step \d+, (\d+) bytes in \d+ records \((\d+) sparse rows, (\d+) of them left on "
                      r"disk in \S+\); waited [0-9.e-]+ s for the step, paused training ([0-9.e-]+) s, written in "
                      r"([0-9.e-]+) s")
LINK_LINE = re.compile(r"cold tier cut into \S+ in ([0-9.e-]+) s")


def cuts_of(args, run):
    """Each cut the run's servers logged: (bytes of its records, its sparse rows, those left on disk in its cut of
    the cold tier, seconds training paused, seconds writing), and the seconds each cut of a cold tier took."""
    out, links = [], []
    for i in range(2):
        try:
            text = open(os.path.join(args.out, "runs", run, "logs", f"server-{i}.log")).read()
        except OSError:
            continue
        out += [(int(m.group(2)), int(m.group(3)), int(m.group(4)), float(m.group(5)), float(m.group(6)))
                for m in CUT_LINE.finditer(text)]
        links += [float(m.group(1)) for m in LINK_LINE.finditer(text)]
    return out, links


def safetensor_keys(path, table):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        t = header[table + ".keys"]
        a, b = t["data_offsets"]
        f.seek(8 + n + a)
        data = f.read(b - a)
    return struct.unpack(f"<{len(data) // 8}q", data)


def exact_counts(path):
    """Rows each categorical key (hash_bits 32) occurs in."""
    counts = {}
    with gzip.open(path, "rt") as f:
        for line in f:
            cols = line.rstrip("\n").split("\t")
            for j, v in enumerate(cols[14:40]):
                if v:
                    k = (j, v)
                    counts[k] = counts.get(k, 0) + 1
    return {criteo_key(j, int(v, 16), 32): n for (j, v), n in counts.items()}


def signed(k):
    return k - (1 << 64) if k >= 1 << 63 else k


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=20_000_000)
    p.add_argument("--test_rows", type=int, default=200_000)
    p.add_argument("--drift", type=float, default=0.4)
    p.add_argument("--vocab", type=int, default=1_000_000)
    p.add_argument("--cap_fraction", type=float, default=0.25)
    p.add_argument("--policy", default="LRU", choices=["LRU", "LFU"], help="the capped run's eviction policy")
    p.add_argument("--zipf", type=float, default=0, help="the ids' Zipf exponent (0: fulcrum-datagen's default)")
    p.add_argument("--dim", type=int, default=0, help="the planted embeddings' width (0: fulcrum-datagen's default)")
    p.add_argument("--factors", type=int, default=4, help="the FM's factors: the width of its \"factors\" table")
    p.add_argument("--spill", action="store_true", help="also the spilled run: rows past the cap go to disk")
    p.add_argument("--hints_too", action="store_true",
                   help="with --spill: the spilled run again with the workers' prefetch hints")
    p.add_argument("--admission_rows", type=int, default=4_000_000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--sketch_widths", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                   help="admission runs also with these sketch widths (comma-separated; the default width always)")
    p.add_argument("--sample_seconds", type=float, default=5)
    p.add_argument("--cut_seconds", type=int, default=120, help="the capped run takes a checkpoint this often")
    p.add_argument("--port", type=int, default=7470)
    p.add_argument("--bin", default=os.path.join(ROOT, "build"))
    p.add_argument("--out", default="/tmp/fulcrum-lifecycle-stream")
    p.add_argument("--skip", default="", help="runs to skip: uncapped, capped, admission (comma-separated)")
    p.add_argument("--needed_rows", type=int, default=0, help="with --skip uncapped: the rows the job needs")
    args = p.parse_args()
    args.export = False
    os.makedirs(args.out, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    failures = []
    best = generate(args, "stream", args.rows)

    results = {}
    if "uncapped" not in skip:
        st, samples, base, _, peak = train(args, "uncapped", spec("uncapped", "stream", args.batch,
                                                                   factors=args.factors))
        needed = max(s[3] + s[6] for s in samples)
        for t in st.get("sparse_tables", []):
            if t.get("table") == "factors":
                needed = max(needed, int(t.get("rows", 0)))
        results["uncapped"] = (st, samples, base, peak)
        log(f"uncapped: {st.get('state')}, AUC {st.get('test_auc', 0):.4f}, {needed} rows needed")
    else:
        needed = args.needed_rows
    cap = int(needed * args.cap_fraction)
    if "capped" not in skip and cap > 0:
        st, samples, base, _, peak = train(args, "capped", spec("capped", "stream", args.batch,
                                                                 f"eviction: {{policy: {args.policy}, max_rows: {cap}}}",
                                                                 args.cut_seconds, args.factors))
        results["capped"] = (st, samples, base, peak)
    # Adagrad: a row's weights and accumulator.
    budget = cap * args.factors * 2 * 4
    if args.spill and cap > 0:
        st, samples, base, _, peak = train(args, "spilled", spec("spilled", "stream", args.batch,
                                                                 f"eviction: {{policy: {args.policy}}}, storage: "
                                                                 f"{{memory_bytes: {budget}, spill: rocksdb}}",
                                                                 args.cut_seconds, args.factors))
        results["spilled"] = (st, samples, base, peak)
        if args.hints_too:
            st, samples, base, _, peak = train(args, "spilled-hints", spec("spilled-hints", "stream", args.batch,
                                                                           f"eviction: {{policy: {args.policy}}}, storage: "
                                                                           f"{{memory_bytes: {budget}, spill: rocksdb}}",
                                                                           args.cut_seconds, args.factors),
                                               env={"FULCRUM_PREFETCH_HINTS": "true"})
            results["spilled-hints"] = (st, samples, base, peak)

    print(f"\n## A click log without end: {args.rows:,} rows, drift {args.drift} new ids a row in the largest field, "
          f"vocabulary {args.vocab:,}; test on the {args.test_rows:,} rows that follow (planted best AUC {best:.4f})\n")
    print("| run | state | rows held at the end (in memory) | admitted | evicted (cap) | on disk | test AUC | samples/s "
          "| peak RSS server 0 / 1 | memory bound 0 / 1 | within |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    auc, sps = {}, {}
    for run, (st, samples, base, hwm) in results.items():
        t = {k: sum(int(x.get(k, 0)) for x in st.get("sparse_tables", []) if x.get("table") == "factors")
             for k in ("rows", "admitted", "evicted_cap", "cold_rows")}
        peak = [max([s[2 + 3 * i] for s in samples] + [hwm[i]]) for i in range(2)]
        # The bound: what the server's tables count at their end (at the cap
        # for the capped run) and RocksDB's memory for a cold tier, plus the
        # process before the job, plus 20%.
        bound = [1.2 * (max(s[4 + 3 * i] for s in samples) + max(s[8 + i] for s in samples) + base[i])
                 for i in range(2)]
        within = all(peak[i] <= bound[i] for i in range(2))
        auc[run] = st.get("test_auc", 0)
        sps[run] = max([e.get("samples_per_second", 0) for e in st.get("epochs", [])] or [0])
        print(f"| {run} | {st.get('state')} | {t['rows']:,} | {t['admitted']:,} | {t['evicted_cap']:,} "
              f"| {t['cold_rows']:,} | {auc[run]:.4f} | {sps[run]:,.0f} | {peak[0] / 2**20:,.0f} / {peak[1] / 2**20:,.0f} MiB "
              f"| {bound[0] / 2**20:,.0f} / {bound[1] / 2**20:,.0f} MiB | {'yes' if within else 'NO'} |")
        if run in ("capped", "spilled", "spilled-hints"):
            if st.get("state") != "SUCCEEDED":
                failures.append(f"{run} run {st.get('state')}: {st.get('message')}")
            if not within:
                failures.append(f"{run} run over its memory bound")
    if "capped" in auc and "uncapped" in auc:
        d = auc["uncapped"] - auc["capped"]
        print(f"\ndistinct ids over the log (the uncapped job's rows of 'factors') {needed:,}; cap {cap:,} "
              f"({args.cap_fraction:.2f} of them); AUC capped - uncapped {-d:+.4f} (goal: within 0.003)")
        if d > 0.003:
            failures.append(f"capped AUC {d:.4f} below uncapped")
    if "spilled" in auc and "uncapped" in auc:
        d = auc["uncapped"] - auc["spilled"]
        ratio = sps["spilled"] / sps["uncapped"] if sps["uncapped"] else 0
        print(f"\nspilled: memory budget {budget:,} bytes a table ({cap:,} rows of 'factors', {args.cap_fraction:.2f} of the "
              f"{needed:,} the job needs); AUC spilled - uncapped {-d:+.4f} (goal: within 0.002); samples/s "
              f"{ratio:.2f}x uncapped (goal: at least 0.5x)")
        if d > 0.002:
            failures.append(f"spilled AUC {d:.4f} below uncapped")
        if ratio < 0.5:
            failures.append(f"spilled run at {ratio:.2f}x the uncapped samples/s")
    for run in ("spilled", "spilled-hints"):
        if run in results:
            st = results[run][0]
            t = {k: sum(int(x.get(k, 0)) for x in st.get("sparse_tables", [])) for k in ("cold_reads", "prefetched",
                                                                                         "promoted", "demoted")}
            print(f"\n{run}: rows read from disk by pulls {t['cold_reads']:,} (kept copies included), read ahead "
                  f"by hints {t['prefetched']:,}; moved there {t['demoted']:,}, back {t['promoted']:,}")
    for run in ("capped", "spilled", "spilled-hints"):
        if run not in results:
            continue
        cuts, links = cuts_of(args, run)
        if not cuts:
            print(f"\n{run}: no cut logged")
            continue
        # A cut that copied the rows it leaves on disk would add each one's
        # key, update count and lifecycle fields (28 bytes) and its floats;
        # the rows on disk here are all 'factors' rows (the "on disk" column).
        copied = sum(c[0] + c[2] * (28 + args.factors * 2 * 4) for c in cuts)
        whole = copied
        print(f"\n{run}: {len(cuts)} cut parts (both servers); records {sum(c[0] for c in cuts) / len(cuts) / 2**20:,.1f} MiB "
              f"a part for {sum(c[1] for c in cuts) / len(cuts):,.0f} rows, {sum(c[2] for c in cuts) / len(cuts):,.0f} of them "
              f"left on disk in the cut's hard links: {sum(c[0] for c in cuts) / whole if whole else 0:.2f} of the bytes "
              f"a cut copying them writes; training paused {max(c[3] for c in cuts):.2f} s at most "
              f"(mean {sum(c[3] for c in cuts) / len(cuts):.2f}), written in {sum(c[4] for c in cuts) / len(cuts):.2f} s "
              f"a part; cold tier cuts {max(links) if links else 0:.2f} s at most")
    if "spilled" in sps and "spilled-hints" in sps and sps["spilled"]:
        print(f"\nprefetch hints: samples/s {sps['spilled-hints']:,.0f} with, {sps['spilled']:,.0f} without: "
              f"{sps['spilled-hints'] / sps['spilled']:.2f}x")
    if "capped" in results:
        samples = results["capped"][1]
        print("\nCapped run, each server's resident memory and counted table bytes (MiB) by minute:\n")
        print("| minute | step | RSS 0 | tables 0 | rows 0 | RSS 1 | tables 1 | rows 1 |\n|---|---|---|---|---|---|---|---|")
        minute = -1
        for s in samples:
            if int(s[0] // 60) != minute:
                minute = int(s[0] // 60)
                print(f"| {minute} | {s[1]} | {s[2] / 2**20:.0f} | {s[4] / 2**20:.0f} | {s[3]:,} | {s[5] / 2**20:.0f} "
                      f"| {s[7] / 2**20:.0f} | {s[6]:,} |")

    if "admission" not in skip:
        best_a = generate(args, "admission", args.admission_rows)
        args.export = True
        counts = exact_counts(os.path.join(args.out, "data", "admission", "train.tsv.gz"))
        print(f"\n## Admission on {args.admission_rows:,} rows of the same stream ({len(counts):,} distinct categorical "
              f"ids; planted best AUC {best_a:.4f}), no cap\n")
        print("| min_count | rows | table bytes | sketch bytes | rejected gradient rows | keys below min_count "
              "| of them made rows (sketch false admissions) | test AUC |")
        print("|---|---|---|---|---|---|---|---|")
        runs = [(m, 0) for m in (1, 2, 5, 10)] + [(m, w) for w in args.sketch_widths for m in (2, 5, 10)]
        for m, w in runs:
            life = (f"admission: {{min_count: {m}" + (f", sketch_width: {w}" if w else "") + "}") if m > 1 else ""
            name = f"admission-{m}" + (f"-w{w}" if w else "")
            st, samples, base, export, _ = train(args, name, spec(name, "admission", args.batch, life))
            t = {k: sum(int(x.get(k, 0)) for x in st.get("sparse_tables", []) if x.get("table") == "factors")
                 for k in ("rows", "bytes", "sketch_bytes", "rejected")}
            below = [k for k, n in counts.items() if n < m]
            false_adm = 0
            if export and below:
                live = set(safetensor_keys(export, "factors"))
                false_adm = sum(1 for k in below if signed(k) in live)
            rate = f"{false_adm:,} ({false_adm / len(below):.4%})" if below else "-"
            print(f"| {m}{f' (sketch_width {w})' if w else ''} | {t['rows']:,} | {t['bytes'] / 2**20:,.1f} MiB | {t['sketch_bytes'] / 2**20:,.1f} MiB "
                  f"| {t['rejected']:,} | {len(below):,} | {rate} | {st.get('test_auc', 0):.4f} |")
    for f in failures:
        print("FAILED: " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
