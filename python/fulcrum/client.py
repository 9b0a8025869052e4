"""fulcrum.Client: the coordinator's job API from Python.

The same calls as fulcrumctl, with the same configuration: the coordinator's
address from the argument or $FULCRUM_COORDINATOR (default 127.0.0.1:7070);
TLS checked against ca_file or $FULCRUM_TLS_CA_FILE (the system's roots when
neither is set), or plaintext with insecure=True or $FULCRUM_INSECURE=1; the
bearer token from token, token_file, $FULCRUM_TOKEN or the file
$FULCRUM_TOKEN_FILE, in that order. Every failed call raises FulcrumError
carrying the gRPC status code and the coordinator's message.
"""

import json
import os

import grpc

from fulcrum.v1 import cluster_pb2
from fulcrum.v1 import cluster_pb2_grpc

TERMINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")


class FulcrumError(Exception):
    """A call the coordinator refused or could not take.

    code: the grpc.StatusCode; message: the coordinator's words (or the
    transport's, when it was not reached); call: what was asked.
    """

    def __init__(self, call, code, message):
        super().__init__(f"{call}: {code.name}: {message}")
        self.call = call
        self.code = code
        self.message = message


def _env(name):
    value = os.environ.get(name, "")
    return value if value else None


def _read_token(path):
    try:
        # The first line, ended by \n alone: a \r inside is the token's (and
        # refused), not a line break that would cut it short.
        with open(path, newline="") as f:
            token = f.read().split("\n", 1)[0]
    except OSError as e:
        raise FulcrumError("token", grpc.StatusCode.INVALID_ARGUMENT,
                           f"cannot read the token file {path}: {e.strerror}") from None
    return _clean_token(token, f"the token file {path}")


def _clean_token(token, source):
    """The token trimmed of surrounding whitespace; FulcrumError naming the
    source (never the token) when it is empty or holds a character an HTTP
    header cannot carry."""
    token = token.strip()
    if not token:
        raise FulcrumError("token", grpc.StatusCode.INVALID_ARGUMENT, f"the bearer token from {source} is empty")
    for i, c in enumerate(token):
        if not " " < c <= "~":
            kind = "a space or control character" if ord(c) < 0x80 else "a non-ASCII character"
            raise FulcrumError("token", grpc.StatusCode.INVALID_ARGUMENT,
                               f"the bearer token from {source} has a character not allowed in a token at "
                               f"position {i + 1} of {len(token)} ({kind}); tokens are printable ASCII "
                               "(openssl rand -hex 32 makes one)")
    return token


def _resolve_token(token, token_file):
    """The bearer token to send, or None: `token`, else `token_file`, else
    $FULCRUM_TOKEN, else the file $FULCRUM_TOKEN_FILE. token="" sends none."""
    if token is not None:
        return _clean_token(token, "the token argument") if token else None
    if token_file:
        return _read_token(token_file)
    if _env("FULCRUM_TOKEN"):
        return _clean_token(_env("FULCRUM_TOKEN"), "$FULCRUM_TOKEN")
    if _env("FULCRUM_TOKEN_FILE"):
        return _read_token(_env("FULCRUM_TOKEN_FILE"))
    return None


def state_name(job):
    """A Job's state as its name ("RUNNING")."""
    return cluster_pb2.JobState.Name(job.status.state)


class Client:
    """A connection to one coordinator. Safe to share between threads."""

    def __init__(self, coordinator=None, *, ca_file=None, insecure=None, token=None, token_file=None,
                 timeout=30.0):
        self.coordinator = coordinator or _env("FULCRUM_COORDINATOR") or "127.0.0.1:7070"
        if insecure is None:
            insecure = os.environ.get("FULCRUM_INSECURE") == "1"
        token = _resolve_token(token, token_file)
        self._metadata = (("authorization", "Bearer " + token),) if token else ()
        self.timeout = timeout
        self._credentials = None
        self._ca_file = None
        if not insecure:
            ca_file = ca_file or _env("FULCRUM_TLS_CA_FILE")
            self._ca_file = ca_file
            roots = None
            if ca_file:
                try:
                    with open(ca_file, "rb") as f:
                        roots = f.read()
                except OSError as e:
                    raise FulcrumError("tls", grpc.StatusCode.INVALID_ARGUMENT,
                                       f"cannot read the CA file {ca_file}: {e.strerror}") from None
            self._credentials = grpc.ssl_channel_credentials(roots)
        # The same limits as fulcrumctl's channels: job specs and statuses
        # of large jobs are bigger than gRPC's default 4 MiB receive limit.
        self._channel = self._new_channel(8 << 20)
        self._export_channel = None
        self._jobs = cluster_pb2_grpc.JobServiceStub(self._channel)
        self._cluster = cluster_pb2_grpc.ClusterServiceStub(self._channel)

    def _new_channel(self, max_receive):
        options = [("grpc.max_receive_message_length", max_receive), ("grpc.max_send_message_length", 8 << 20)]
        if self._credentials is None:
            return grpc.insecure_channel(self.coordinator, options=options)
        return grpc.secure_channel(self.coordinator, self._credentials, options=options)

    def close(self):
        self._channel.close()
        if self._export_channel is not None:
            self._export_channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, name, method, request, timeout=None):
        try:
            return method(request, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._error(name, e) from None

    def _error(self, name, e):
        """FulcrumError for a failed call; an unreachable coordinator gets
        fulcrumctl's hint of what to check."""
        message = e.details() or ""
        # A coordinator that answered UNAVAILABLE itself (it cannot save its
        # state) was reached: the hint is for one that could not be.
        if e.code() == grpc.StatusCode.UNAVAILABLE and not message.startswith("the coordinator "):
            expected = "plaintext (insecure=True or $FULCRUM_INSECURE=1)" if self._credentials is None else (
                "TLS signed by the CA in " + (self._ca_file or "this system's trust store (no ca_file or "
                                              "$FULCRUM_TLS_CA_FILE given; a local cluster's CA is "
                                              "RUN_DIR/tls/ca.crt)"))
            message += (f" (is fulcrum-coordinator running at {self.coordinator}? pass coordinator= or set "
                        f"$FULCRUM_COORDINATOR; does it serve {expected} as this client expects?)")
        return FulcrumError(name, e.code(), message)

    # ----------------------------------------------------------------- jobs

    def submit(self, spec, validate_only=False):
        """Submits a job; returns its id ("" with validate_only).

        spec: a dict (the keys of a spec file), a path to a YAML or JSON spec
        file, or a cluster_pb2.JobSpec. Dicts and files go through parse()
        first, so errors name the field (and the line) as fulcrumctl's do.
        """
        if not isinstance(spec, cluster_pb2.JobSpec):
            spec = self.parse(spec)
        request = cluster_pb2.SubmitJobRequest(spec=spec, validate_only=validate_only)
        return self._call("submit", self._jobs.SubmitJob, request).job_id

    def parse(self, spec):
        """The cluster_pb2.JobSpec a dict or a spec file (YAML or JSON)
        stands for, parsed by the coordinator as fulcrumctl parses files:
        a mistake raises FulcrumError (INVALID_ARGUMENT) naming the field
        and the line. Nothing is submitted."""
        if isinstance(spec, dict):
            request = cluster_pb2.ParseJobSpecRequest(text=json.dumps(spec), source="spec")
        elif isinstance(spec, (str, os.PathLike)):
            path = os.fspath(spec)
            try:
                with open(path) as f:
                    text = f.read()
            except OSError as e:
                raise FulcrumError("parse", grpc.StatusCode.INVALID_ARGUMENT,
                                   f"cannot read the spec file {path}: {e.strerror}") from None
            if not text.strip():
                raise FulcrumError("parse", grpc.StatusCode.INVALID_ARGUMENT, f"the spec file {path} is empty")
            request = cluster_pb2.ParseJobSpecRequest(text=text, source=os.path.basename(path))
        else:
            raise TypeError(f"spec must be a dict, a file path or a JobSpec, not {type(spec).__name__}")
        return self._call("parse", self._jobs.ParseJobSpec, request)

    def status(self, job_id):
        """The job (cluster_pb2.Job): its spec, state and progress."""
        return self._call(f"status {job_id}", self._jobs.GetJob, cluster_pb2.JobRef(job_id=job_id))

    def list(self, page_size=0):
        """Every job the caller may see, oldest first (a list, fetched page
        by page when called: an unreachable coordinator raises here)."""
        jobs, token = [], ""
        while True:
            page = self._call("list", self._jobs.ListJobs,
                              cluster_pb2.ListJobsRequest(page_size=page_size, page_token=token))
            jobs.extend(page.jobs)
            token = page.next_page_token
            if not token:
                return jobs

    def cancel(self, job_id):
        """Cancels a job; returns it as cancelled."""
        return self._call(f"cancel {job_id}", self._jobs.CancelJob, cluster_pb2.JobRef(job_id=job_id))

    def watch(self, job_id, timeout=None):
        """The job's progress events (cluster_pb2.JobEvent), as fulcrumctl
        watch prints them, until the job ends (or `timeout` seconds)."""
        name = f"watch {job_id}"
        try:
            stream = self._jobs.WatchJob(cluster_pb2.JobRef(job_id=job_id), timeout=timeout,
                                         metadata=self._metadata)
            for event in stream:
                yield event
        except grpc.RpcError as e:
            raise self._error(name, e) from None

    def wait(self, job_id, timeout=None):
        """Watches the job to its end; returns the last Job."""
        last = None
        for event in self.watch(job_id, timeout=timeout):
            last = event.job
        if last is None or state_name(last) not in TERMINAL_STATES:
            last = self.status(job_id)
        return last

    # ---------------------------------------------------------- checkpoints

    def checkpoint(self, job_id, timeout=None):
        """Takes a checkpoint of a running job now; returns its CheckpointInfo
        once every server committed it."""
        return self._call(f"checkpoint {job_id}", self._jobs.CheckpointJob, cluster_pb2.JobRef(job_id=job_id),
                          timeout=timeout)

    def restore(self, job_id, cut_id=0):
        """Rolls the job back to its committed cut `cut_id` (0: the latest):
        a running job restarts its workers from there, an ended one runs
        again from there. Returns the job."""
        return self._call(f"restore {job_id}", self._jobs.RestoreJob,
                          cluster_pb2.RestoreJobRequest(job_id=job_id, cut_id=cut_id))

    def export(self, job_id, path, cut_id=0, timeout=None):
        """Writes committed cut `cut_id` (0: the latest) of the job to `path`
        as safetensors, as fulcrumctl export does (the same C++ writer):
        dense tables as F32 tensors of their shape, a sparse table as
        <table>.keys and <table>.values. Returns cut_id, step, tensors and
        bytes."""
        from fulcrum import _ps  # pylint: disable=import-outside-toplevel
        call = f"export {job_id}"
        if self._export_channel is None:
            # A record can outgrow the job API's limit: fulcrumctl's 256 MiB.
            self._export_channel = self._new_channel(256 << 20)
        stream = self._export_channel.unary_stream(
            "/fulcrum.v1.JobService/ExportCheckpoint",
            request_serializer=cluster_pb2.ExportCheckpointRequest.SerializeToString,
            response_deserializer=None)  # the bytes go to the C++ writer as they are
        out = _ps.Export()
        try:
            for chunk in stream(cluster_pb2.ExportCheckpointRequest(job_id=job_id, cut_id=cut_id), timeout=timeout,
                                metadata=self._metadata):
                out.add_chunk(call, chunk)
        except grpc.RpcError as e:
            raise FulcrumError(call, e.code(), e.details()) from None
        return out.write(call, job_id, os.fspath(path))

    # -------------------------------------------------------------- cluster

    def cluster(self):
        """The cluster's nodes and shard map (cluster_pb2.ClusterState)."""
        return self._call("cluster", self._cluster.GetCluster, cluster_pb2.GetClusterRequest())
