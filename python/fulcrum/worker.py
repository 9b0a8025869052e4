"""fulcrum.Worker: a user process as one worker of a coordinator's job.

A job whose spec says `user_workers: true` is trained by processes the user
starts (by hand, with a launcher, as pods), each running its own model on the
job's parameter-server tables. Each process opens a Worker: it registers with
the coordinator for the job, heartbeats from a thread of its own, and is
given a rank once the job has its num_workers processes. Its progress and
results go to the coordinator as a fulcrum-worker daemon's do, so fulcrumctl
watch, the dashboards, checkpoints, cancel and lost-worker handling work as
for daemons.

    with fulcrum.Worker("mnist-7") as w:         # waits for this process's rank
        opt = fulcrum.torch.ParameterServerOptimizer(model, w)
        for step in range(w.start_step, total):   # a replacement resumes
            ...
            w.report(step + 1, epoch, loss=loss.item(), total_steps=total)
        w.epoch_done(0, train_loss=..., test_accuracy=...)
    # leaving the block reports the rank finished (or failed, with the
    # exception's message) and leaves the cluster

The coordinator's address comes from the argument or $FULCRUM_COORDINATOR
(default 127.0.0.1:7070), the job from the argument or $FULCRUM_JOB_ID. In a
cluster with mutual TLS the process presents a worker certificate: tls=(ca,
cert, key) or $FULCRUM_TLS_CA_FILE, $FULCRUM_TLS_CERT_FILE and
$FULCRUM_TLS_KEY_FILE; the same certificate reaches the parameter servers.
insecure=True (or $FULCRUM_INSECURE=1) is plaintext, with a bearer token
(token, token_file, $FULCRUM_TOKEN, $FULCRUM_TOKEN_FILE) when the coordinator
has tokens.

When the job is cancelled or ends, or this process's rank is given to another
(the job rolled back, or this process was thought lost), the next report
raises WorkerStopped: the process should stop training. A rank whose process
dies waits for another process to open a Worker for the job; that one gets
the rank with the next incarnation and resumes at `start_step`, the steps of
the rank's pushes every server applied.
"""

import os
import socket
import sys
import threading
import time

import grpc

from fulcrum.client import FulcrumError, _env, _resolve_token
from fulcrum.v1 import cluster_pb2
from fulcrum.v1 import cluster_pb2_grpc
from fulcrum.v1 import common_pb2

_WIRE = {common_pb2.DTYPE_UNSPECIFIED: "fp32", common_pb2.DTYPE_FP32: "fp32", common_pb2.DTYPE_BF16: "bf16",
         common_pb2.DTYPE_FP16: "fp16"}


def spec_dict(message):
    """A protobuf message as the dict a spec file writes: set fields only,
    enums by name, 64-bit integers as numbers (fulcrum.Tables.create_job and
    fulcrumctl's parser take it back)."""
    out = {}
    for field, value in message.ListFields():
        def plain(v, field=field):
            if field.type == field.TYPE_MESSAGE:
                return spec_dict(v)
            if field.type == field.TYPE_ENUM:
                return field.enum_type.values_by_number[v].name
            return v
        if field.label == field.LABEL_REPEATED:
            out[field.name] = [plain(v) for v in value]
        else:
            out[field.name] = plain(value)
    return out


class WorkerStopped(Exception):
    """The coordinator no longer runs this rank on this process: the job was
    cancelled or ended, or the rank moved to another process."""


def _read(path, what):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise FulcrumError("tls", grpc.StatusCode.INVALID_ARGUMENT,
                           f"cannot read the {what} {path}: {e.strerror}") from None


class Worker:
    """One rank of a user_workers job, held by this process."""

    def __init__(self, job_id=None, coordinator=None, *, tls=None, insecure=None, token=None, token_file=None,
                 timeout=None, report_interval=1.0, result_timeout=60.0, device="cpu", quiet=False):
        """Registers and waits (up to `timeout` seconds; None: as long as it
        takes) until the coordinator gives this process a rank of the job.
        device: what the process trains on, as `fulcrumctl cluster` lists it."""
        self.job_id = job_id or _env("FULCRUM_JOB_ID")
        if not self.job_id:
            raise ValueError("fulcrum.Worker needs a job id (the argument or $FULCRUM_JOB_ID)")
        self.coordinator = coordinator or _env("FULCRUM_COORDINATOR") or "127.0.0.1:7070"
        self.report_interval = report_interval
        self.result_timeout = result_timeout
        self._quiet = quiet
        if insecure is None:
            insecure = os.environ.get("FULCRUM_INSECURE") == "1"
        if tls is None and not insecure:
            files = [_env(v) for v in ("FULCRUM_TLS_CA_FILE", "FULCRUM_TLS_CERT_FILE", "FULCRUM_TLS_KEY_FILE")]
            if all(files):
                tls = tuple(files)
        token = _resolve_token(token, token_file)
        self._metadata = (("authorization", "Bearer " + token),) if token else ()
        self.tls = tuple(tls) if tls else None
        if self.tls:
            ca, cert, key = self.tls
            creds = grpc.ssl_channel_credentials(_read(ca, "CA file"), _read(key, "key file"),
                                                 _read(cert, "certificate file"))
            self._channel = grpc.secure_channel(self.coordinator, creds)
        elif insecure:
            self._channel = grpc.insecure_channel(self.coordinator)
        else:
            raise FulcrumError("worker", grpc.StatusCode.INVALID_ARGUMENT,
                               "a worker needs a worker certificate (tls=(ca, cert, key) or $FULCRUM_TLS_CA_FILE, "
                               "$FULCRUM_TLS_CERT_FILE, $FULCRUM_TLS_KEY_FILE), or insecure=True for a plaintext "
                               "coordinator")
        self._cluster = cluster_pb2_grpc.ClusterServiceStub(self._channel)
        self._cv = threading.Condition()
        self._assignment = None
        self._stopped = None  # why, once stopped
        self._closing = threading.Event()
        self._finished = False
        self._last_report = 0.0
        self._start_step = None
        self._tables = {}
        self._progress = cluster_pb2.WorkerProgress(state="assigned")
        self._total_steps = 0
        self.device = str(device)
        info = cluster_pb2.NodeInfo(role=cluster_pb2.WORKER, hostname=socket.gethostname(), pid=os.getpid(),
                                    slots=1, version="fulcrum-python", job_id=self.job_id)
        kind = device.split(":")[0] if isinstance(device, str) else "cpu"
        info.devices.add(kind=kind, ordinal=0, name=str(device))
        r = self._call("register", self._cluster.RegisterNode, cluster_pb2.RegisterNodeRequest(node=info))
        self.node_id = r.node_id
        self._interval = max(0.05, r.heartbeat_interval_ms / 1000.0)
        self._log(f"registered as {self.node_id} for job {self.job_id} at {self.coordinator}; "
                  "waiting for the job to have all its processes")
        self._beater = threading.Thread(target=self._beat, name=f"fulcrum-heartbeat-{self.node_id}", daemon=True)
        self._beater.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._assignment is None and self._stopped is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cv.wait(left if left is not None else 1.0)
        if self._assignment is None:
            why = self._stopped or f"no rank of job {self.job_id} within {timeout} s"
            self.close()
            raise FulcrumError("worker", grpc.StatusCode.DEADLINE_EXCEEDED if self._stopped is None
                               else grpc.StatusCode.FAILED_PRECONDITION, why)
        a = self._assignment
        self._log(f"rank {a.rank} of {a.world_size} (incarnation {a.incarnation}) on servers "
                  f"{', '.join(a.shard_map.servers)}")

    # ------------------------------------------------------------ the rank

    @property
    def rank(self):
        return self._assignment.rank

    @property
    def world_size(self):
        return self._assignment.world_size

    @property
    def incarnation(self):
        """0 for the rank's first process, then one more for each that
        took the rank over."""
        return self._assignment.incarnation

    @property
    def spec(self):
        """The job's JobSpec (cluster_pb2): its optimizer, consistency,
        num_workers, and the batch_size and epochs it was given."""
        return self._assignment.spec

    @property
    def optimizer(self):
        """The job's optimizer as a spec dict, for the tables this process
        creates (fulcrum.torch does)."""
        return spec_dict(self.spec.optimizer)

    @property
    def consistency(self):
        """The job's consistency model as a spec dict."""
        return spec_dict(self.spec.consistency)

    @property
    def servers(self):
        """The job's parameter servers (host:port), in the shard map's order."""
        return list(self._assignment.shard_map.servers)

    @property
    def worker_id(self):
        """What identifies this process's pushes to the servers."""
        a = self._assignment
        return f"{self.node_id}/{self.job_id}/r{a.rank}/i{a.incarnation}"

    @property
    def stopped(self):
        """Why this process no longer holds its rank, or None."""
        return self._stopped

    def tables(self, wire_dtype=None, shared_memory=True):
        """The fulcrum.Tables on the job's servers that pushes as this rank
        (wire_dtype: the job's wire_dtype unless given); one per choice of
        arguments, so a fulcrum.torch optimizer and Embedding share it."""
        from fulcrum.tables import Tables  # pylint: disable=import-outside-toplevel
        wire = wire_dtype or _WIRE.get(self.spec.wire_dtype, "fp32")
        key = (wire, shared_memory)
        if key not in self._tables:
            self._tables[key] = Tables(self.servers, self.worker_id, rank=self.rank, wire_dtype=wire, tls=self.tls,
                                       shared_memory=shared_memory, incarnation=self.incarnation)
        return self._tables[key]

    @property
    def start_step(self):
        """Where this rank resumes: 0 for its first process; for a process
        that took it over, the steps of the rank's pushes that every server
        applied (the slowest server's count)."""
        if self._start_step is None:
            if self.incarnation == 0:
                self._start_step = 0
            else:
                tables = self.tables()
                tables.open_job(self.job_id)
                clocks = [tables.stats(self.job_id, i)["rank_clock"] for i in range(len(self.servers))]
                self._start_step = min((c[self.rank] if self.rank < len(c) else 0) for c in clocks)
                self._log(f"rank {self.rank} resumes at step {self._start_step}")
        return self._start_step

    # ------------------------------------------------------------ reports

    def report(self, step, epoch=0, loss=None, accuracy=None, samples_per_second=None, total_steps=None,
               learning_rate=None, batch_size=None, force=False):
        """This rank's progress: `step` steps done (its clock), in `epoch`
        (from 0). Sent at most once per report_interval unless `force`; a
        report the coordinator cannot take now is dropped (the next one
        carries the same). Raises WorkerStopped once the rank is no longer
        this process's."""
        self._check()
        p = self._progress
        p.state = "training"
        p.step = int(step)
        p.epoch = int(epoch)
        if loss is not None:
            p.loss = float(loss)
            p.has_metrics = True
        if accuracy is not None:
            p.train_accuracy = float(accuracy)
        if samples_per_second is not None:
            p.samples_per_second = float(samples_per_second)
        if learning_rate is not None:
            p.learning_rate = float(learning_rate)
        if batch_size is not None:
            p.batch_size = int(batch_size)
        if total_steps:
            self._total_steps = int(total_steps)
        now = time.monotonic()
        if not force and now - self._last_report < self.report_interval:
            return
        self._last_report = now
        self._send(self._request(), result=False)

    def epoch_done(self, epoch, train_loss, train_accuracy=0.0, test_loss=None, test_accuracy=None, test_rmse=None,
                   train_auc=None, test_auc=None, seconds=0.0, samples_per_second=0.0, step=None):
        """Epoch `epoch`'s (from 0) figures; rank 0 carries the test figures,
        as the daemons' does. Sent until the coordinator saved it."""
        self._check()
        if step is not None:
            self._progress.step = int(step)
        req = self._request()
        e = req.epoch_done
        e.epoch = epoch
        e.train_loss = float(train_loss)
        e.train_accuracy = float(train_accuracy or 0.0)
        e.seconds = float(seconds or 0.0)
        e.samples_per_second = float(samples_per_second or 0.0)
        if train_auc is not None:
            e.train_auc = float(train_auc)
        if test_loss is not None or test_accuracy is not None or test_rmse is not None:
            e.tested = True
            e.test_loss = float(test_loss or 0.0)
            e.test_accuracy = float(test_accuracy or 0.0)
            e.test_rmse = float(test_rmse or 0.0)
            if test_auc is not None:
                e.test_auc = float(test_auc)
        self._send(req, result=True)

    def finish(self):
        """This rank trained everything it had to. The job succeeds once
        every rank finished (and its final checkpoint is taken)."""
        self._check()
        req = self._request("finished")
        req.finished = True
        self._send(req, result=True)
        self._finished = True

    def check(self, confirm=False):
        """Raises WorkerStopped once the rank is no longer this process's;
        with `confirm`, asks the coordinator now (after a push or pull
        failed: a cancelled job's tables are gone before the next heartbeat
        says so)."""
        self._check()
        if confirm and self._assignment is not None:
            self._send(self._request(), result=False)

    def fail(self, message, reason="UserError"):
        """This rank cannot go on: the job fails with `message` (reason
        UserError), or rolls back to its last checkpoint for other reasons."""
        if self._stopped is not None or self._assignment is None:
            return
        req = self._request("failed")
        req.error = str(message)[:4000] or "failed"
        req.error_reason = reason
        try:
            self._send(req, result=True)
        except WorkerStopped:
            pass

    # ------------------------------------------------------------ life

    def close(self):
        """Stops heartbeating and tells the coordinator this process leaves
        (a rank it had not finished moves to another process)."""
        if self._closing.is_set():
            return
        self._closing.set()
        try:
            self._cluster.Heartbeat(cluster_pb2.HeartbeatRequest(node_id=self.node_id, leaving=True),
                                    timeout=5, metadata=self._metadata)
        except (grpc.RpcError, AttributeError):
            pass
        if hasattr(self, "_beater"):
            self._beater.join(timeout=self._interval + 15)
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None and not self._finished and self._stopped is None:
                self.finish()
            elif exc_type is not None and not issubclass(exc_type, (WorkerStopped, KeyboardInterrupt)):
                self.fail(f"{exc_type.__name__}: {exc}")
        finally:
            self.close()
        return False

    # ------------------------------------------------------------ inside

    def _log(self, text):
        if not self._quiet:
            print(f"fulcrum.Worker {getattr(self, 'node_id', '')}: {text}", file=sys.stderr, flush=True)

    def _call(self, name, method, request, timeout=30.0):
        try:
            return method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise FulcrumError(name, e.code(), e.details()) from None

    def _stop(self, why):
        with self._cv:
            if self._stopped is None:
                self._stopped = why
                if not self._finished:  # after finish() the job ending is no news
                    self._log(f"stopped: {why}")
            self._cv.notify_all()

    def _check(self):
        if self._stopped is not None:
            raise WorkerStopped(self._stopped)

    def _beat(self):
        generation = 0
        while not self._closing.is_set():
            req = cluster_pb2.HeartbeatRequest(node_id=self.node_id, generation=generation,
                                               wait_ms=int(self._interval * 1000))
            try:
                r = self._cluster.Heartbeat(req, timeout=self._interval + 10, metadata=self._metadata)
            except grpc.RpcError as e:
                if self._closing.is_set():
                    return
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    self._stop(f"the coordinator no longer knows this process ({e.details()})")
                    return
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self._stop(e.details())  # its job ended (cancelled before it started, or done)
                    return
                self._closing.wait(min(1.0, self._interval))  # the coordinator is away: keep trying
                continue
            generation = r.generation
            mine = [a for a in r.assignments if a.job_id == self.job_id]
            with self._cv:
                held = self._assignment
                if mine and held is None and self._stopped is None:
                    self._assignment = mine[0]
                    self._cv.notify_all()
                elif held is not None and (not mine or mine[0].rank != held.rank or
                                           mine[0].incarnation != held.incarnation):
                    self._stop(f"job {self.job_id} no longer runs rank {held.rank} (incarnation {held.incarnation}) "
                               "on this process: it was cancelled or ended, or the rank moved")
                elif mine:
                    self._assignment = mine[0]

    def _request(self, state=None):
        """A report of this rank's latest progress (in `state` if given)."""
        a = self._assignment
        req = cluster_pb2.ReportProgressRequest(node_id=self.node_id, job_id=self.job_id, rank=a.rank,
                                                incarnation=a.incarnation, total_steps=self._total_steps)
        req.progress.CopyFrom(self._progress)
        p = req.progress
        p.rank = a.rank
        p.worker_id = self.node_id
        p.incarnation = a.incarnation
        p.device = self.device
        if state is not None:
            p.state = state
        return req

    def _send(self, req, result):
        """One report; results are sent again until the coordinator took
        them (it refuses with UNAVAILABLE what it could not save)."""
        deadline = time.monotonic() + self.result_timeout
        while True:
            try:
                resp = self._cluster.ReportProgress(req, timeout=30, metadata=self._metadata)
            except grpc.RpcError as e:
                retry = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                if not result and retry:
                    return
                if not retry or time.monotonic() > deadline:
                    raise FulcrumError("report", e.code(), e.details()) from None
                time.sleep(0.5)
                continue
            if resp.stop:
                self._stop(f"job {self.job_id} no longer runs rank {req.rank} on this process "
                           "(it was cancelled or ended, or the rank moved)")
                raise WorkerStopped(self._stopped)
            return
