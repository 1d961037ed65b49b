"""The hand-written backward over stacked clients (fl/batched.py) gives the models of one autograd
functional_sgd run per client: the pFL networks (Linear, Conv2d, ReLU, max-pool, flatten), every objective
term, momentum, several epochs, frozen names, ragged client sizes; unsupported models are recognised; every
base method runs on it, not on the vmap fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedtailor.fl.batched import (
    Collect,
    Conv2d,
    MaxPool2d,
    Objective,
    ReLU,
    Unsupported,
    compile_chain,
    explicit_sgd,
    try_compile,
)
from fedtailor.fl.registry import fedlag_bases
from fedtailor.fl.training import functional_sgd
from fedtailor.models.lenet import MLP, LeNet
from fedtailor.models.pflnets import DNN, FedAvgCNN

SIZES = [3, 8, 19, 24, 11]  # fewer records than a batch, an exact batch, remainders, a group of equal remainders


def _setup(model: nn.Module, shape: tuple[int, ...], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    c = len(SIZES)
    theta = {
        n: p.detach().expand(c, *p.shape) + 0.01 * torch.randn(c, *p.shape, generator=gen)
        for n, p in model.named_parameters()
    }
    xs = [torch.rand(n, *shape, generator=gen) for n in SIZES]
    ys = [torch.randint(0, 10, (n,), generator=gen) for n in SIZES]
    return theta, xs, ys


def _gens():
    return [torch.Generator().manual_seed(100 + c) for c in range(len(SIZES))]


@pytest.mark.parametrize("model_cls", [DNN, FedAvgCNN, LeNet, MLP])
def test_the_pfl_networks_compile_to_chains_of_their_layers(model_cls):
    model = model_cls(in_features=784) if model_cls is MLP else model_cls()
    chain = compile_chain(model)
    assert sorted(chain.names) == sorted(n for n, _ in model.named_parameters())
    x = torch.rand(4, 1, 28, 28)
    h = x.unsqueeze(0)
    for layer in chain.layers:  # the chain's forward is the model's forward
        h, _ = layer.forward({n: p.detach().unsqueeze(0) for n, p in model.named_parameters()}, h)
    torch.testing.assert_close(h[0], model(x).detach())


def test_pooling_moves_before_the_relu_and_changes_no_value_or_gradient():
    """relu then maxpool == maxpool then relu, bit for bit, in value and in gradient (ties at 0 included: the
    inputs hold many exact zeros and equal negatives)."""
    model = FedAvgCNN()
    chain = compile_chain(model)
    kinds = [type(layer).__name__ for layer in chain.layers]
    assert kinds[kinds.index("Conv2d") + 1 : kinds.index("Conv2d") + 3] == ["MaxPool2d", "ReLU"]
    h = torch.randn(3, 4, 32, 12, 12, generator=torch.Generator().manual_seed(0)).round(
        decimals=1
    )  # coarse values: many ties inside the pooling windows
    h[:, :, :, ::2] = -1.0
    pool, relu = MaxPool2d(), ReLU()
    out_model, ctx_r = relu.forward({}, h)
    out_model, ctx_p = pool.forward({}, out_model)
    out_chain, ctx_p2 = pool.forward({}, h)
    out_chain, ctx_r2 = relu.forward({}, out_chain)
    assert torch.equal(out_model, out_chain)
    g = torch.randn_like(out_model)
    sink = Collect(frozenset())
    grad_model = relu.backward({}, pool.backward({}, g, ctx_p, sink, True), ctx_r, sink, True)
    grad_chain = pool.backward({}, relu.backward({}, g, ctx_r2, sink, True), ctx_p2, sink, True)
    assert torch.equal(grad_model, grad_chain)


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.fc(x)


class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.fc(x))


def test_convolutions_of_all_clients_are_one_grouped_convolution_on_a_shared_layout():
    """Each client's feature maps equal its own convolution, and a convolution's output reaches the next one
    through pooling and the ReLU without a copy (one channels-last batch, clients as groups)."""
    gen = torch.Generator().manual_seed(0)
    conv1, conv2 = Conv2d(names=("w1", "b1")), Conv2d(names=("w2",))
    p = {
        "w1": torch.randn(3, 4, 2, 3, 3, generator=gen),
        "b1": torch.randn(3, 4, generator=gen),
        "w2": torch.randn(3, 5, 4, 3, 3, generator=gen),
    }
    x = torch.randn(3, 6, 2, 12, 12, generator=gen)  # 3 clients, 6 records each
    h, _ = conv1.forward(p, x)
    h, _ = MaxPool2d().forward(p, h)
    h, _ = ReLU().forward(p, h)
    out, (x2, _) = conv2.forward(p, h)
    assert x2.data_ptr() == h.data_ptr()  # the second convolution read the ReLU's output in place
    for c in range(3):
        ref = F.relu(F.max_pool2d(F.conv2d(x[c], p["w1"][c], p["b1"][c]), 2))
        torch.testing.assert_close(h[c], ref)
        torch.testing.assert_close(out[c], F.conv2d(ref, p["w2"][c]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_cls", [_Residual, _Norm])
def test_models_that_are_not_chains_of_supported_layers_are_recognised(model_cls):
    with pytest.raises(Unsupported):
        compile_chain(model_cls())
    assert try_compile(model_cls()) is None


def _reference_loss(model, objective: Objective):
    """The objective with autograd for one client (the same definition as LocalTraining.objective_loss)."""

    def loss(p, aux, x, y):
        theta = {n: p[n] for n, _ in model.named_parameters()}
        z = functional_call(model, theta, (x,))
        value = F.cross_entropy(z if objective.offset is None else z + aux["offset"], y)
        if objective.anchor:
            value = value + 0.5 * objective.mu * sum(
                (theta[n] - aux[f"anchor/{n}"]).pow(2).sum() for n in objective.anchor
            )
        return value

    return loss


@pytest.mark.parametrize("model_cls", [DNN, FedAvgCNN])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_explicit_sgd_equals_one_autograd_run_per_client(model_cls, momentum):
    torch.manual_seed(0)  # a fixed initialisation (an unlucky one puts a ReLU or max-pool tie within rounding)
    model = model_cls()
    theta, xs, ys = _setup(model, (1, 28, 28))
    anchor = {n: t + 0.05 for n, t in theta.items() if n.startswith("fc")}  # a prox anchor on some names
    offset = torch.randn(len(SIZES), 10, generator=torch.Generator().manual_seed(3))
    objective = Objective(mu=0.3, anchor=anchor, offset=offset)
    trainable = frozenset(theta) - {"fc.bias"}  # a frozen name
    kw = {"trainable": trainable, "epochs": 2, "batch_size": 8, "lr": 0.05, "momentum": momentum}
    got, means = explicit_sgd(compile_chain(model), theta, xs, ys, objective=objective, generators=_gens(), **kw)
    for c, g in enumerate(_gens()):
        one = objective.with_tensors({k: t[c] for k, t in objective.tensors().items()})
        want, mean = functional_sgd(
            _reference_loss(model, one),
            {n: t[c] for n, t in theta.items()},
            xs[c],
            ys[c],
            aux=one.tensors(),
            generator=g,
            **kw,
        )
        for n, t in want.items():
            if n in trainable:  # float32 kernels sum in other orders: within 0.1% of the update, in norm
                assert float((got[n][c] - t).norm()) <= 1e-3 * float((t - theta[n][c]).norm()), n
        assert means[c] == pytest.approx(mean, rel=1e-4)
    torch.testing.assert_close(got["fc.bias"], theta["fc.bias"], rtol=0, atol=0)  # frozen: untouched


def test_the_inputs_are_not_modified_and_thread_count_changes_no_batch_order():
    model = DNN()
    theta, xs, ys = _setup(model, (1, 28, 28))
    before = {n: t.clone() for n, t in theta.items()}
    kw = {"trainable": frozenset(theta), "epochs": 1, "batch_size": 8, "lr": 0.05}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, m1 = explicit_sgd(compile_chain(model), theta, xs, ys, generators=_gens(), **kw)
        torch.set_num_threads(2)
        two, m2 = explicit_sgd(compile_chain(model), theta, xs, ys, generators=_gens(), **kw)
    finally:
        torch.set_num_threads(threads)
    for n, t in before.items():
        assert torch.equal(theta[n], t)
        torch.testing.assert_close(one[n], two[n], rtol=1e-5, atol=1e-6)  # the same batches: rounding only
    assert m1 == pytest.approx(m2, rel=1e-5)


def test_collect_sums_the_contributions_of_a_name():
    sink = Collect(frozenset({"w"}))
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    sink.bmm("w", a, b)
    sink.add("w", torch.ones(2, 3, 5), alpha=2.0)
    torch.testing.assert_close(sink.grads["w"], torch.bmm(a, b) + 2.0)


@pytest.mark.parametrize("method", fedlag_bases())
def test_every_base_runs_its_batched_local_program_on_the_explicit_backward(method, monkeypatch):
    """With the vmap fallback disabled, a vectorized run of every base (FedLAG on top) still completes: its
    local programs (FedProx's prox term, Ditto's two models, FedRep's order, FedBABU's frozen head, FedRoD's two
    heads, APFL's mixture, LG-FedAvg, FedPer) all run on the hand-written backward. Their equality to the
    per-client path is methods/pfl/vectorized_test.py."""
    import fedtailor.methods.pfl.local as local
    from fedtailor.methods.pfl.fedlag_test import _run

    def refuse(*a, **k):
        raise AssertionError("the vmap fallback ran")

    monkeypatch.setattr(local, "batched_sgd", refuse)
    _, method_obj, result = _run(method, "method.momentum=0.5", "method.fedlag.top_k=1", "method.fedlag.warmup=2")
    assert getattr(method_obj, "base", method_obj).chain is not None
    assert result.history


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_explicit_sgd_on_cuda_equals_the_cpu():
    model = FedAvgCNN()
    theta, xs, ys = _setup(model, (1, 28, 28))
    kw = {"trainable": frozenset(theta), "epochs": 1, "batch_size": 8, "lr": 0.05, "momentum": 0.5}
    cpu, _ = explicit_sgd(compile_chain(model), theta, xs, ys, generators=_gens(), **kw)
    dev = torch.device("cuda")
    gens = [torch.Generator(device=dev).manual_seed(100 + c) for c in range(len(SIZES))]
    cuda, _ = explicit_sgd(
        compile_chain(model),
        {n: t.to(dev) for n, t in theta.items()},
        [x.to(dev) for x in xs],
        [y.to(dev) for y in ys],
        generators=gens,
        **kw,
    )
    for n, t in cuda.items():
        assert t.device.type == "cuda" and t.shape == cpu[n].shape
