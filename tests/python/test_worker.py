"""User processes as a job's workers (fulcrum.Worker) on a cluster.sh cluster
with mutual TLS and tokens: a job through success, cancel, a user's error and
a killed process whose rank another process takes over. The processes are
tests/python/user_worker.py, started as a user would start them."""
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

import fulcrum

from conftest import BUILD, SRC

SCRIPT = os.path.join(SRC, "tests", "python", "user_worker.py")


def user_spec(name, workers, epochs=2):
    return {"name": name, "user_workers": True, "num_workers": workers, "epochs": epochs,
            "optimizer": {"kind": "sgd", "learning_rate": 0.1}, "consistency": {"model": "asp"},
            "checkpoint": {"every_steps": 10}}


def start(cluster, job_id, mode, steps_per_epoch, pause=0.0):
    env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"), FULCRUM_COORDINATOR=cluster.coordinator,
               FULCRUM_TLS_CA_FILE=cluster.ca_file,
               FULCRUM_TLS_CERT_FILE=os.path.join(cluster.tls_dir, "worker-0.crt"),
               FULCRUM_TLS_KEY_FILE=os.path.join(cluster.tls_dir, "worker-0.key"))
    return subprocess.Popen([sys.executable, SCRIPT, job_id, mode, str(steps_per_epoch), str(pause)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc, timeout=120):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def wait_for(what, check, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_user_processes_train_a_job_to_success_and_its_checkpoint_exports(cluster, tmp_path):
    client = cluster.client()
    job_id = client.submit(user_spec("py-workers", 2))
    job = client.status(job_id)
    assert "needs 2 user processes" in job.status.message or fulcrum.state_name(job) == "PENDING"
    procs = [start(cluster, job_id, "train", 10) for _ in range(2)]
    job = client.wait(job_id, timeout=120)
    results = [finish(p) for p in procs]
    for rc, out in results:
        assert rc == 0, out
        assert "finished" in out
    assert fulcrum.state_name(job) == "SUCCEEDED", job.status
    assert sorted(w.rank for w in job.status.workers) == [0, 1]
    assert all(w.state == "finished" for w in job.status.workers)
    daemons = {n.info.node_id for n in client.cluster().nodes if n.info.role == 2 and not n.info.job_id}
    assert daemons and not daemons & {w.worker_id for w in job.status.workers}  # no daemon took a rank
    assert job.status.total_steps == 20
    assert [e.epoch for e in job.status.epochs] == [0, 1]
    assert all(sorted(e.reported_ranks) == [0, 1] for e in job.status.epochs)
    assert all(e.tested for e in job.status.epochs)
    assert job.status.epochs[1].test_loss < job.status.epochs[0].test_loss  # it learned
    assert job.status.checkpoints, "no checkpoint was committed"
    info = client.export(job_id, tmp_path / "model.safetensors")
    assert info["tensors"] == 2
    # The job has ended: no process can register for it any more.
    with pytest.raises(fulcrum.FulcrumError) as late:
        fulcrum.Worker(job_id, cluster.coordinator, tls=(cluster.ca_file, os.path.join(cluster.tls_dir, "worker-0.crt"),
                                                         os.path.join(cluster.tls_dir, "worker-0.key")), quiet=True)
    assert late.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "has ended (SUCCEEDED)" in late.value.message


def test_cancel_stops_the_user_processes(cluster):
    client = cluster.client()
    job_id = client.submit(user_spec("py-cancel", 1))
    proc = start(cluster, job_id, "forever", 10, pause=0.02)
    wait_for("three steps", lambda: client.status(job_id).status.workers[0].step >= 3)
    client.cancel(job_id)
    rc, out = finish(proc, timeout=60)
    assert rc == 3, out
    assert "stopped:" in out
    assert fulcrum.state_name(client.status(job_id)) == "CANCELLED"


def test_an_error_in_the_users_code_fails_the_job_with_its_message(cluster):
    client = cluster.client()
    job_id = client.submit(user_spec("py-error", 1))
    rc, out = finish(start(cluster, job_id, "raise", 10))
    assert rc == 1, out
    job = client.wait(job_id, timeout=60)
    assert fulcrum.state_name(job) == "FAILED"
    assert job.status.reason == "UserError"
    assert "ValueError: the user's model diverged at step 3" in job.status.message


def test_a_killed_process_rank_resumes_in_a_new_process(cluster):
    client = cluster.client()
    job_id = client.submit(user_spec("py-killed", 2))
    procs = [start(cluster, job_id, "train", 40, pause=0.05) for _ in range(2)]
    job = wait_for("both ranks training", lambda: (lambda j: j if all(w.step >= 10 for w in j.status.workers)
                                                   else None)(client.status(job_id)))
    # Kill the process that holds rank 1 (its pid is in its node's info).
    node = job.status.workers[1].worker_id
    pid = next(n.info.pid for n in client.cluster().nodes if n.info.node_id == node)
    victim = next(p for p in procs if p.pid == pid)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(30)
    lost = wait_for("rank 1 lost", lambda: (lambda j: j if j.status.workers[1].state == "lost" else None)(
        client.status(job_id)), timeout=30)
    assert lost.status.reason == "WorkerLost"
    replacement = start(cluster, job_id, "train", 40, pause=0.01)
    job = client.wait(job_id, timeout=180)
    rc, out = finish(replacement)
    assert rc == 0, out
    assert "rank 1 of 2 incarnation 1" in out
    resumed = int(out.split("start_step ")[1].split()[0])
    assert resumed >= 10, out  # it took up where the servers had rank 1's pushes
    for p in procs:
        if p is not victim:
            assert finish(p)[0] == 0
    assert fulcrum.state_name(job) == "SUCCEEDED", job.status
    assert job.status.workers[1].incarnation == 1
    assert "WorkerReplaced" in [c.reason for c in job.status.conditions]


def test_a_process_waiting_for_a_job_that_is_cancelled_is_told_at_once(cluster):
    client = cluster.client()
    job_id = client.submit(user_spec("py-never", 2))  # never gets its second process
    threading.Timer(1.0, client.cancel, args=(job_id,)).start()
    started = time.time()
    with pytest.raises(fulcrum.FulcrumError) as refused:
        fulcrum.Worker(job_id, cluster.coordinator, quiet=True,
                       tls=(cluster.ca_file, os.path.join(cluster.tls_dir, "worker-0.crt"),
                            os.path.join(cluster.tls_dir, "worker-0.key")))
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "has ended (CANCELLED)" in refused.value.message
    assert time.time() - started < 10
