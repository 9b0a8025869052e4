"""fulcrum.Client against a real local cluster: every call and its errors."""
import os
import time

import grpc
import numpy as np
import pytest

import fulcrum
from fulcrum.v1 import cluster_pb2

SRC = os.environ["FULCRUM_SOURCE_DIR"]


def digits(epochs=8, name="digits-py", workers=1):
    """sklearn's digits as a spec dict, the keys a spec file holds."""
    return {
        "name": name,
        "model": {"type": "softmax"},
        "data": {"train": {"format": "csv", "path": "digits/digits.csv.gz", "scale": 0.0625}, "test_fraction": 0.2},
        "optimizer": {"kind": "sgd", "learning_rate": 0.1},
        "num_workers": workers,
        "batch_size": 16,
        "epochs": epochs,
    }


def wait_for(client, job_id, states, seconds=60):
    deadline = time.time() + seconds
    while time.time() < deadline:
        job = client.status(job_id)
        if fulcrum.state_name(job) in states:
            return job
        time.sleep(0.1)
    raise AssertionError(f"{job_id} never reached {states}: {fulcrum.state_name(client.status(job_id))}")


def test_a_dict_spec_trains_and_watch_follows_it_to_the_end(cluster):
    with cluster.client() as c:
        job_id = c.submit(digits())
        assert job_id.startswith("digits-py")
        events = list(c.watch(job_id, timeout=120))
        assert events[0].kind == "snapshot"
        assert {e.kind for e in events} >= {"snapshot", "epoch"}
        last = events[-1].job
        assert fulcrum.state_name(last) == "SUCCEEDED"
        assert last.status.test_accuracy >= 0.85
        # status and list agree with what the watch ended on.
        job = c.status(job_id)
        assert fulcrum.state_name(job) == "SUCCEEDED"
        assert job.status.test_accuracy == last.status.test_accuracy
        assert job.owner == "demo"
        assert job_id in [j.id for j in c.list(page_size=1)]  # page by page


def test_a_spec_file_is_read_and_checked_as_fulcrumctl_reads_it(cluster, tmp_path):
    with cluster.client() as c:
        assert c.submit(os.path.join(SRC, "deploy/examples/digits-softmax.yaml"), validate_only=True) == ""
        bad = tmp_path / "bad.yaml"
        bad.write_text("name: bad\nmodel: {type: softmax}\nepochz: 3\n")
        with pytest.raises(fulcrum.FulcrumError) as e:
            c.submit(str(bad))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "bad.yaml" in e.value.message and "epochz" in e.value.message and "line 3" in e.value.message
        with pytest.raises(fulcrum.FulcrumError) as e:
            c.submit(str(tmp_path / "missing.yaml"))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "missing.yaml" in e.value.message


def test_bad_specs_and_unknown_jobs_raise_with_the_code_and_the_coordinators_message(cluster):
    with cluster.client() as c:
        spec = digits()
        spec["optimizer"]["kind"] = "sgdd"
        with pytest.raises(fulcrum.FulcrumError) as e:
            c.submit(spec)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "optimizer.kind" in e.value.message
        spec = digits()
        spec["num_workers"] = 0
        with pytest.raises(fulcrum.FulcrumError) as e:
            c.submit(spec)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "num_workers" in e.value.message
        with pytest.raises(fulcrum.FulcrumError) as e:
            c.status("no-such-job")
        assert e.value.code == grpc.StatusCode.NOT_FOUND and "no-such-job" in str(e.value)
        with pytest.raises(TypeError):
            c.submit(42)


def test_parse_gives_the_spec_a_submit_carries_and_names_the_line_of_a_mistake(cluster):
    with cluster.client() as c:
        spec = c.parse({"name": "parsed", "model": {"type": "softmax"}, "epochs": 2, "num_workers": 1,
                        "data": {"train": {"format": "csv", "path": "digits/digits.csv.gz"}}})
        assert isinstance(spec, cluster_pb2.JobSpec)
        assert spec.name == "parsed" and spec.model.type == "softmax" and spec.epochs == 2
        assert spec.data.train.format == "csv"
        with pytest.raises(fulcrum.FulcrumError) as e:
            c._call("parse", c._jobs.ParseJobSpec,  # pylint: disable=protected-access
                    cluster_pb2.ParseJobSpecRequest(text="name: x\nepochs: many\n", source="x.yaml"))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "x.yaml" in e.value.message and "epochs" in e.value.message and "line 2" in e.value.message
    # Parsing needs a caller as every job call does.
    with cluster.client(token="") as c:
        with pytest.raises(fulcrum.FulcrumError) as e:
            c.parse({"name": "x"})
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED and e.value.call == "parse"


def test_credentials_come_from_the_arguments_or_the_environment(cluster, monkeypatch):
    # No token: the job API refuses, naming what is missing.
    with cluster.client(token="") as c:
        with pytest.raises(fulcrum.FulcrumError) as e:
            list(c.list())
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    # Plaintext against a TLS coordinator: the handshake fails.
    with cluster.client(insecure=True, timeout=5) as c:
        with pytest.raises(fulcrum.FulcrumError) as e:
            c.status("any")
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
    # fulcrumctl's variables: address, CA and token file.
    monkeypatch.setenv("FULCRUM_COORDINATOR", cluster.coordinator)
    monkeypatch.setenv("FULCRUM_TLS_CA_FILE", cluster.ca_file)
    monkeypatch.setenv("FULCRUM_TOKEN_FILE", os.path.join(cluster.tls_dir, "token-admin"))
    monkeypatch.delenv("FULCRUM_TOKEN", raising=False)
    monkeypatch.delenv("FULCRUM_INSECURE", raising=False)
    with fulcrum.Client() as admin:
        assert admin.coordinator == cluster.coordinator
        assert len(admin.cluster().nodes) == 2  # a server and a worker
    monkeypatch.setenv("FULCRUM_TOKEN_FILE", "/nonexistent/token")
    with pytest.raises(fulcrum.FulcrumError) as e:
        fulcrum.Client()
    assert "/nonexistent/token" in e.value.message


def test_tokens_are_trimmed_and_a_token_no_header_can_carry_is_refused_without_printing_it(cluster, monkeypatch,
                                                                                            tmp_path):
    token = open(os.path.join(cluster.tls_dir, "token-admin")).read().strip()
    monkeypatch.setenv("FULCRUM_COORDINATOR", cluster.coordinator)
    monkeypatch.setenv("FULCRUM_TLS_CA_FILE", cluster.ca_file)
    monkeypatch.delenv("FULCRUM_TOKEN_FILE", raising=False)
    monkeypatch.delenv("FULCRUM_INSECURE", raising=False)
    # A trailing newline, as `FULCRUM_TOKEN="$(cat token; echo)"` leaves it.
    monkeypatch.setenv("FULCRUM_TOKEN", token + "\n")
    with fulcrum.Client() as c:
        assert len(c.cluster().nodes) == 2
    # A control character inside: refused before any call, naming where.
    for bad, source in ((token[:10] + "\x07" + token[10:], "$FULCRUM_TOKEN"),
                        (token[:10] + "\u00e9" + token[10:], "$FULCRUM_TOKEN")):
        monkeypatch.setenv("FULCRUM_TOKEN", bad)
        with pytest.raises(fulcrum.FulcrumError) as e:
            fulcrum.Client()
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"the bearer token from {source} has a character not allowed in a token at position 11" in e.value.message
        assert token[:10] not in e.value.message
    monkeypatch.delenv("FULCRUM_TOKEN")
    path = tmp_path / "token"
    path.write_text("  " + token[:5] + "\r" + token[5:] + "\n")
    with pytest.raises(fulcrum.FulcrumError) as e:
        fulcrum.Client(token_file=str(path))
    assert f"the bearer token from the token file {path} has a character not allowed" in e.value.message
    with pytest.raises(fulcrum.FulcrumError) as e:
        fulcrum.Worker(job_id="any", token=token + "\x00", insecure=True)
    assert "the bearer token from the token argument" in e.value.message


def test_users_see_only_their_own_jobs(cluster):
    with cluster.client("demo") as demo, cluster.client("admin") as admin:
        job_id = admin.submit(digits(epochs=1, name="admins"))
        with pytest.raises(fulcrum.FulcrumError) as e:
            demo.status(job_id)
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert job_id not in [j.id for j in demo.list()]
        assert fulcrum.state_name(admin.wait(job_id, timeout=120)) == "SUCCEEDED"


def read_safetensors(path):
    """The header and each tensor of a safetensors file, as numpy arrays."""
    import json  # pylint: disable=import-outside-toplevel
    data = open(path, "rb").read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    tensors = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        begin, end = t["data_offsets"]
        dtype = {"F32": np.float32, "I64": np.int64}[t["dtype"]]
        tensors[name] = np.frombuffer(body[begin:end], dtype=dtype).reshape(t["shape"])
    return header, tensors


def test_checkpoint_export_restore_and_cancel_a_running_job(cluster, tmp_path):
    with cluster.client() as c:
        job_id = c.submit(digits(epochs=100000, name="long"))
        wait_for(c, job_id, {"RUNNING"})
        wait_for_steps = time.time() + 60
        while c.status(job_id).status.step < 5 and time.time() < wait_for_steps:
            time.sleep(0.1)
        cut = c.checkpoint(job_id, timeout=60)
        assert cut.cut_id > 0 and cut.bytes > 0 and cut.servers
        # The cut's parameters as safetensors, by the writer fulcrumctl export uses.
        info = c.export(job_id, tmp_path / "long.safetensors", cut_id=cut.cut_id)
        assert info["cut_id"] == cut.cut_id and info["step"] == cut.step and info["tensors"] >= 2
        header, tensors = read_safetensors(tmp_path / "long.safetensors")
        assert header["__metadata__"]["fulcrum_job"] == job_id
        assert header["__metadata__"]["fulcrum_checkpoint"] == str(cut.cut_id)
        assert len(tensors) == info["tensors"]
        assert sum(t.size for t in tensors.values()) == 64 * 10 + 10  # softmax on 64 features, 10 classes
        assert all(np.isfinite(t).all() for t in tensors.values()) and any(t.any() for t in tensors.values())
        with pytest.raises(fulcrum.FulcrumError) as e:
            c.export("no-such-job", tmp_path / "none.safetensors")
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        assert not (tmp_path / "none.safetensors").exists()
        restored = c.restore(job_id, cut.cut_id)
        assert restored.id == job_id
        cancelled = c.cancel(job_id)
        assert fulcrum.state_name(cancelled) == "CANCELLED"
        with pytest.raises(fulcrum.FulcrumError) as e:
            c.cancel(job_id)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(fulcrum.FulcrumError) as e:
            c.checkpoint(job_id)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert fulcrum.state_name(c.wait(job_id, timeout=30)) == "CANCELLED"


def test_an_absent_coordinator_is_reported_by_the_call_itself_with_what_to_check():
    with fulcrum.Client("127.0.0.1:1", insecure=True, timeout=3) as c:
        with pytest.raises(fulcrum.FulcrumError) as e:
            c.list()  # a list, fetched at the call: not only once iterated
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert "is fulcrum-coordinator running at 127.0.0.1:1?" in e.value.message
        assert "plaintext (insecure=True" in e.value.message
