#!/usr/bin/env python3
"""Compares one model-graph step of fulcrum-graph-step (on the CPU and, where
there is one, the GPU) with torch autograd in float64 on the same batch and
values: the loss and every table's gradient, as relative L2 differences.
The graph is rebuilt in torch from the tool's graph.txt, op by op.
Usage: graph_torch_check.py --tool PATH --spec SPEC [--spec SPEC ...]
       [--devices cpu,cuda:0] [--dir DIR]
Exits non-zero when any difference exceeds 1e-4."""
import argparse, os, subprocess, sys, tempfile

import numpy as np
import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--tool", required=True)
p.add_argument("--spec", action="append", required=True)
p.add_argument("--devices", default="cpu,cuda:0")
p.add_argument("--dir", default=None)
args = p.parse_args()


def fname(table):
    return table.replace("/", "~")


M64 = (1 << 64) - 1


def mix(x):  # splitmix64's finalizer, as worker/models/graph_bags.cc
    x ^= x >> 30
    x = (x * 0xbf58476d1ce4e5b9) & M64
    x ^= x >> 27
    x = (x * 0x94d049bb133111eb) & M64
    return x ^ (x >> 31)


def cross_key(i, j, a, b):
    return mix(mix(a ^ ((i << 48) | (j << 32))) ^ b)


def read_graph(d):
    nodes, tables = [], []
    with open(f"{d}/graph.txt") as f:
        head = f.readline().split()
        meta = {head[i]: int(head[i + 1]) for i in range(0, len(head), 2)}
        for line in f:
            w = line.split()
            if w[0] == "node":
                attrs = dict(kv.split("=", 1) for kv in w[6:])
                nodes.append(dict(name=w[1], op=w[2], rows=int(w[3]), cols=int(w[4]),
                                  inputs=[] if w[5] == "-" else w[5].split(","), **attrs))
            else:
                tables.append(dict(name=w[1], kind=w[2], elements=int(w[3]), dim=int(w[4])))
    return meta, nodes, tables


def torch_step(d, meta, nodes, tables):
    keys = np.fromfile(f"{d}/keys.u64", dtype=np.uint64)
    vals = np.fromfile(f"{d}/values.f32", dtype=np.float32).astype(np.float64)
    offs = np.fromfile(f"{d}/offsets.i32", dtype=np.int32)
    labels = torch.tensor(np.fromfile(f"{d}/labels.f32", dtype=np.float32).astype(np.float64))
    B, D, bits = meta["batch"], meta["dense_keys"], meta["field_bits"]
    params = {}
    for t in tables:
        v = np.fromfile(f"{d}/{fname(t['name'])}.value.f32", dtype=np.float32).astype(np.float64)
        if t["kind"] == "sparse":
            v = v.reshape(-1, t["dim"])
        params[t["name"]] = torch.tensor(v, requires_grad=True)
    shapes = {}
    out = {}
    bags = {}
    for n in nodes:
        name, op, ins = n["name"], n["op"], [out.get(i) for i in n["inputs"]]
        if op == "dense_input":
            x = np.zeros((B, n["cols"]))
            for b in range(B):
                for j in range(offs[b], offs[b + 1]):
                    if keys[j] < D and keys[j] < n["cols"]:
                        x[b, keys[j]] = vals[j]
            y = torch.tensor(x)
        elif op == "sparse_input":
            # per example, per field: the (key, value) pairs
            y = None
            F_ = int(n["fields"])
            bags[name] = []
            for b in range(B):
                if n["by_position"] == "1":  # field f: the f-th key, as it is
                    bags[name].append([[(int(keys[offs[b] + f]), vals[offs[b] + f])] for f in range(F_)])
                    continue
                per_field = [[] for _ in range(F_)]
                for j in range(offs[b], offs[b + 1]):
                    k = int(keys[j])
                    if k >= D:
                        per_field[(k - D) >> bits].append((k, vals[j]))
                bags[name].append(per_field)
        elif op == "field":
            y = None
            bags[name] = [[per_field[int(n["index"])]] for per_field in bags[n["inputs"][0]]]
        elif op == "slice":
            y = ins[0][:, int(n["begin"]):int(n["begin"]) + n["cols"]]
        elif op == "cross":
            y = None
            K = int(n["crossed"])
            bags[name] = []
            for per_field in bags[n["inputs"][0]]:
                crossed = []
                for i in range(K):
                    for j in range(i + 1, K):
                        crossed.append([(cross_key(i, j, a, c), u * v) for a, u in per_field[i] for c, v in per_field[j]])
                bags[name].append(crossed)
        elif op == "embedding":
            rows = params[name]
            tkeys = np.fromfile(f"{d}/{fname(name)}.keys.u64", dtype=np.uint64)
            where = {int(k): i for i, k in enumerate(tkeys)}
            mask = (1 << bits) - 1
            dim = int(n["dim"])
            pooled = []
            for b in range(B):
                per_field = [[rows[where[(k - D) & mask if n["shared"] == "1" else k]] * v for k, v in field]
                             for field in bags[n["inputs"][0]][b]]
                vecs = []
                for items in per_field:
                    if n["fm"] == "1":  # pooling fm: 1/2 (|sum x v|^2 - sum |x v|^2), one value per field
                        s = torch.stack(items).sum(0) if items else torch.zeros(dim, dtype=torch.float64)
                        sq = sum((t * t).sum() for t in items) if items else torch.zeros((), dtype=torch.float64)
                        vecs.append((0.5 * ((s * s).sum() - sq)).reshape(1))
                    elif not items:
                        vecs.append(torch.zeros(dim, dtype=torch.float64))
                    else:
                        s = torch.stack(items).sum(0)
                        vecs.append(s / len(items) if n["mean"] == "1" else s)
                v = torch.stack(vecs)
                pooled.append(v.sum(0, keepdim=True) if n["sum_fields"] == "1" else v)
            y = torch.stack(pooled).reshape(B, -1)
        elif op == "linear":
            w = params[name + ".weight"].reshape(ins[0].shape[1], n["cols"])
            y = ins[0] @ w + params[name + ".bias"]
        elif op == "bias":
            y = ins[0] + params[name]
        elif op == "relu":
            y = torch.relu(ins[0])
        elif op == "gelu":
            y = F.gelu(ins[0])
        elif op == "sigmoid":
            y = torch.sigmoid(ins[0])
        elif op == "tanh":
            y = torch.tanh(ins[0])
        elif op == "concat":
            y = torch.cat(ins, 1)
        elif op == "add":
            y = sum(ins)
        elif op == "mul":
            y = ins[0] * ins[1]
        elif op in ("dot_interaction", "fm"):
            dd = shapes[n["inputs"][0]][1]
            x = torch.cat(ins, 1).reshape(B, -1, dd)
            if op == "fm":
                y = 0.5 * (x.sum(1) ** 2 - (x ** 2).sum(1)).sum(1, keepdim=True)
            else:
                z = torch.bmm(x, x.transpose(1, 2))
                i, j = torch.triu_indices(x.shape[1], x.shape[1], 1)
                y = z[:, i, j]
        elif op == "layer_norm":
            y = F.layer_norm(ins[0], (ins[0].shape[1],), params[name + ".gamma"], params[name + ".beta"],
                             float(n["eps"]))
        elif op == "loss":
            logits = ins[0]
            if n["loss"] == "binary_cross_entropy":
                y = F.binary_cross_entropy_with_logits(logits.reshape(-1), labels)
            elif n["loss"] == "squared_error":
                y = 0.5 * ((logits.reshape(-1) - labels) ** 2).mean()
            else:
                y = F.cross_entropy(logits, labels.long())
        else:
            sys.exit(f"unknown op {op}")
        shapes[name] = (n["rows"], n["cols"])
        out[name] = y
    loss = out[nodes[-1]["name"]]
    loss.backward()
    return loss.item(), {k: v.grad.numpy().reshape(-1) for k, v in params.items()}


failures = 0
for spec in args.spec:
    d = args.dir or tempfile.mkdtemp(prefix="fulcrum_graph_")
    os.makedirs(d, exist_ok=True)
    ran = False
    for dev in args.devices.split(","):
        r = subprocess.run([args.tool, f"--spec={spec}", f"--device={dev}", d], capture_output=True, text=True)
        if r.returncode != 0:
            if dev.startswith("cuda") and "no usable GPU" in r.stderr:
                print(f"SKIPPED: {dev}: {r.stderr.strip()}")
                continue
            print(r.stdout, r.stderr)
            sys.exit(1)
        print(r.stdout.strip())
        if not ran:
            meta, nodes, tables = read_graph(d)
            ref_loss, ref = torch_step(d, meta, nodes, tables)
            ran = True
        tag = "cpu" if dev == "cpu" else "cuda"
        ours = float(open(f"{d}/{tag}.loss.txt").read())
        worst, where = abs(ours - ref_loss) / abs(ref_loss), "loss"
        for t in tables:
            got = np.fromfile(f"{d}/{tag}.{fname(t['name'])}.grad.f32", dtype=np.float32).astype(np.float64)
            want = ref[t["name"]]
            rel = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
            if rel > worst:
                worst, where = rel, t["name"]
        ok = worst < 1e-4
        failures += not ok
        print(f"{os.path.basename(spec)} on {dev}: loss ours {ours:.6f} torch {ref_loss:.6f}; worst relative L2 "
              f"difference over the loss and {len(tables)} gradients {worst:.2e} ({where}) "
              f"({'ok' if ok else 'FAIL'})")
sys.exit(1 if failures else 0)
