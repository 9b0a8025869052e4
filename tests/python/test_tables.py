"""fulcrum.Tables (the C++ client from NumPy) against real fulcrum-server
processes on 127.0.0.1: dense and sparse tables, bf16 on the wire, BSP
between two clients, mutual TLS, and the errors of arrays it cannot use."""
import os
import subprocess
import threading

import grpc
import numpy as np
import pytest

import fulcrum
from conftest import Servers

SRC = os.environ["FULCRUM_SOURCE_DIR"]


def job(job_id, tables, model="asp", workers=1):
    return {"job_id": job_id, "num_workers": workers, "consistency": {"model": model}, "tables": tables}


def dense(name, n, lr=1.0):
    return {"name": name, "kind": "dense", "shape": [n], "chunk_elements": 4096,
            "optimizer": {"kind": "sgd", "learning_rate": lr}}


def sparse(name, dim, lr=1.0):
    return {"name": name, "kind": "sparse", "dim": dim, "optimizer": {"kind": "sgd", "learning_rate": lr}}


def test_dense_and_sparse_tables_round_trip_through_numpy_arrays_in_place(servers):
    t = fulcrum.Tables(servers.addresses, worker_id="py-0")
    t.create_job(job("np", [dense("w", 100_000), dense("b", 10), sparse("emb", 8)]))
    g = np.arange(100_000, dtype=np.float32) % 97
    gb = np.full(10, 0.5, dtype=np.float32)
    keys = np.array([3, 1, 4, 1_000_000_007, 5], dtype=np.uint64)
    rows = np.zeros((5, 8), dtype=np.float32)
    t.pull("np", 0, sparse={"emb": (keys, rows)})  # creates them
    assert not rows.any()  # zeros: the default initializer
    rg = np.arange(40, dtype=np.float32).reshape(5, 8)
    t.push("np", 0, dense={"w": g, "b": gb}, sparse={"emb": (keys, rg)})
    w = np.empty(100_000, dtype=np.float32)
    wb = np.empty(10, dtype=np.float32)
    t.pull("np", 1, dense={"w": w, "b": wb}, sparse={"emb": (keys, rows)})
    np.testing.assert_array_equal(w, -g)  # SGD at rate 1, exact in fp32
    np.testing.assert_array_equal(wb, -gb)
    np.testing.assert_array_equal(rows, -rg)
    stats = [t.stats("np", s) for s in range(2)]
    assert sum(s["sparse_rows"] for s in stats) == 5
    assert all(s["bytes_used"] > 0 for s in stats)  # both servers hold part of the job


def test_bf16_on_the_wire_is_within_its_precision(servers):
    t = fulcrum.Tables(servers.addresses, worker_id="py-bf16", wire_dtype="bf16")
    t.create_job(job("bf16", [dense("w", 5000)]))
    g = (-0.37 * (np.arange(5000) % 101) - 0.01).astype(np.float32)
    t.push("bf16", 0, dense={"w": g})
    w = np.empty(5000, dtype=np.float32)
    t.pull("bf16", 1, dense={"w": w})
    assert np.all(np.abs(w + g) <= np.abs(g) / 128)  # two roundings to bf16
    assert not np.array_equal(w, -g)  # and it was rounded


def test_bsp_combines_two_clients_steps_before_either_pulls(servers):
    clients = [fulcrum.Tables(servers.addresses, worker_id=f"bsp-{r}", rank=r) for r in range(2)]
    clients[0].create_job(job("bsp", [dense("w", 1000)], model="bsp", workers=2))
    clients[1].open_job("bsp")
    out = [np.empty(1000, dtype=np.float32) for _ in range(2)]

    def rank(r):
        clients[r].push("bsp", 0, dense={"w": np.full(1000, r + 1, dtype=np.float32)})
        clients[r].pull("bsp", 1, dense={"w": out[r]})

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    # Both ranks see step 0 of both: SGD at rate 1 on the ranks' mean (1 + 2) / 2.
    for r in range(2):
        np.testing.assert_array_equal(out[r], np.full(1000, -1.5, dtype=np.float32))


def test_arrays_it_cannot_use_in_place_are_refused_naming_the_table(servers):
    t = fulcrum.Tables(servers.addresses, worker_id="py-bad")
    t.create_job(job("bad", [dense("w", 64), sparse("emb", 4)]))
    with pytest.raises(ValueError, match="dense w: expected a float32 array, got float64"):
        t.push("bad", 0, dense={"w": np.zeros(64)})
    with pytest.raises(ValueError, match="dense w: the array must be C-contiguous"):
        t.push("bad", 0, dense={"w": np.zeros(128, dtype=np.float32)[::2]})
    ro = np.zeros(64, dtype=np.float32)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="dense w: the array is read-only"):
        t.pull("bad", 0, dense={"w": ro})
    with pytest.raises(ValueError, match="sparse emb keys: expected a uint64 array"):
        t.pull("bad", 0, sparse={"emb": (np.array([1, 2], dtype=np.int32), np.zeros((2, 4), dtype=np.float32))})
    with pytest.raises(ValueError, match="sparse emb: 6 values are not whole rows for 4 keys"):
        t.pull("bad", 0, sparse={"emb": (np.arange(4, dtype=np.uint64), np.zeros(6, dtype=np.float32))})
    # What only the servers know: the table's size and name.
    with pytest.raises(fulcrum.FulcrumError) as e:
        t.push("bad", 0, dense={"w": np.zeros(10, dtype=np.float32)})
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "w" in e.value.message
    with pytest.raises(fulcrum.FulcrumError) as e:
        t.push("bad", 0, dense={"nope": np.zeros(10, dtype=np.float32)})
    assert "nope" in e.value.message
    with pytest.raises(fulcrum.FulcrumError) as e:
        t.create_job({"job_id": "x", "tablez": []})
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "tablez" in e.value.message
    with pytest.raises(ValueError, match="wire_dtype"):
        fulcrum.Tables(servers.addresses, worker_id="x", wire_dtype="int8")


def heap_of(env, servers):
    """What fulcrum.Tables did to a fresh process's heap, run with `env`."""
    code = ("import sys, fulcrum; t = fulcrum.Tables(sys.argv[1:], worker_id='heap'); "
            "print(t.heap); t2 = fulcrum.Tables(sys.argv[1:], worker_id='heap2'); print(t2.heap)")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(fulcrum.__file__)), **env)
    out = subprocess.run(["/usr/bin/python3", "-c", code] + servers.addresses, env=env, check=True,
                         capture_output=True, text=True).stdout.splitlines()
    return out


def test_tables_tune_the_heap_once_unless_told_not_to_or_glibc_tunables_say_otherwise(servers):
    env = {k: "" for k in ("GLIBC_TUNABLES",)}
    tuned = heap_of(dict(env, FULCRUM_TUNE_HEAP="1"), servers)
    assert tuned[0].startswith("heap tuned for large messages: one malloc arena, mmap threshold 256 MiB")
    assert tuned[1] == tuned[0]  # once per process: the second says what the first did
    assert heap_of(dict(env, FULCRUM_TUNE_HEAP="0"), servers) == ["heap left as it is (tune_heap off)"] * 2
    users = heap_of({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4", "FULCRUM_TUNE_HEAP": "1"}, servers)
    assert users == ["heap left as GLIBC_TUNABLES sets it"] * 2


def test_mutual_tls_needs_a_worker_certificate(tmp_path):
    tls = str(tmp_path / "pki")
    subprocess.run([os.path.join(SRC, "deploy/tls/gen-certs.sh"), tls, "--servers", "1", "--workers", "1"],
                   check=True, capture_output=True)
    s = Servers(1, tls_dir=tls)
    try:
        t = fulcrum.Tables(s.addresses, worker_id="tls-0",
                           tls=(f"{tls}/ca.crt", f"{tls}/worker-0.crt", f"{tls}/worker-0.key"))
        t.create_job(job("tls", [dense("w", 16)]))
        t.push("tls", 0, dense={"w": np.ones(16, dtype=np.float32)})
        w = np.empty(16, dtype=np.float32)
        t.pull("tls", 1, dense={"w": w})
        np.testing.assert_array_equal(w, -np.ones(16, dtype=np.float32))
        with pytest.raises(fulcrum.FulcrumError) as e:
            fulcrum.Tables(s.addresses, worker_id="plain", rpc_timeout=3)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(fulcrum.FulcrumError) as e:
            fulcrum.Tables(s.addresses, worker_id="x", tls=(f"{tls}/ca.crt", f"{tls}/nope.crt", f"{tls}/nope.key"))
        assert "nope.crt" in e.value.message
    finally:
        s.stop()


def test_the_cpp_clients_log_lines_go_to_python_logging_not_to_stderr(servers, caplog, capfd):
    import logging  # pylint: disable=import-outside-toplevel
    caplog.set_level(logging.INFO, logger="fulcrum")
    t = fulcrum.Tables(servers.addresses, worker_id="py-log")
    t.create_job(job("logged", [dense("w", 16)]))
    w = np.zeros(16, dtype=np.float32)
    t.push("logged", 0, dense={"w": np.ones(16, dtype=np.float32)})
    t.pull("logged", 1, dense={"w": w})
    err = capfd.readouterr().err
    client_lines = [r.getMessage() for r in caplog.records if ".cc:" in r.getMessage()]
    assert client_lines, "the C++ client logged nothing at INFO"
    assert not any(".cc:" in line for line in err.splitlines()), err
