#!/usr/bin/python3
"""A small CNN on MNIST in one process (plain PyTorch, CPU).

Usage: mnist_cnn.py DATA_DIR [--epochs=N] [--train_examples=N]
DATA_DIR holds mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte
(deploy/local/fetch_data.sh fetches them). mnist_cnn_fulcrum.py is the same
script training through Fulcrum's parameter servers.
"""
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F


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
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
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
