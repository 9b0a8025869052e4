#!/usr/bin/python3
"""The model of ctr_embedding.py trained through Fulcrum by user processes:
the embeddings are a sparse table on the parameter servers (rows created as
ids first appear, Adagrad applied there), the MLP's parameters dense tables
(Adam there). The script is one worker of a `user_workers` job: it submits a
one-worker job itself, or joins $FULCRUM_JOB_ID's (each of its processes
then trains its share of the rows).

Usage: ctr_embedding_fulcrum.py TRAIN TEST [--epochs=N]
against a cluster (deploy/local/cluster.sh start; set -a; source
/tmp/fulcrum-cluster/env; set +a), with build/python on PYTHONPATH.
"""
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import fulcrum
import fulcrum.torch

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
    job = os.environ.get("FULCRUM_JOB_ID") or fulcrum.Client().submit(
        {"name": "ctr-embedding", "user_workers": True, "num_workers": 1, "epochs": epochs,
         "optimizer": {"kind": "adam", "learning_rate": 1e-3}, "consistency": {"model": "asp"}})
    worker = fulcrum.Worker(job)
    emb = fulcrum.torch.Embedding(worker.tables(), job, "ids", DIM,  # torch's Adagrad starts its sums at 0
                                  optimizer={"kind": "adagrad", "learning_rate": 0.01, "initial_accumulator": 1e-10},
                                  initializer="zeros")  # as ctr_embedding.py's torch.nn.init.zeros_
    opt = fulcrum.torch.ParameterServerOptimizer(mlp, worker, extra_tables=[emb.spec()], initializer="torch")
    batch = 256
    for epoch in range(epochs):
        start = time.perf_counter()
        order = torch.randperm(len(y))[worker.rank::worker.world_size]
        for i in range(0, len(order), batch):
            b = order[i:i + batch]
            opt.zero_grad()
            step_loss = F.binary_cross_entropy_with_logits(mlp(emb(ids[b]), x[b]), y[b])
            step_loss.backward()
            opt.step()
            worker.report(opt.clock, epoch, loss=step_loss.item())
        seconds = time.perf_counter() - start
        with torch.no_grad():
            logits = mlp(emb(tids), tx)
            loss = F.binary_cross_entropy_with_logits(logits, ty).item()
        print(f"epoch {epoch}: test AUC {auc(logits, ty):.4f}, log loss {loss:.4f}, "
              f"{len(order) / seconds:.0f} samples/s", flush=True)
        worker.epoch_done(epoch, train_loss=step_loss.item(), test_loss=loss, test_auc=auc(logits, ty),
                          step=opt.clock)
    worker.finish()
    worker.close()


if __name__ == "__main__":
    main()
