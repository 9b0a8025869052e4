#!/usr/bin/env python3
"""Plain PyTorch's training rate for deploy/examples/ctr-dlrm.yaml's model:
the peer tests/gpu/ctr.sh measures beside Fulcrum in the same run.

The same shapes as the example: 13 dense features into a bottom MLP
13-64-16 (ReLU after each layer), 26 one-hot categorical fields of 16-wide
embeddings, the pairwise dot products of the 27 vectors (upper triangle, 351)
beside the bottom vector into a top MLP 367-64-32-1, binary cross-entropy
with logits, Adagrad at 0.1 over every parameter. An eager training loop
over batches made beforehand on the device, so data never limits it: an
upper bound for a torch user's loop, which also has to load data.
Prints one line: "torch DLRM batch B on DEVICE: N samples/s".
Usage: dlrm_torch.py --batch B [--rows_per_field V] [--steps N] [--device D]"""
import argparse
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, required=True)
p.add_argument("--rows_per_field", type=int, default=100)
p.add_argument("--steps", type=int, default=300)
p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
args = p.parse_args()
FIELDS, DIM = 26, 16
dev = torch.device(args.device)


def mlp(sizes, last_relu):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i + 2 < len(sizes) or last_relu:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


class Dlrm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bottom = mlp([13, 64, DIM], True)
        self.emb = torch.nn.Embedding(FIELDS * args.rows_per_field, DIM)
        n = FIELDS + 1
        self.register_buffer("iu", torch.triu_indices(n, n, 1))
        self.top = mlp([DIM + n * (n - 1) // 2, 64, 32, 1], False)

    def forward(self, dense, ids):
        b = self.bottom(dense)
        x = torch.cat([b.unsqueeze(1), self.emb(ids)], 1)
        z = torch.bmm(x, x.transpose(1, 2))[:, self.iu[0], self.iu[1]]
        return self.top(torch.cat([b, z], 1)).squeeze(1)


torch.manual_seed(0)
model = Dlrm().to(dev)
opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
offsets = torch.arange(FIELDS, device=dev) * args.rows_per_field
batches = []
for _ in range(8):
    dense = torch.rand(args.batch, 13, device=dev)
    ids = torch.randint(0, args.rows_per_field, (args.batch, FIELDS), device=dev) + offsets
    labels = torch.randint(0, 2, (args.batch,), device=dev).float()
    batches.append((dense, ids, labels))


def run(steps):
    for s in range(steps):
        dense, ids, labels = batches[s % len(batches)]
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.binary_cross_entropy_with_logits(model(dense, ids), labels).backward()
        opt.step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


run(30)
start = time.perf_counter()
run(args.steps)
rate = args.steps * args.batch / (time.perf_counter() - start)
print(f"torch DLRM batch {args.batch} on {args.device}: {rate:.0f} samples/s")
