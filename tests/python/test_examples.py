"""deploy/examples/python: the MNIST CNN in one process and through Fulcrum
(a fulcrum-server process) on the first 3000 training images, 2 epochs."""
import os
import re
import subprocess
import sys

SRC = os.environ["FULCRUM_SOURCE_DIR"]
BUILD = os.environ["FULCRUM_BUILD_DIR"]
DATA = os.environ["FULCRUM_TEST_DATA_DIR"]


def run(script, *args):
    env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"))
    r = subprocess.run([sys.executable, os.path.join(SRC, "deploy/examples/python", script), DATA, *args,
                        "--epochs=2", "--train_examples=3000"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    epochs = re.findall(r"epoch (\d): test accuracy ([0-9.]+), ([0-9]+) samples/s", r.stdout)
    assert len(epochs) == 2, r.stdout
    return float(epochs[-1][1])


def test_the_mnist_cnn_through_fulcrum_learns_as_it_does_in_one_process(servers):
    alone = run("mnist_cnn.py")
    through = run("mnist_cnn_fulcrum.py", servers.addresses[0])
    assert alone >= 0.85
    assert through >= alone - 0.03, f"through Fulcrum {through}, alone {alone}"
