#!/usr/bin/env python3
"""The training step fulcrum-compute-bench times, in plain PyTorch: its
torch column. A dense model of the given widths (ReLU between layers;
"784,10" is softmax regression), softmax cross-entropy, forward and
backward, parameters resident on the device, inputs in MNIST's form (bytes
decoded to floats on the device), fp32 or bf16/fp16 autocast. Prints one
line, "samples_per_second N". Exits 3 when torch (or the asked device) is
missing.

Usage: torch_step.py --device cpu|cuda --dims 784,1024,1024,10 --batch 4096
                     [--precision fp32|bf16|fp16] [--steps 200] [--threads N]
"""
import argparse
import sys
import time

try:
    import torch
except ImportError:
    print("no torch: python3 cannot import torch", file=sys.stderr)
    sys.exit(3)

p = argparse.ArgumentParser()
p.add_argument("--device", default="cpu")
p.add_argument("--dims", default="784,1024,1024,10")
p.add_argument("--batch", type=int, default=4096)
p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
p.add_argument("--steps", type=int, default=200)
p.add_argument("--threads", type=int, default=0)
a = p.parse_args()
if a.device.startswith("cuda") and not torch.cuda.is_available():
    print("no GPU for torch", file=sys.stderr)
    sys.exit(3)
if a.threads > 0:
    torch.set_num_threads(a.threads)
torch.backends.cuda.matmul.allow_tf32 = False  # the bench's fp32 GEMMs are true fp32
dev = torch.device(a.device)
dims = [int(d) for d in a.dims.split(",")]
layers = [torch.nn.Linear(dims[i], dims[i + 1]).to(dev) for i in range(len(dims) - 1)]
n = a.batch * 8
pixels = torch.randint(0, 256, (n, dims[0]), dtype=torch.uint8, device=dev)
labels = torch.randint(0, dims[-1], (n,), device=dev)
dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[a.precision]
use_amp = dtype is not None and dev.type == "cuda"


def step(i):
    lo = (i % 8) * a.batch
    x = pixels[lo:lo + a.batch].float() / 255.0
    y = labels[lo:lo + a.batch]
    with torch.autocast(dev.type, dtype=dtype, enabled=use_amp):
        h = x
        for k, layer in enumerate(layers):
            h = layer(h)
            if k + 1 < len(layers):
                h = torch.relu(h)
        loss = torch.nn.functional.cross_entropy(h.float(), y)
    for layer in layers:
        layer.weight.grad = None
        layer.bias.grad = None
    loss.backward()


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


for i in range(3):
    step(i)
sync()
t0 = time.perf_counter()
for i in range(a.steps):
    step(i)
sync()
dt = (time.perf_counter() - t0) / a.steps
print(f"samples_per_second {a.batch / dt:.0f}")
