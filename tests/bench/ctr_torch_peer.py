#!/usr/bin/env python3
"""The torch peer of deploy/examples' click-through models: the same layers,
optimizer, batch and epochs in plain PyTorch on the same Criteo-layout files,
with exact ids (each field's distinct values get a row of their own; no
hashing), for tests/bench/ctr_quality.sh to set Fulcrum's test AUC against.

Models (as deploy/examples/ctr-*.yaml):
  dlrm    bottom MLP 13-64-16 (ReLU after each layer), 26 fields of 16-wide
          embeddings, the pairwise dot products of the 27 vectors (351)
          beside the bottom vector into a top MLP 367-64-32-1
  deepfm  a weight per value (summed) and a linear term of the dense
          features; 8-wide embeddings and a linear 13-8 map of the dense
          features, their FM term; an MLP 13+208-64-32-1; all added
  wide-deep  a weight per value and one per value pair of the first 8
          fields (28 crossed fields, each pair of values its own id), summed,
          and a linear term of the dense features; 8-wide embeddings and an
          MLP 13+208-64-32-1; all added
Embeddings start N(0, 0.01) and Linear layers as torch's defaults; Adagrad
over every parameter, its accumulators starting at --initial_accumulator (the
example's `initial_accumulator`, 0.1 on Fulcrum's servers when not given;
torch's own default is 0).
Dense features are log(1 + max(x, 0)), as Fulcrum's criteo reader reads them.
Prints "torch MODEL: epoch E test AUC A log loss L (N samples/s)".

    ctr_torch_peer.py --train T.tsv.gz --test T.tsv.gz --model dlrm [--lr 0.1] [--batch 128] [--epochs 1] [--seed 0]
                      [--initial_accumulator 0.1]
"""
import argparse
import gzip
import math
import time

import numpy as np
import torch

FIELDS, INTS = 26, 13


def read(path, vocab):
    """Labels, dense features and per-field ids of a Criteo-layout file;
    `vocab` (one dict per field) gives each new value the next id."""
    opener = gzip.open if path.endswith(".gz") else open
    labels, dense, ids = [], [], []
    with opener(path, "rt") as f:
        for line in f:
            cols = line.rstrip("\n").split("\t")
            labels.append(float(cols[0]))
            dense.append([math.log1p(max(int(c), 0)) if c else 0.0 for c in cols[1:1 + INTS]])
            row = []
            for j in range(FIELDS):
                v = vocab[j]
                row.append(v.setdefault(cols[1 + INTS + j], len(v)))
            ids.append(row)
    return (torch.tensor(labels), torch.tensor(dense, dtype=torch.float32), torch.tensor(ids, dtype=torch.int64))


def mlp(sizes, last_relu):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i + 2 < len(sizes) or last_relu:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


class Embeddings(torch.nn.Module):
    """One table per field, rows N(0, 0.01)."""

    def __init__(self, sizes, dim):
        super().__init__()
        # Sparse gradients: Adagrad updates only the rows a batch touched, as
        # the servers do (the same update, in O(batch) time).
        self.tables = torch.nn.ModuleList(torch.nn.Embedding(n, dim, sparse=True) for n in sizes)
        for t in self.tables:
            torch.nn.init.normal_(t.weight, 0, 0.01)

    def forward(self, ids):
        return torch.stack([t(ids[:, j]) for j, t in enumerate(self.tables)], 1)  # B x F x dim


class Dlrm(torch.nn.Module):
    def __init__(self, sizes):
        super().__init__()
        self.bottom = mlp([INTS, 64, 16], True)
        self.emb = Embeddings(sizes, 16)
        n = FIELDS + 1
        self.register_buffer("iu", torch.triu_indices(n, n, 1))
        self.top = mlp([16 + n * (n - 1) // 2, 64, 32, 1], False)

    def forward(self, dense, ids):
        b = self.bottom(dense)
        x = torch.cat([b.unsqueeze(1), self.emb(ids)], 1)
        z = torch.bmm(x, x.transpose(1, 2))[:, self.iu[0], self.iu[1]]
        return self.top(torch.cat([b, z], 1)).squeeze(1)


class DeepFm(torch.nn.Module):
    def __init__(self, sizes):
        super().__init__()
        self.first = Embeddings(sizes, 1)
        self.dense_linear = torch.nn.Linear(INTS, 1)
        self.emb = Embeddings(sizes, 8)
        self.dense_vector = torch.nn.Linear(INTS, 8)
        self.deep = mlp([INTS + FIELDS * 8, 64, 32, 1], False)

    def forward(self, dense, ids):
        e = self.emb(ids)
        v = torch.cat([e, self.dense_vector(dense).unsqueeze(1)], 1)
        fm = 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(1)
        deep = self.deep(torch.cat([dense, e.flatten(1)], 1)).squeeze(1)
        return self.first(ids).sum((1, 2)) + self.dense_linear(dense).squeeze(1) + fm + deep


CROSSED = 8


def cross_ids(train_ids, test_ids):
    """The 28 crossed fields of the first CROSSED fields: each distinct pair
    of values (in training or test rows) gets an id of its own."""
    both = torch.cat([train_ids, test_ids]).numpy()
    cols, sizes = [], []
    for a in range(CROSSED):
        for b in range(a + 1, CROSSED):
            key = both[:, a] * (int(both[:, b].max()) + 1) + both[:, b]
            uniq, inverse = np.unique(key, return_inverse=True)
            cols.append(inverse)
            sizes.append(len(uniq))
    crossed = torch.from_numpy(np.stack(cols, 1).astype(np.int64))
    n = len(train_ids)
    return crossed[:n], crossed[n:], sizes


class WideDeep(torch.nn.Module):
    def __init__(self, sizes, cross_sizes):
        super().__init__()
        self.wide = Embeddings(sizes, 1)
        self.wide_crosses = Embeddings(cross_sizes, 1)
        self.wide_dense = torch.nn.Linear(INTS, 1)
        self.emb = Embeddings(sizes, 8)
        self.deep = mlp([INTS + FIELDS * 8, 64, 32, 1], False)

    def forward(self, dense, ids):
        fields, crosses = ids[:, :FIELDS], ids[:, FIELDS:]
        deep = self.deep(torch.cat([dense, self.emb(fields).flatten(1)], 1)).squeeze(1)
        return (self.wide(fields).sum((1, 2)) + self.wide_crosses(crosses).sum((1, 2)) +
                self.wide_dense(dense).squeeze(1) + deep)


def auc(labels, scores):
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    # Ties share their mean rank.
    s = scores[order]
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        if j > i:
            ranks[order[i:j + 1]] = (i + j + 2) / 2
        i = j + 1
    pos = labels == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return (ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--test", required=True)
    p.add_argument("--model", choices=["dlrm", "deepfm", "wide-deep"], required=True)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--initial_accumulator", type=float, default=0.1)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    vocab = [dict() for _ in range(FIELDS)]
    y, x, ids = read(args.train, vocab)
    ty, tx, tids = read(args.test, vocab)  # test values unseen in training get rows that stay as drawn
    sizes = [len(v) for v in vocab]
    if args.model == "wide-deep":
        train_x, test_x, cross_sizes = cross_ids(ids, tids)
        ids, tids = torch.cat([ids, train_x], 1), torch.cat([tids, test_x], 1)
        model = WideDeep(sizes, cross_sizes)
        sizes = sizes + cross_sizes
    else:
        model = (Dlrm if args.model == "dlrm" else DeepFm)(sizes)
    opt = torch.optim.Adagrad(model.parameters(), lr=args.lr, initial_accumulator_value=args.initial_accumulator)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for epoch in range(args.epochs):
        order = torch.randperm(len(y))
        start = time.time()
        model.train()
        for b in range(0, len(y), args.batch):
            i = order[b:b + args.batch]
            opt.zero_grad()
            loss_fn(model(x[i], ids[i]), y[i]).backward()
            opt.step()
        rate = len(y) / (time.time() - start)
        model.eval()
        with torch.no_grad():
            logits = torch.cat([model(tx[b:b + 8192], tids[b:b + 8192]) for b in range(0, len(ty), 8192)])
            logloss = float(loss_fn(logits, ty))
        print(f"torch {args.model}: epoch {epoch} test AUC {auc(ty.numpy(), logits.numpy()):.4f} "
              f"log loss {logloss:.4f} ({rate:.0f} samples/s; {sum(sizes)} rows over {FIELDS} fields)", flush=True)


if __name__ == "__main__":
    main()
