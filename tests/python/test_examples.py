"""deploy/examples/python: the MNIST CNN in one process and through Fulcrum
(a fulcrum-server process) on the first 3000 training images, 2 epochs; the
click-through-rate embedding model in one process and as a user_workers job
on the local cluster, on 30000 generated rows, 1 epoch."""
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


def test_the_ctr_embedding_model_through_user_processes_learns_as_it_does_in_one_process(cluster, tmp_path):
    train, test = str(tmp_path / "ctr.train"), str(tmp_path / "ctr.test")
    gen = subprocess.run([os.path.join(BUILD, "worker/fulcrum-datagen"), "ctr", f"--train={train}", f"--test={test}",
                          "--train_rows=30000", "--test_rows=5000", "--threads=2"],
                         capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr
    best = float(re.search(r"best AUC ([0-9.]+)", gen.stdout + gen.stderr).group(1))

    def ctr(script, env):
        r = subprocess.run([sys.executable, os.path.join(SRC, "deploy/examples/python", script), train, test],
                           env=dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"), **env),
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        found = re.findall(r"epoch 0: test AUC ([0-9.]+), log loss ([0-9.]+), ([0-9]+) samples/s", r.stdout)
        assert len(found) == 1, r.stdout
        return float(found[0][0]), r.stderr

    alone, _ = ctr("ctr_embedding.py", {})
    through, log = ctr("ctr_embedding_fulcrum.py", {
        "FULCRUM_COORDINATOR": cluster.coordinator, "FULCRUM_TLS_CA_FILE": cluster.ca_file,
        "FULCRUM_TOKEN_FILE": os.path.join(cluster.tls_dir, "token-demo"),
        "FULCRUM_TLS_CERT_FILE": os.path.join(cluster.tls_dir, "worker-0.crt"),
        "FULCRUM_TLS_KEY_FILE": os.path.join(cluster.tls_dir, "worker-0.key")})
    assert 0.65 <= alone <= best
    assert through >= alone - 0.02, f"through Fulcrum {through}, alone {alone}"
    # The script's job ran on the cluster and recorded what the script printed.
    job_id = re.search(r"for job (\S+)", log).group(1)
    job = cluster.client().status(job_id)
    assert job.status.state == 3, job.status  # SUCCEEDED
    assert abs(job.status.epochs[0].test_auc - through) < 1e-3
