#!/usr/bin/env python3
"""Times the MLP step fulcrum-compute-bench times (784-1024-1024-10, ReLU,
batch 4096, softmax cross-entropy, forward + backward, parameters resident on
the GPU) in torch, fp32 and with bf16/fp16 autocast, for docs/benchmarks.md."""
import time

import torch

assert torch.cuda.is_available(), "no GPU"
dev = "cuda"
B, dims = 4096, [784, 1024, 1024, 10]
torch.backends.cuda.matmul.allow_tf32 = False  # our fp32 GEMMs are true fp32
layers = [torch.nn.Linear(dims[i], dims[i + 1]).to(dev) for i in range(len(dims) - 1)]
x = torch.rand(B, 784, device=dev)
y = torch.randint(0, 10, (B,), device=dev)


def step(dtype):
    with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
        h = x
        for i, l in enumerate(layers):
            h = l(h)
            if i + 1 < len(layers):
                h = torch.relu(h)
        loss = torch.nn.functional.cross_entropy(h.float(), y)
    for l in layers:
        l.weight.grad = None
        l.bias.grad = None
    loss.backward()


for name, dtype in (("fp32", None), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
    for _ in range(10):
        step(dtype)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 200
    for _ in range(n):
        step(dtype)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / n
    print(f"torch {torch.__version__} mlp 784-1024-1024-10 batch {B} {name}: {B / dt:,.0f} samples/s ({dt * 1e3:.3f} ms/step)")
