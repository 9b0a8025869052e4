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
    emb = ftorch.Embedding(tables, "torch-emb", "user", dim=4, optimizer={"kind": "sgd", "learning_rate": 0.5})
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
    emb = ftorch.Embedding(tables, "torch-cuda-c", "user", dim=4, optimizer={"kind": "sgd", "learning_rate": 0.5})
    ftorch.ParameterServerOptimizer(torch.nn.Linear(4, 1).cuda(), tables, "torch-cuda-c", extra_tables=[emb.spec()])
    out = emb(torch.tensor([[3, 7]], device="cuda"))
    assert out.is_cuda and out.shape == (1, 2, 4)
    out.sum().backward()
    rows = np.empty((1, 4), dtype=np.float32)
    tables.pull("torch-cuda-c", 1, sparse={"user": (np.array([3], dtype=np.uint64), rows)})
    np.testing.assert_allclose(rows, -0.5 * np.ones((1, 4)), atol=1e-6)
