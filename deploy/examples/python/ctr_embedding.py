#!/usr/bin/python3
"""A click-through-rate model in one process: an embedding per categorical
field feeding an MLP with the dense features, trained on Criteo-format TSV
(label, 13 integer features, 26 categorical hex ids), as fulcrum-datagen ctr
writes it with a planted model whose best AUC it prints.

Usage: ctr_embedding.py TRAIN TEST [--epochs=N]
  fulcrum-datagen ctr --train=ctr.train --test=ctr.test --train_rows=200000
"""
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

FIELDS, DENSE, BUCKETS, DIM = 26, 13, 1 << 20, 8


def load(path):
    """Labels, log(1 + x) of the integers, and each categorical value hashed
    with its field into one of BUCKETS ids (an empty field is its own id)."""
    rows = [line.rstrip("\n").split("\t") for line in open(path)]
    y = torch.tensor([float(r[0]) for r in rows])
    dense = np.array([[float(v) if v else 0.0 for v in r[1:1 + DENSE]] for r in rows], dtype=np.float32)
    ids = np.array([[(int(v, 16) if v else 0) * FIELDS + f for f, v in enumerate(r[1 + DENSE:])] for r in rows],
                   dtype=np.int64) % BUCKETS
    return torch.from_numpy(np.log1p(np.maximum(dense, 0))), torch.from_numpy(ids), y


def auc(scores, labels):
    """The area under the ROC curve: the chance a positive outranks a negative."""
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=scores.dtype)
    pos = labels.sum()
    return ((ranks[labels == 1].sum() - pos * (pos + 1) / 2) / (pos * (len(labels) - pos))).item()


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(FIELDS * DIM + DENSE, 64)
        self.out = torch.nn.Linear(64, 1)

    def forward(self, vectors, dense):
        return self.out(F.relu(self.hidden(torch.cat([vectors.flatten(1), dense], 1)))).squeeze(1)


def main():
    epochs = int(next((a.split("=")[1] for a in sys.argv if a.startswith("--epochs=")), 1))
    torch.manual_seed(0)
    torch.set_num_threads(2)
    x, ids, y = load(sys.argv[1])
    tx, tids, ty = load(sys.argv[2])
    mlp = Mlp()
    emb = torch.nn.Embedding(BUCKETS, DIM, sparse=True)
    torch.nn.init.zeros_(emb.weight)
    opt = torch.optim.Adam(mlp.parameters(), lr=1e-3)
    emb_opt = torch.optim.Adagrad(emb.parameters(), lr=0.01)
    batch = 256
    for epoch in range(epochs):
        start = time.perf_counter()
        order = torch.randperm(len(y))
        for i in range(0, len(y), batch):
            b = order[i:i + batch]
            opt.zero_grad()
            emb_opt.zero_grad()
            F.binary_cross_entropy_with_logits(mlp(emb(ids[b]), x[b]), y[b]).backward()
            opt.step()
            emb_opt.step()
        seconds = time.perf_counter() - start
        with torch.no_grad():
            logits = mlp(emb(tids), tx)
            loss = F.binary_cross_entropy_with_logits(logits, ty).item()
        print(f"epoch {epoch}: test AUC {auc(logits, ty):.4f}, log loss {loss:.4f}, "
              f"{len(y) / seconds:.0f} samples/s", flush=True)


if __name__ == "__main__":
    main()
