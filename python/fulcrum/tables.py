"""fulcrum.Tables: a job's parameter-server tables from NumPy.

The C++ client (fulcrum._ps) does the work: tables are sliced and routed to
their servers, retried, carried over shared memory to servers on this host
and in 16-bit floats on the wire when asked. Arrays are used where they lie:
dense tables as float32 arrays of the table's size, sparse rows as uint64
key arrays with float32 arrays of len(keys) x dim; pulls write into the
arrays given. Anything else (another dtype, a strided view, a read-only
target) is a ValueError naming the table.

    t = fulcrum.Tables(["127.0.0.1:7000"], worker_id="py-0")
    t.create_job({"job_id": "j", "num_workers": 1,
                  "consistency": {"model": "asp"},
                  "tables": [{"name": "w", "kind": "dense", "shape": [1000],
                              "optimizer": {"kind": "sgd", "learning_rate": 0.1}},
                             {"name": "emb", "kind": "sparse", "dim": 16}]})
    t.push("j", step=0, dense={"w": grad}, sparse={"emb": (keys, rows_grad)})
    t.pull("j", step=1, dense={"w": weights}, sparse={"emb": (keys, rows)})
"""

import json
import logging
import os

from fulcrum import _ps

_log = logging.getLogger("fulcrum")
_LEVELS = (logging.INFO, logging.WARNING, logging.ERROR)


def _forward_logs():
    """The C++ client's lines since the last call, into the "fulcrum" logger
    (quiet by default: Python shows warnings and errors only once logging
    is configured, or through its last-resort handler)."""
    lines, dropped = _ps.take_logs()
    for severity, line in lines:
        _log.log(_LEVELS[min(max(severity, 0), 2)], "%s", line)
    if dropped:
        _log.warning("%d lines of the C++ client's log were dropped (more than 1000 between calls)", dropped)


def _logged(method):
    """Runs a Tables method, then forwards what the C++ client logged."""
    def call(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        finally:
            _forward_logs()
    call.__name__, call.__doc__ = method.__name__, method.__doc__
    return call


class Tables:
    """A client of a job's parameter servers (not thread-safe per call: one
    call at a time per Tables, or one Tables per thread)."""

    @_logged
    def __init__(self, servers, worker_id, rank=0, wire_dtype="fp32", tls=None, shared_memory=True,
                 channels_per_server=4, rpc_timeout=60.0, tune_heap=None, incarnation=0):
        """servers: host:port of any of the job's servers (the shard map is
        asked of them); tls: (ca_file, cert_file, key_file) of a worker
        certificate, None for plaintext servers (--insecure); incarnation:
        the rank's (fulcrum.Worker passes its assignment's), which servers of
        a coordinator check against the rank's current owner.

        tune_heap: give the process the heap settings Fulcrum's own
        processes run with (one malloc arena, glibc's mmap and trim
        thresholds pinned, free memory returned every 10 s), without which
        glibc maps or trims each megabyte message's buffers call after call
        (docs/benchmarks.md, "Python: push+pull from NumPy"). None: yes,
        unless $FULCRUM_TUNE_HEAP is 0; never when GLIBC_TUNABLES already
        sets a glibc.malloc tunable. What was done is in self.heap."""
        if isinstance(servers, str):
            servers = [servers]
        if tune_heap is None:
            tune_heap = os.environ.get("FULCRUM_TUNE_HEAP", "1") != "0"
        self.heap = _ps.tune_heap() if tune_heap else "heap left as it is (tune_heap off)"
        _log.info("fulcrum.Tables: %s", self.heap)
        self._t = _ps.Tables(list(servers), worker_id, rank, wire_dtype, list(tls) if tls else None, shared_memory,
                             channels_per_server, float(rpc_timeout), int(incarnation))

    @_logged
    def create_job(self, spec):
        """Creates the job's tables on every server: a dict with a
        fulcrum.v1.PsJobSpec's fields (as a spec file writes them), or its
        YAML or JSON text."""
        self._t.create_job(spec if isinstance(spec, str) else json.dumps(spec))

    @_logged
    def open_job(self, job_id):
        """Uses a job whose tables exist already."""
        self._t.open_job(job_id)

    @_logged
    def delete_job(self, job_id):
        self._t.delete_job(job_id)

    @_logged
    def push(self, job_id, step, dense=None, sparse=None, last=True, lr_scale=1.0):
        """Gradients of step `step`: dense {table: float32 array}, sparse
        {table: (uint64 keys, float32 rows)}; the servers' optimizer applies
        them as the job's consistency model says."""
        self._t.push(job_id, step, dense or {}, sparse or {}, last, lr_scale)

    @_logged
    def push_async(self, job_id, step, dense=None, sparse=None, last=True, lr_scale=1.0):
        """push, started: returns a handle whose wait() returns once the
        servers took it (or raises why not). The arrays must not change
        until then; the handle keeps them alive. A step pushed in parts:
        every part but the last with last=False."""
        return self._t.push_async(job_id, step, dense or {}, sparse or {}, last, lr_scale)

    @_logged
    def pull(self, job_id, step, dense=None, sparse=None):
        """Weights into the arrays given: dense {table: float32 array},
        sparse {table: (uint64 keys, float32 out)}; `step` is the caller's
        clock (BSP returns weights with the steps before it applied)."""
        self._t.pull(job_id, step, dense or {}, sparse or {})

    @_logged
    def stats(self, job_id, server=0):
        """What server `server` holds of the job: applied_step, sparse_rows,
        bytes_used, pushes_applied, rank_clock (per rank, the steps of its
        pushes the server applied) and, for tables with admission or
        eviction, sparse_rows_admitted, sparse_rows_rejected and
        sparse_rows_evicted; for tables that spill to disk (storage),
        sparse_rows_cold (rows on disk, not in sparse_rows),
        sparse_rows_demoted and sparse_rows_promoted."""
        return self._t.stats(job_id, server)
