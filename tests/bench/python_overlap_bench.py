#!/usr/bin/python3
"""fulcrum.torch's per-layer pushes against pushing everything in step(),
and both against torch.optim in one process, same run.

An MLP (784-2048-2048-10 by default, 5.8 M parameters) trains on random
batches of 256 with SGD: in one process (torch.optim.SGD), then through one
fulcrum-server process on this host (shared memory) with
ParameterServerOptimizer(overlap=False) and overlap=True, alternating the
two over `--rounds` rounds of `--steps` steps. Prints each one's step time
(the median round) and the ratios.

Usage: python_overlap_bench.py BUILD_DIR [--steps=N] [--rounds=N] [--hidden=N] [--threads=N] [--quick]
(--threads: torch's, default 2)
"""
import os
import statistics
import subprocess
import sys
import tempfile
import time

BUILD = sys.argv[1]
SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(BUILD, "python"))
sys.path.insert(0, os.path.join(SRC, "tests", "testing"))
import torch  # noqa: E402  pylint: disable=wrong-import-position
import fulcrum  # noqa: E402  pylint: disable=wrong-import-position
import fulcrum.torch  # noqa: E402  pylint: disable=wrong-import-position
from free_ports import free_block  # noqa: E402  pylint: disable=wrong-import-position


def flag(name, default):
    return next((type(default)(a.split("=", 1)[1]) for a in sys.argv if a.startswith(f"--{name}=")), default)


QUICK = "--quick" in sys.argv
STEPS = flag("steps", 3 if QUICK else 10)
ROUNDS = flag("rounds", 1 if QUICK else 5)
HIDDEN = flag("hidden", 256 if QUICK else 2048)


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(784, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 10))


def seconds_per_step(model, opt, x, y):
    start = time.perf_counter()
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return (time.perf_counter() - start) / STEPS


def main():
    torch.set_num_threads(flag("threads", 2))
    work = tempfile.mkdtemp(prefix="fulcrum-overlap-bench-")
    base = free_block(2)
    address = f"127.0.0.1:{base}"
    log = os.path.join(work, "server.log")
    server = subprocess.Popen([os.path.join(BUILD, "server/fulcrum-server"), f"--listen={address}",
                               f"--shard_map={address}", f"--metrics_addr=127.0.0.1:{base + 1}", "--insecure"],
                              stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 30
        while "listening on" not in open(log).read():
            if server.poll() is not None or time.time() > deadline:
                sys.exit(f"fulcrum-server did not start: {open(log).read()}")
            time.sleep(0.05)
        x = torch.randn(256, 784)
        y = torch.randint(0, 10, (256,))
        alone_model = mlp()
        alone = torch.optim.SGD(alone_model.parameters(), lr=0.01)
        tables = fulcrum.Tables([address], worker_id="overlap-bench")
        runs = {}
        for overlap in (False, True):
            model = mlp()
            opt = fulcrum.torch.ParameterServerOptimizer(model, tables, f"overlap-bench-{int(overlap)}",
                                                         optimizer={"kind": "sgd", "learning_rate": 0.01},
                                                         overlap=overlap)
            runs[overlap] = (model, opt)
        times = {"alone": [], False: [], True: []}
        seconds_per_step(alone_model, alone, x, y)  # warm up
        for overlap in (False, True):
            seconds_per_step(*runs[overlap], x, y)
        for _ in range(ROUNDS):
            times["alone"].append(seconds_per_step(alone_model, alone, x, y))
            for overlap in (False, True):
                times[overlap].append(seconds_per_step(*runs[overlap], x, y))
        params = sum(p.numel() for p in alone_model.parameters())
        a, s, o = (statistics.median(times[k]) for k in ("alone", False, True))
        print(f"MLP 784-{HIDDEN}-{HIDDEN}-10 ({params / 1e6:.2f} M parameters), batch 256, {STEPS} steps x "
              f"{ROUNDS} rounds, median round")
        print(f"  one process (torch.optim.SGD):           {a * 1e3:8.1f} ms/step")
        print(f"  through Fulcrum, pushed in step():       {s * 1e3:8.1f} ms/step  {a / s:.2f}x one process")
        print(f"  through Fulcrum, pushed during backward: {o * 1e3:8.1f} ms/step  {a / o:.2f}x one process, "
              f"{s / o:.2f}x pushed in step()")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
