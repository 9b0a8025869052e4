#!/usr/bin/env python3
"""The peer for tests/gpu/bench.sh: an MNIST MLP trained in plain PyTorch
with the model, data, optimizer, batch and epochs of a Fulcrum job (784-
HIDDEN-10, ReLU, Adam 1e-3, softmax cross-entropy, a shuffled epoch of
batches, the last short batch kept), the whole dataset on the device as
Fulcrum keeps it, bf16/fp16 through autocast. Prints one line: the median
samples/s over the epochs after the first (all of them when there is one),
the test accuracy after the last, and the training seconds (evaluations not
counted) until the test accuracy first reached --target ("-" if never)."""
import argparse
import contextlib
import gzip
import os
import time

import numpy as np
import torch


def idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        path, opener = path + ".gz", gzip.open
    with opener(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[0:4], "big")
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(magic & 0xFF)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * len(dims)).reshape(dims)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--hidden", default="256")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max_steps", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--target", type=float, default=0.975)
    a = p.parse_args()
    dev = torch.device(a.device)
    torch.manual_seed(7)
    torch.backends.cuda.matmul.allow_tf32 = False  # Fulcrum's fp32 GEMMs are true fp32
    x = torch.from_numpy(idx(os.path.join(a.data, "train-images-idx3-ubyte")).reshape(-1, 784).copy()).to(dev)
    y = torch.from_numpy(idx(os.path.join(a.data, "train-labels-idx1-ubyte")).astype(np.int64)).to(dev)
    tx = torch.from_numpy(idx(os.path.join(a.data, "t10k-images-idx3-ubyte")).reshape(-1, 784).copy()).to(dev)
    ty = torch.from_numpy(idx(os.path.join(a.data, "t10k-labels-idx1-ubyte")).astype(np.int64)).to(dev)
    dims = [784] + [int(h) for h in a.hidden.split(",") if h] + [10]
    layers = []
    for i in range(len(dims) - 1):
        layers.append(torch.nn.Linear(dims[i], dims[i + 1]))
        if i + 2 < len(dims):
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[a.precision]
    scaler = torch.cuda.amp.GradScaler(enabled=a.precision == "fp16" and dev.type == "cuda")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rates = []

    def amp():  # 16-bit compute through autocast; fp32 without it
        return torch.autocast(dev.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()

    def accuracy():
        with torch.no_grad(), amp():
            correct = sum(int((model(tx[k:k + 4096].float() / 255).argmax(1) == ty[k:k + 4096]).sum())
                          for k in range(0, tx.shape[0], 4096))
        return correct / tx.shape[0]

    spent, reach, acc = 0.0, "-", 0.0
    for epoch in range(a.epochs):
        perm = torch.randperm(x.shape[0], device=dev)
        steps = (x.shape[0] + a.batch - 1) // a.batch
        if a.max_steps:
            steps = min(steps, a.max_steps)
        sync()
        t0 = time.perf_counter()
        seen = 0
        for s in range(steps):
            i = perm[s * a.batch:(s + 1) * a.batch]
            xb = x[i].float() / 255
            with amp():
                loss = torch.nn.functional.cross_entropy(model(xb).float(), y[i])
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            seen += i.shape[0]
        sync()
        took = time.perf_counter() - t0
        rates.append(seen / took)
        spent += took
        acc = accuracy()  # after every epoch, as Fulcrum's rank 0 evaluates; not timed
        if reach == "-" and acc >= a.target:
            reach = f"{spent:.2f}"
    later = sorted(rates[1:] or rates)
    print(f"{later[len(later) // 2]:.0f} {acc:.4f} {reach}")


if __name__ == "__main__":
    main()
