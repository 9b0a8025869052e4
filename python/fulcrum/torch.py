"""fulcrum.torch: a PyTorch module's parameters on Fulcrum's parameter servers.

    tables = fulcrum.Tables(servers, worker_id="rank-0", rank=0)
    opt = fulcrum.torch.ParameterServerOptimizer(model, tables, "job-1",
                                                 optimizer={"kind": "adam", "learning_rate": 1e-3})
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()   # push every gradient, the servers' Adam applies it, pull the weights

    emb = fulcrum.torch.Embedding(tables, "job-1", "user", dim=16)   # a sparse table
    vectors = emb(user_ids)   # pulls the batch's rows; backward pushes their gradients

The parameters live in dense tables named after them (module.named_parameters),
created with the job unless create=False (the other ranks of a job open it).
The consistency model of the job applies: under BSP a step's pull waits for
every rank's push. CPU tensors are pushed and pulled in place; CUDA ones go
through a host copy. Every call is fulcrum.Tables's, so errors are its.
"""

import weakref

from fulcrum import _require

np = _require("numpy", "python3-numpy")
torch = _require("torch", "python3-torch")

_DTYPE_OK = (torch.float32,)


def _host(t):
    """A contiguous float32 CPU tensor sharing `t`'s memory where it can."""
    if t.dtype not in _DTYPE_OK:
        raise ValueError(f"fulcrum.torch keeps float32 parameters, got {t.dtype}")
    if t.device.type == "cpu" and t.is_contiguous():
        return t
    return t.detach().to("cpu", copy=True).contiguous()


def _torch_default_init(name, p, params):
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)): what nn.Linear and nn.ConvNd draw
    their weights and biases from; a bias takes its layer's weight's fan_in."""
    weight = p
    if p.dim() < 2 and name.endswith("bias"):
        weight = params.get(name[: -len("bias")] + "weight", p)
    fan_in = int(np.prod(weight.shape[1:])) if weight.dim() >= 2 else max(1, weight.numel())
    bound = 1.0 / np.sqrt(fan_in)
    # The servers' values depend on the table's name as well as the seed.
    return {"kind": "uniform", "a": -bound, "b": bound, "seed": 1}


class ParameterServerOptimizer:
    """Keeps `module`'s trainable parameters on the parameter servers."""

    def __init__(self, module, tables, job_id=None, optimizer=None, consistency="asp", num_workers=1, create=True,
                 initializer=None, extra_tables=(), overlap=None, push_group_bytes=256 << 10):
        """tables: a fulcrum.Tables, or a fulcrum.Worker of a user_workers
        job: then the job, its optimizer, consistency model and number of
        workers are the coordinator's, every rank creates the same tables,
        and a rank that took over a lost process's resumes at its clock.
        optimizer: the servers' optimizer for every parameter, as a job
        spec writes it ({"kind": "sgd", "learning_rate": 0.01} when None);
        consistency: "bsp", "ssp" or "asp" (with "staleness" give a dict);
        initializer: the tables' initializer ({"kind": "normal", "b": 0.05,
        "seed": 1}); "torch": the distribution of PyTorch's default for
        Linear and Conv layers, U(-1/sqrt(fan_in), 1/sqrt(fan_in)); None:
        zeros. The module takes the servers' weights.
        extra_tables: table specs created in the same job (an Embedding's).
        overlap: push each gradient as backward produces it (in groups of
        at least push_group_bytes, while backward goes on with the layers
        below), rather than all of them in step(). The gradients pushed are
        backward's: one backward per step, and changes made to .grad after
        it (clipping in place, accumulating several backwards) do not reach
        the servers; give overlap=False for those (or clip on the servers:
        the optimizer's clip_global_norm). None (the default): on when the
        module's parameters are on a GPU, whose backward leaves the CPU to
        the pushes; off on the CPU, where backward and the pushes share the
        cores (docs/benchmarks.md: 0.91-1.05x there)."""
        from fulcrum.worker import Worker  # pylint: disable=import-outside-toplevel
        self.worker = None
        self.clock = 0
        if isinstance(tables, Worker):
            self.worker = tables
            job_id = job_id or self.worker.job_id
            optimizer = optimizer or self.worker.optimizer
            consistency = self.worker.consistency
            num_workers = self.worker.world_size
            tables = self.worker.tables()
            self.clock = self.worker.start_step
        if job_id is None:
            raise ValueError("ParameterServerOptimizer needs a job_id (or a fulcrum.Worker)")
        self.module = module
        self.tables = tables
        self.job_id = job_id
        self.params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the module has no trainable parameters")
        if overlap is None:
            overlap = any(p.is_cuda for _, p in self.params)
        self.overlap = overlap
        self.push_group_bytes = push_group_bytes
        self._ready = {}     # gradients backward produced, not yet pushed
        self._ready_bytes = 0
        self._pushed = set()  # parameters pushed this step
        self._in_flight = []  # PendingPush of this step's earlier groups
        if overlap:
            for name, p in self.params:
                p.register_hook(lambda g, name=name: self._on_grad(name, g))
        if create:
            opt = optimizer or {"kind": "sgd", "learning_rate": 0.01}
            cons = consistency if isinstance(consistency, dict) else {"model": consistency}
            specs = [{"name": name, "kind": "dense", "shape": [p.numel()], "optimizer": opt}
                     for name, p in self.params]
            if initializer == "torch":
                for spec, (name, p) in zip(specs, self.params):
                    spec["initializer"] = _torch_default_init(name, p, dict(self.params))
            elif initializer:
                for spec in specs:
                    spec["initializer"] = initializer
            self._guarded(tables.create_job, {"job_id": job_id, "num_workers": num_workers, "consistency": cons,
                          "tables": specs + list(extra_tables)})
        else:
            tables.open_job(job_id)
        self.pull()

    def pull(self):
        """The servers' weights into the parameters (as of this rank's clock)."""
        staged = [(p, _host(p.data)) for _, p in self.params]
        self._guarded(self.tables.pull, self.job_id, self.clock,
                      dense={name: host.numpy().reshape(-1) for (name, _), (_, host) in zip(self.params, staged)})
        with torch.no_grad():
            for p, host in staged:
                if host.data_ptr() != p.data.data_ptr():
                    p.data.copy_(host.view_as(p.data))

    def zero_grad(self, set_to_none=True):
        """The module's zero_grad; gradients backward produced but not yet
        pushed are dropped with them."""
        self.module.zero_grad(set_to_none=set_to_none)
        self._ready, self._ready_bytes = {}, 0

    def _on_grad(self, name, grad):
        """Backward produced `name`'s gradient: pushed with others once they
        make push_group_bytes (the step's last group goes in step())."""
        if name in self._pushed or name in self._ready:
            # A second backward before step(): this step's pushes would not
            # hold its sum.
            raise RuntimeError(f"fulcrum.torch: {name} got a second gradient before step(); backward once per "
                               "step, or ParameterServerOptimizer(overlap=False) to accumulate gradients")
        host = _host(grad.detach()).numpy().reshape(-1)
        self._ready[name] = host
        self._ready_bytes += host.nbytes
        if self._ready_bytes >= self.push_group_bytes and len(self._pushed) + len(self._ready) < len(self.params):
            self._in_flight.append(self._guarded(self.tables.push_async, self.job_id, self.clock,
                                                 dense=self._ready, last=False))
            self._pushed.update(self._ready)
            self._ready, self._ready_bytes = {}, 0
        return grad

    def step(self):
        """Pushes every parameter's gradient (zeros where none flowed) as
        this rank's step, then pulls the weights the servers made of it.
        With overlap, only what backward's groups did not carry goes now."""
        grads = {}
        for name, p in self.params:
            if name in self._pushed:
                continue
            if name in self._ready:
                grads[name] = self._ready[name]
                continue
            g = p.grad if p.grad is not None else torch.zeros_like(p.data)
            grads[name] = _host(g).numpy().reshape(-1)
        try:
            self._guarded(self.tables.push, self.job_id, self.clock, dense=grads)
            for pending in self._in_flight:
                self._guarded(pending.wait)
        finally:
            self._in_flight, self._ready, self._ready_bytes, self._pushed = [], {}, 0, set()
        self.clock += 1
        self.pull()

    def _guarded(self, call, *args, **kwargs):
        """A table call; under a fulcrum.Worker, a failure because the job
        stopped (its tables are dropped when it is cancelled) is
        WorkerStopped, not the servers' NOT_FOUND."""
        try:
            return call(*args, **kwargs)
        except Exception:  # pylint: disable=broad-except
            if self.worker is not None:
                self.worker.check(confirm=True)
            raise


class _PullRows(torch.autograd.Function):
    """Rows of a sparse table for `keys`; backward pushes their gradient."""

    @staticmethod
    def forward(ctx, anchor, emb, keys):  # pylint: disable=arguments-differ
        del anchor  # only there so autograd calls backward
        ctx.emb = emb
        ctx.keys = keys
        rows = np.empty((len(keys), emb.dim), dtype=np.float32)
        emb.tables.pull(emb.job_id, emb.clock, sparse={emb.table: (keys, rows)})
        return torch.from_numpy(rows)

    @staticmethod
    def backward(ctx, grad):  # pylint: disable=arguments-differ
        emb = ctx.emb
        g = np.ascontiguousarray(grad.detach().to("cpu", torch.float32).numpy())
        emb.tables.push(emb.job_id, emb.clock, sparse={emb.table: (ctx.keys, g)})
        emb._steps[0] += 1  # pylint: disable=protected-access
        return None, None, None


# Embeddings of one job on one Tables share a step count: each push is a
# step of the rank's, and a server may acknowledge a step number it holds
# as complete for the rank as a duplicate, without applying it. With a
# count per Embedding, a second Embedding (an MF's item side) repeated the
# first's step numbers.
_embedding_steps = weakref.WeakKeyDictionary()


def _shared_steps(tables, job_id):
    return _embedding_steps.setdefault(tables, {}).setdefault(job_id, [0])


def _embedding_initializer(initializer):
    """An Embedding's rows' initializer as a table spec takes it."""
    if initializer is None or initializer == "normal":
        return {"kind": "normal", "a": 0.0, "b": 1.0}
    if initializer == "zeros":
        return {"kind": "zeros"}
    if isinstance(initializer, dict) and initializer.get("kind") in ("zeros", "constant", "uniform", "normal"):
        return dict(initializer)
    raise ValueError(f"Embedding initializer {initializer!r}: give 'zeros', 'normal' (N(0, 1)) or a dict with "
                     "kind zeros, constant, uniform or normal (a, b, seed)")


class Embedding(torch.nn.Module):
    """An embedding bag of one id per row, backed by sparse table `table` of
    job `job_id`: forward pulls the batch's distinct rows, backward pushes
    their summed gradients, which the servers' optimizer applies. Its table
    is made with the job: pass `spec()` in extra_tables of the
    ParameterServerOptimizer that creates the job (or create the job with it).
    Its pushes are steps of the rank's, one count for all the job's
    Embeddings on these Tables (an MF's user and item sides): use it in ASP
    jobs (under BSP a step would wait for them as for the dense tables'
    pushes).

    Rows start as torch.nn.Embedding's do, N(0, 1), drawn on the servers as
    a pure function of (seed, table, id), so every process sees the same
    row. `initializer` changes that: "zeros", "normal" (N(0, 1)), or a
    table initializer as the servers take it ({"kind": "normal", "a": mean,
    "b": stddev, "seed": s}, {"kind": "uniform", "a": low, "b": high},
    {"kind": "constant", "a": value}). Zeros suit a linear model's weights;
    a factorization needs random rows (both sides at zero get no gradient).

    For ids without end, `admission` ({"min_count": 2} or {"probability":
    0.5}) and `eviction` ({"policy": "lru" or "lfu", "max_rows": N,
    "ttl_steps": S}) bound the table (docs/embeddings.md): rows are then
    made only by pushes of admitted ids, and the servers drop rows past the
    cap; Tables.stats reports rows admitted, rejected and evicted.

    For tables larger than the servers' memory, `storage`
    ({"memory_bytes": B, "spill": "rocksdb"}) keeps B bytes of rows (weights
    and optimizer state, over all servers) in memory and moves the rest to
    each server's disk instead of dropping them (servers need --data_dir);
    `eviction` may then set only "policy", which rows move."""

    def __init__(self, tables, job_id, table, dim, optimizer=None, initializer=None, admission=None, eviction=None,
                 storage=None):
        super().__init__()
        self.tables = tables
        self.job_id = job_id
        self.table = table
        self.dim = dim
        self.optimizer = optimizer or {"kind": "sgd", "learning_rate": 0.01}
        self.initializer = _embedding_initializer(initializer)
        self.admission = dict(admission) if admission else None
        self.eviction = dict(eviction) if eviction else None
        self.storage = dict(storage) if storage else None
        self._steps = _shared_steps(tables, job_id)
        # A parameter-free module still needs a tensor that requires grad
        # for autograd to reach _PullRows.backward.
        self._anchor = torch.zeros((), requires_grad=True)

    @property
    def clock(self):
        """This rank's next step: one count for every Embedding of the job on
        these Tables."""
        return self._steps[0]

    def spec(self):
        spec = {"name": self.table, "kind": "sparse", "dim": self.dim, "optimizer": self.optimizer,
                "initializer": self.initializer}
        if self.admission:
            spec["admission"] = self.admission
        if self.eviction:
            spec["eviction"] = self.eviction
        if self.storage:
            spec["storage"] = self.storage
        return spec

    def forward(self, ids):
        flat = ids.reshape(-1).to("cpu", torch.int64)
        if flat.numel() and int(flat.min()) < 0:
            raise ValueError(f"embedding {self.table}: ids must be >= 0")
        unique, inverse = torch.unique(flat, return_inverse=True)
        keys = np.ascontiguousarray(unique.numpy().astype(np.uint64))
        rows = _PullRows.apply(self._anchor, self, keys)
        return rows[inverse].reshape(*ids.shape, self.dim).to(ids.device)
