"""Local Fulcrum processes for the Python package's tests.

deploy/local/cluster.sh starts a coordinator, a server and a worker with two
slots on free ports of 127.0.0.1, with mutual TLS and bearer tokens as it
always does; the tests reach it as a user would, through the package built
in BUILD_DIR/python. ctest passes the folders in FULCRUM_SOURCE_DIR,
FULCRUM_BUILD_DIR and FULCRUM_TEST_DATA_DIR.
"""
import os
import subprocess
import sys
import tempfile
import time

import pytest

SRC = os.environ["FULCRUM_SOURCE_DIR"]
BUILD = os.environ["FULCRUM_BUILD_DIR"]
DATA = os.environ["FULCRUM_TEST_DATA_DIR"]
sys.path.insert(0, os.path.join(BUILD, "python"))
sys.path.insert(0, os.path.join(SRC, "tests", "testing"))


class Servers:
    """n fulcrum-server processes with a static shard map (no coordinator)."""

    def __init__(self, n, tls_dir=None):
        from free_ports import free_block  # pylint: disable=import-outside-toplevel
        base = free_block(2 * n)
        self.addresses = [f"127.0.0.1:{base + i}" for i in range(n)]
        self.work = tempfile.mkdtemp(prefix="fulcrum-tables-")
        self.procs = []
        for i, address in enumerate(self.addresses):
            if tls_dir:
                tls = [f"--tls_ca_file={tls_dir}/ca.crt", f"--tls_cert_file={tls_dir}/server-{i}.crt",
                       f"--tls_key_file={tls_dir}/server-{i}.key"]
            else:
                tls = ["--insecure"]
            log = open(os.path.join(self.work, f"server-{i}.log"), "w")
            self.procs.append(subprocess.Popen(
                [os.path.join(BUILD, "server/fulcrum-server"), f"--listen={address}", f"--server_index={i}",
                 "--shard_map=" + ",".join(self.addresses), f"--metrics_addr=127.0.0.1:{base + n + i}",
                 f"--data_dir={os.path.join(self.work, f'data-{i}')}"] + tls,
                stdout=log, stderr=subprocess.STDOUT))
        deadline = time.time() + 30
        for i, address in enumerate(self.addresses):
            while "listening on" not in open(os.path.join(self.work, f"server-{i}.log")).read():
                assert self.procs[i].poll() is None, open(os.path.join(self.work, f"server-{i}.log")).read()
                assert time.time() < deadline, f"server {i} did not start"
                time.sleep(0.05)

    def stop(self):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(30)


class LocalCluster:
    def __init__(self, run_dir, env):
        self.run_dir = run_dir
        self.coordinator = env["FULCRUM_COORDINATOR"]
        self.ca_file = env["FULCRUM_TLS_CA_FILE"]
        self.tls_dir = os.path.dirname(self.ca_file)

    def token(self, user):
        with open(os.path.join(self.tls_dir, "token-" + user)) as f:
            return f.read().strip()

    def client(self, user="demo", **kwargs):
        import fulcrum  # pylint: disable=import-outside-toplevel
        kwargs.setdefault("ca_file", self.ca_file)
        if "token" not in kwargs:
            kwargs["token"] = self.token(user)
        return fulcrum.Client(self.coordinator, **kwargs)


@pytest.fixture(scope="session")
def cluster():
    from free_ports import free_block  # pylint: disable=import-outside-toplevel
    work = tempfile.mkdtemp(prefix="fulcrum-python-")
    run_dir = os.path.join(work, "run")
    script = os.path.join(SRC, "deploy/local/cluster.sh")
    env = dict(os.environ, FULCRUM_CPU_THREADS="1")
    log = os.path.join(work, "start.log")
    with open(log, "w") as out:
        rc = subprocess.call([script, "start", "--servers", "1", "--workers", "1", "--slots", "2", "--dir", run_dir,
                              "--port", str(free_block(2)), "--metrics-port", "0", "--bin", BUILD, "--data", DATA],
                             env=env, stdout=out, stderr=subprocess.STDOUT, timeout=120)
    print(open(log).read())
    assert rc == 0, "cluster.sh start failed"
    cluster_env = {}
    with open(os.path.join(run_dir, "env")) as f:
        for line in f:
            k, _, v = line.strip().partition("=")
            if k:
                cluster_env[k] = v
    try:
        yield LocalCluster(run_dir, cluster_env)
    finally:
        with open(os.path.join(work, "stop.log"), "w") as out:
            subprocess.call([script, "stop", "--dir", run_dir], stdout=out, stderr=subprocess.STDOUT, timeout=120)


@pytest.fixture(scope="module")
def servers():
    """Two fulcrum-server processes in plaintext with a static shard map."""
    s = Servers(2)
    yield s
    s.stop()
