#!/usr/bin/env python3
"""Compares one MLP step's gradients from fulcrum-mlp-step (on the CPU and,
where there is one, the GPU) with torch autograd on the same numbers.
Usage: torch_check.py --tool PATH [--dir DIR] [--devices cpu,cuda:0]
Exits non-zero when a gradient differs by more than the tolerance."""
import argparse, os, subprocess, sys, tempfile

import numpy as np
import torch

p = argparse.ArgumentParser()
p.add_argument("--tool", required=True)
p.add_argument("--dir", default=None)
p.add_argument("--devices", default="cpu,cuda:0")
args = p.parse_args()

B, D, H, C = 256, 784, [512, 256], 10
d = args.dir or tempfile.mkdtemp(prefix="fulcrum_torch_")
rng = np.random.default_rng(0)
x = rng.standard_normal((B, D), dtype=np.float32)
y = rng.integers(0, C, B).astype(np.float32)
dims = [D] + H + [C]
ws, bs = [], []
for i in range(len(dims) - 1):
    ws.append((rng.standard_normal((dims[i], dims[i + 1])) * np.sqrt(2 / dims[i])).astype(np.float32))
    bs.append((rng.standard_normal(dims[i + 1]) * 0.1).astype(np.float32))
x.tofile(f"{d}/x.f32"); y.tofile(f"{d}/y.f32")
for i, (w, b) in enumerate(zip(ws, bs)):
    w.tofile(f"{d}/w{i}.f32"); b.tofile(f"{d}/b{i}.f32")

failures = 0
for act in ["relu", "gelu"]:
    with open(f"{d}/config.txt", "w") as f:
        f.write(f"{B} {D} {' '.join(map(str, H))} {C} {act} fp32\n")
    tw = [torch.tensor(w, dtype=torch.float64, requires_grad=True) for w in ws]
    tb = [torch.tensor(b, dtype=torch.float64, requires_grad=True) for b in bs]
    h = torch.tensor(x, dtype=torch.float64)
    for i in range(len(tw)):
        h = h @ tw[i] + tb[i]
        if i + 1 < len(tw):
            h = torch.relu(h) if act == "relu" else torch.nn.functional.gelu(h)
    loss = torch.nn.functional.cross_entropy(h, torch.tensor(y, dtype=torch.long))
    loss.backward()
    for dev in args.devices.split(","):
        r = subprocess.run([args.tool, f"--device={dev}", d], capture_output=True, text=True)
        if r.returncode != 0:
            if dev.startswith("cuda") and "no usable GPU" in r.stderr:
                print(f"SKIPPED: no GPU for {dev}: {r.stderr.strip()}")
                continue
            print(r.stdout, r.stderr); sys.exit(1)
        print(r.stdout.strip())
        tag = "cpu" if dev == "cpu" else "cuda"
        ours_loss = float(open(f"{d}/{tag}.loss.txt").read())
        worst = abs(ours_loss - loss.item()) / abs(loss.item())
        for i in range(len(tw)):
            for name, ref in (("gw", tw[i].grad.numpy()), ("gb", tb[i].grad.numpy())):
                got = np.fromfile(f"{d}/{tag}.{name}{i}.f32", dtype=np.float32).reshape(ref.shape)
                rel = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
                worst = max(worst, rel)
        ok = worst < 1e-4
        failures += not ok
        print(f"{act} on {dev}: loss ours {ours_loss:.6f} torch {loss.item():.6f}; "
              f"worst relative L2 difference over loss and all gradients {worst:.2e} ({'ok' if ok else 'FAIL'})")
sys.exit(1 if failures else 0)
