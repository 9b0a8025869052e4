#!/usr/bin/python3
"""The CNN of mnist_cnn.py trained through Fulcrum (fulcrum.torch): its
parameters live on parameter servers, whose Adam applies each step.

Usage: mnist_cnn_fulcrum.py DATA_DIR SERVERS [--epochs=N] [--train_examples=N]
SERVERS: host:port of fulcrum-server processes (comma-separated) started
with a static --shard_map and --insecure, e.g. one:
  fulcrum-server --listen=127.0.0.1:7000 --shard_map=127.0.0.1:7000 --insecure
DATA_DIR holds mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte
(deploy/local/fetch_data.sh fetches them). Put build/python on PYTHONPATH.
"""
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import fulcrum
import fulcrum.torch


def idx(path):
    with open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load(data_dir, split):
    x = idx(f"{data_dir}/mnist/{split}-images-idx3-ubyte").astype(np.float32) / 255.0
    y = idx(f"{data_dir}/mnist/{split}-labels-idx1-ubyte").astype(np.int64)
    return torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 5)
        self.conv2 = torch.nn.Conv2d(16, 32, 5)
        self.fc = torch.nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def main():
    data_dir = sys.argv[1]
    epochs = int(next((a.split("=")[1] for a in sys.argv if a.startswith("--epochs=")), 1))
    limit = int(next((a.split("=")[1] for a in sys.argv if a.startswith("--train_examples=")), 60000))
    torch.manual_seed(0)
    torch.set_num_threads(2)
    x, y = load(data_dir, "train")
    x, y = x[:limit], y[:limit]
    tx, ty = load(data_dir, "t10k")
    model = Net()
    tables = fulcrum.Tables(sys.argv[2].split(","), worker_id="mnist-cnn-0")
    opt = fulcrum.torch.ParameterServerOptimizer(model, tables, f"mnist-cnn-{int(time.time())}",
                                                 optimizer={"kind": "adam", "learning_rate": 1e-3},
                                                 initializer="torch")
    batch = 64
    for epoch in range(epochs):
        start = time.perf_counter()
        order = torch.randperm(len(x))
        for i in range(0, len(x), batch):
            b = order[i:i + batch]
            opt.zero_grad()
            F.cross_entropy(model(x[b]), y[b]).backward()
            opt.step()
        seconds = time.perf_counter() - start
        with torch.no_grad():
            accuracy = (model(tx).argmax(1) == ty).float().mean().item()
        print(f"epoch {epoch}: test accuracy {accuracy:.4f}, {len(x) / seconds:.0f} samples/s", flush=True)


if __name__ == "__main__":
    main()
