"""fulcrum.torch against fulcrum-server processes: one step through the
parameter servers equals the same step of torch.optim in one process, and
an Embedding's rows take their gradients' update on the servers."""
import copy

import numpy as np
import pytest
import torch

import fulcrum
import fulcrum.torch as ftorch


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_steps_through_the_servers_equal_torch_optim_in_one_process(servers, kind):
    torch.manual_seed(0)
    model = mlp()
    tables = fulcrum.Tables(servers.addresses, worker_id=f"torch-{kind}")
    opt = ftorch.ParameterServerOptimizer(model, tables, f"torch-{kind}",
                                          optimizer={"kind": kind, "learning_rate": 0.05},
                                          initializer={"kind": "normal", "b": 0.3, "seed": 7})
    # The module took the servers' initial weights.
    first = next(model.parameters()).detach().clone()
    assert first.abs().sum() > 0 and torch.isfinite(first).all()
    reference = copy.deepcopy(model)
    ref_opt = (torch.optim.SGD(reference.parameters(), lr=0.05) if kind == "sgd"
               else torch.optim.Adam(reference.parameters(), lr=0.05))
    x = torch.randn(32, 8)
    y = torch.randint(0, 3, (32,))
    for _ in range(3):
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    assert opt.clock == 3
    assert not torch.equal(model[0].weight, first)  # it trained
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_an_embedding_pulls_distinct_rows_and_pushes_their_summed_gradients(servers):
    tables = fulcrum.Tables(servers.addresses, worker_id="torch-emb")
    emb = ftorch.Embedding(tables, "torch-emb", "user", dim=4, optimizer={"kind": "sgd", "learning_rate": 0.5},
                           initializer="zeros")
    head = torch.nn.Linear(4, 1)
    ftorch.ParameterServerOptimizer(head, tables, "torch-emb", extra_tables=[emb.spec()])
    ids = torch.tensor([[3, 7], [3, 1_000_000]])
    out = emb(ids)
    assert out.shape == (2, 2, 4)
    assert not out.detach().any()  # new rows start at zeros
    coeff = torch.arange(16, dtype=torch.float32).reshape(2, 2, 4)
    (out * coeff).sum().backward()
    rows = np.empty((3, 4), dtype=np.float32)
    keys = np.array([3, 7, 1_000_000], dtype=np.uint64)
    tables.pull("torch-emb", 1, sparse={"user": (keys, rows)})
    c = coeff.numpy()
    expected = -0.5 * np.stack([c[0, 0] + c[1, 0], c[0, 1], c[1, 1]])  # id 3 twice: its gradients add up
    np.testing.assert_allclose(rows, expected, rtol=0, atol=1e-6)
    # The next forward reads the updated rows.
    np.testing.assert_allclose(emb(torch.tensor([7])).detach().numpy(), expected[1:2], atol=1e-6)
    with pytest.raises(ValueError, match="ids must be >= 0"):
        emb(torch.tensor([-1]))


def test_an_embedding_with_admission_and_eviction_trains_its_hot_ids_and_drops_the_rest(servers):
    # Hot ids 0-15 come every step; 16 fresh ids come in two steps running
    # and never again. min_count 2 rejects each id's first push; ttl_steps 3
    # drops the fresh ids' rows soon after; the hot rows learn their target.
    tables = fulcrum.Tables(servers.addresses, worker_id="torch-life")
    emb = ftorch.Embedding(tables, "torch-life", "ids", dim=1, optimizer={"kind": "sgd", "learning_rate": 0.2},
                           initializer="zeros", admission={"min_count": 2},
                           eviction={"policy": "lru", "max_rows": 1024, "ttl_steps": 3})
    assert emb.spec()["eviction"]["max_rows"] == 1024
    ftorch.ParameterServerOptimizer(torch.nn.Linear(1, 1), tables, "torch-life", extra_tables=[emb.spec()])
    hot = torch.arange(16)
    steps = 30
    for step in range(steps):
        fresh = 1000 + 16 * (step // 2) + torch.arange(16)  # each fresh group in two steps running
        ids = torch.cat([hot, fresh])
        target = torch.cat([torch.ones(16), torch.zeros(16)])
        loss = ((emb(ids).squeeze(-1) - target) ** 2).sum()
        loss.backward()
    rows = np.empty((16, 1), dtype=np.float32)
    tables.pull("torch-life", emb.clock, sparse={"ids": (np.arange(16, dtype=np.uint64), rows)})
    assert rows.min() > 0.9, rows.ravel()
    stats = [tables.stats("torch-life", i) for i in range(len(servers.addresses))]
    total = {k: sum(s[k] for s in stats) for k in ("sparse_rows", "sparse_rows_admitted", "sparse_rows_rejected",
                                                  "sparse_rows_evicted")}
    assert total["sparse_rows_admitted"] == 16 + 16 * (steps // 2), total  # every id at its second push
    assert total["sparse_rows_rejected"] >= 16 + 16 * (steps // 2), total  # and not at its first
    assert total["sparse_rows_evicted"] > 0, total
    assert total["sparse_rows"] == total["sparse_rows_admitted"] - total["sparse_rows_evicted"], total
    # A dropped row reads as it would start: its initial value.
    gone = np.empty((1, 1), dtype=np.float32)
    tables.pull("torch-life", emb.clock, sparse={"ids": (np.array([1000], dtype=np.uint64), gone)})
    assert gone[0, 0] == 0.0


def test_an_embedding_larger_than_its_memory_budget_spills_to_disk_and_trains_as_one_that_fits(servers):
    # Two jobs see the same ids and gradients: one keeps every row in
    # memory, the other 512 rows' worth (2 a virtual shard of 256) and the
    # rest on disk. Every row reads the same, bit for bit, at the end.
    tables = fulcrum.Tables(servers.addresses, worker_id="torch-spill")
    opt = {"kind": "adagrad", "learning_rate": 0.1}
    row_bytes = 4 * 2 * 4  # dim 4: weights and the Adagrad accumulator
    embs = {}
    for job, storage in (("torch-spill-mem", None), ("torch-spill-disk", {"memory_bytes": 512 * row_bytes,
                                                                          "spill": "rocksdb"})):
        embs[job] = ftorch.Embedding(tables, job, "ids", dim=4, optimizer=opt, storage=storage)
        tables.create_job({"job_id": job, "num_workers": 1, "consistency": {"model": "asp"},
                           "tables": [embs[job].spec()]})
    rng = np.random.default_rng(5)
    for _ in range(40):
        ids = torch.from_numpy(rng.zipf(1.3, 256) % 2000)
        for job, emb in embs.items():
            (emb(ids) ** 2).sum().backward()
    # Rows pushed (the reads below make rows in the job without a lifecycle).
    mem = sum(tables.stats("torch-spill-mem", i)["sparse_rows"] for i in range(len(servers.addresses)))
    keys = np.arange(2000, dtype=np.uint64)
    rows = {}
    for job, emb in embs.items():
        rows[job] = np.empty((2000, 4), dtype=np.float32)
        tables.pull(job, emb.clock, sparse={"ids": (keys, rows[job])})
    np.testing.assert_array_equal(rows["torch-spill-disk"], rows["torch-spill-mem"])
    stats = [tables.stats("torch-spill-disk", i) for i in range(len(servers.addresses))]
    total = {k: sum(s[k] for s in stats) for k in ("sparse_rows", "sparse_rows_cold", "sparse_rows_demoted",
                                                  "sparse_rows_promoted")}
    assert total["sparse_rows"] <= 512 and total["sparse_rows_cold"] > 0, total
    assert total["sparse_rows"] + total["sparse_rows_cold"] == mem, (total, mem)
    assert total["sparse_rows_promoted"] > 0, total
    assert total["sparse_rows_demoted"] - total["sparse_rows_promoted"] == total["sparse_rows_cold"], total


def test_embedding_rows_start_as_torchs_do_and_the_same_in_every_process(servers):
    tables = fulcrum.Tables(servers.addresses, worker_id="torch-emb-init")
    emb = ftorch.Embedding(tables, "torch-emb-init", "user", dim=8)
    tables.create_job({"job_id": "torch-emb-init", "num_workers": 1, "consistency": {"model": "asp"},
                       "tables": [emb.spec()]})
    rows = emb(torch.arange(4000)).detach().numpy()
    # torch.nn.Embedding's default, N(0, 1).
    assert abs(rows.mean()) < 0.03 and abs(rows.std() - 1.0) < 0.03
    # A second process (another client) pulls the same rows.
    other = fulcrum.Tables(servers.addresses, worker_id="torch-emb-init-2")
    other.open_job("torch-emb-init")
    again = np.empty((3, 8), dtype=np.float32)
    other.pull("torch-emb-init", 0, sparse={"user": (np.array([0, 1, 2], dtype=np.uint64), again)})
    np.testing.assert_array_equal(again, rows[:3])
    with pytest.raises(ValueError, match="Embedding initializer 'xavier'"):
        ftorch.Embedding(tables, "torch-emb-init", "item", dim=8, initializer="xavier")


def test_matrix_factorization_with_two_embeddings_learns_and_zero_rows_do_not(servers):
    # Ratings of rank 3 (centred), 60 users x 50 items, 1 500 of them seen.
    rng = np.random.default_rng(3)
    u, v = rng.normal(size=(60, 3)), rng.normal(size=(50, 3))
    pairs = rng.choice(60 * 50, size=1500, replace=False)
    users, items = torch.tensor(pairs // 50), torch.tensor(pairs % 50)
    ratings = torch.tensor((u[pairs // 50] * v[pairs % 50]).sum(1), dtype=torch.float32)
    baseline = float(ratings.pow(2).mean().sqrt())  # predicting the mean (0)

    def train(init, name):
        tables = fulcrum.Tables(servers.addresses, worker_id=name)
        sgd = {"kind": "adagrad", "learning_rate": 0.3, "initial_accumulator": 1e-10}
        user = ftorch.Embedding(tables, name, "user", dim=4, optimizer=sgd, initializer=init)
        item = ftorch.Embedding(tables, name, "item", dim=4, optimizer=sgd, initializer=init)
        tables.create_job({"job_id": name, "num_workers": 1, "consistency": {"model": "asp"},
                           "tables": [user.spec(), item.spec()]})
        for _ in range(40):
            for b in range(0, 1500, 250):
                pred = (user(users[b:b + 250]) * item(items[b:b + 250])).sum(1)
                ((pred - ratings[b:b + 250]).pow(2).mean() / 2).backward()
        with torch.no_grad():
            return float(((user(users) * item(items)).sum(1) - ratings).pow(2).mean().sqrt())

    def plain_torch(std):
        torch.manual_seed(0)
        user, item = torch.nn.Embedding(60, 4), torch.nn.Embedding(50, 4)
        for e in (user, item):
            torch.nn.init.normal_(e.weight, 0, std)
        opt = torch.optim.Adagrad(list(user.parameters()) + list(item.parameters()), lr=0.3)
        for _ in range(40):
            for b in range(0, 1500, 250):
                opt.zero_grad()
                pred = (user(users[b:b + 250]) * item(items[b:b + 250])).sum(1)
                ((pred - ratings[b:b + 250]).pow(2).mean() / 2).backward()
                opt.step()
        with torch.no_grad():
            return float(((user(users) * item(items)).sum(1) - ratings).pow(2).mean().sqrt())

    learned, peer = train({"kind": "normal", "b": 0.3}, "torch-mf"), plain_torch(0.3)
    default, default_peer = train(None, "torch-mf-default"), plain_torch(1.0)
    stuck = train("zeros", "torch-mf-zeros")
    print(f"MF train RMSE (mean only {baseline:.4f}): N(0, 0.3) rows {learned:.4f}, plain torch {peer:.4f}; "
          f"default N(0, 1) rows {default:.4f}, plain torch {default_peer:.4f}; zero rows {stuck:.4f}")
    # As plain torch with the same initializer and optimizer (other draws).
    assert learned < 0.05 * baseline and learned <= 2 * peer + 0.01
    assert default < 0.1 * baseline and default <= 2 * default_peer + 0.01
    assert stuck == pytest.approx(baseline, rel=1e-4)  # both sides at zero: no gradient ever


def test_the_torch_initializer_draws_from_pytorchs_default_range(servers):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 5))
    tables = fulcrum.Tables(servers.addresses, worker_id="torch-init")
    ftorch.ParameterServerOptimizer(model, tables, "torch-init", initializer="torch")
    for layer, fan_in in ((model[0], 3 * 3 * 3), (model[2], 8 * 4 * 4)):
        bound = 1 / fan_in ** 0.5
        w, b = layer.weight, layer.bias
        assert w.abs().max() <= bound and b.abs().max() <= bound
        # Spread over the range (U(-bound, bound) has std bound / sqrt(3)).
        assert w.abs().max() > 0.9 * bound and 0.45 * bound < w.std() < 0.7 * bound
        assert b.abs().max() > 0 and len(set(b.tolist())) == len(b)


def test_parameters_that_are_not_float32_are_refused(servers):
    tables = fulcrum.Tables(servers.addresses, worker_id="torch-f64")
    with pytest.raises(ValueError, match="float32"):
        ftorch.ParameterServerOptimizer(torch.nn.Linear(2, 2).double(), tables, "torch-f64")


@pytest.mark.parametrize("consistency", ["asp", "bsp"])
def test_pushing_each_layer_as_backward_produces_it_trains_the_same_weights(servers, consistency):
    torch.manual_seed(1)
    models = [mlp() for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    init = {"kind": "normal", "b": 0.3, "seed": 3}
    tables = fulcrum.Tables(servers.addresses, worker_id=f"overlap-{consistency}")
    # push_group_bytes=1: every parameter is its own part, pushed from
    # backward's hook; 256 KiB groups this small model all into step()'s push.
    eager = ftorch.ParameterServerOptimizer(models[0], tables, f"overlap-{consistency}-a", consistency=consistency,
                                            initializer=init, overlap=True, push_group_bytes=1)
    grouped = ftorch.ParameterServerOptimizer(models[1], tables, f"overlap-{consistency}-b", consistency=consistency,
                                              initializer=init, overlap=True)
    serial = ftorch.ParameterServerOptimizer(models[2], tables, f"overlap-{consistency}-c", consistency=consistency,
                                             initializer=init, overlap=False)
    groups = []
    real_push_async = tables.push_async

    def counting_push_async(*args, **kwargs):
        groups.append(sorted(kwargs["dense"]))
        return real_push_async(*args, **kwargs)

    tables.push_async = counting_push_async
    x = torch.randn(16, 8)
    y = torch.randint(0, 3, (16,))
    for _ in range(3):
        for m, o in zip(models, (eager, grouped, serial)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    # Three of the four parameters went from backward each step (the last
    # one backward produces goes with step()'s push, which ends the step).
    assert len(groups) == 9 and all(len(g) == 1 for g in groups)
    for name in ("0.bias", "2.weight", "2.bias"):
        assert [name] in groups
    for m in models[1:]:
        for p, q in zip(models[0].parameters(), m.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert eager.clock == 3 and serial.clock == 3


def test_a_second_backward_before_step_is_refused_under_overlap(servers):
    model = mlp()
    tables = fulcrum.Tables(servers.addresses, worker_id="overlap-twice")
    opt = ftorch.ParameterServerOptimizer(model, tables, "overlap-twice", overlap=True)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match="second gradient before step"):
        model(x).sum().backward()
    opt.zero_grad()
    accumulate = ftorch.ParameterServerOptimizer(mlp(), tables, "overlap-twice-b", overlap=False)
    for _ in range(2):
        accumulate.module(x).sum().backward()
    accumulate.step()  # the sum of both backwards, as torch.optim would take it
    assert accumulate.clock == 1


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no GPU: torch.cuda.is_available() is False on this machine, so CUDA parameters and "
                           "embeddings are not exercised here")
def test_cuda_parameters_and_embeddings_train_as_cpu_ones(servers):
    torch.manual_seed(2)
    cpu = mlp()
    gpu = copy.deepcopy(cpu).cuda()
    init = {"kind": "normal", "b": 0.3, "seed": 5}
    tables = fulcrum.Tables(servers.addresses, worker_id="torch-cuda")
    on_cpu = ftorch.ParameterServerOptimizer(cpu, tables, "torch-cuda-a", initializer=init)
    on_gpu = ftorch.ParameterServerOptimizer(gpu, tables, "torch-cuda-b", initializer=init)
    assert on_gpu.overlap and not on_cpu.overlap  # pushed during backward on the GPU only
    x = torch.randn(16, 8)
    y = torch.randint(0, 3, (16,))
    for _ in range(3):
        for m, o, dev in ((cpu, on_cpu, "cpu"), (gpu, on_gpu, "cuda")):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x.to(dev)), y.to(dev)).backward()
            o.step()
    for p, q in zip(cpu.parameters(), gpu.parameters()):
        assert q.is_cuda
        torch.testing.assert_close(p, q.cpu(), rtol=1e-5, atol=1e-5)
    emb = ftorch.Embedding(tables, "torch-cuda-c", "user", dim=4, optimizer={"kind": "sgd", "learning_rate": 0.5},
                           initializer="zeros")
    ftorch.ParameterServerOptimizer(torch.nn.Linear(4, 1).cuda(), tables, "torch-cuda-c", extra_tables=[emb.spec()])
    out = emb(torch.tensor([[3, 7]], device="cuda"))
    assert out.is_cuda and out.shape == (1, 2, 4)
    out.sum().backward()
    rows = np.empty((1, 4), dtype=np.float32)
    tables.pull("torch-cuda-c", 1, sparse={"user": (np.array([3], dtype=np.uint64), rows)})
    np.testing.assert_allclose(rows, -0.5 * np.ones((1, 4)), atol=1e-6)
