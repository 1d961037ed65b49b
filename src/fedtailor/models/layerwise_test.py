"""The layer-structured subspace: exact orthonormality, coefficient gradients equal P^T of per-record gradients,
an exact rank split, and clear refusals of models it cannot serve."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedtailor.models.layerwise import LayerKroneckerSubspace, allocation_targets, layer_ranks, model_layers
from fedtailor.models.lenet import MLP, LeNet
from fedtailor.models.subspace import make_subspace
from fedtailor.privacy.mechanisms import per_example_gradients


class Mixed(nn.Module):
    """A conv without bias, padding and stride, then a Linear applied at every position, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1, stride=2, bias=False)
        self.token = nn.Linear(4, 5)
        self.head = nn.Linear(3 * 4 * 5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.relu(self.conv(x))  # (n, 3, 4, 4)
        z = torch.tanh(self.token(z))  # Linear over the last axis: (n, 3, 4, 5)
        return self.head(z.flatten(1))


def _data(shape: tuple[int, ...], classes: int, n: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return torch.rand(n, *shape, generator=gen, dtype=torch.float64), torch.randint(0, classes, (n,), generator=gen)


@pytest.mark.parametrize(
    ("model_fn", "shape", "classes", "rank"),
    [
        (lambda: MLP(in_features=64, hidden=16), (1, 8, 8), 10, 96),
        (lambda: Mixed(), (2, 8, 8), 4, 40),
    ],
)
def test_p_has_orthonormal_columns_and_project_is_its_transpose(model_fn, shape, classes, rank):
    model = model_fn().double()
    sub = LayerKroneckerSubspace(model=model, rank=rank, seed=3, dtype=torch.float64)
    p = sub.dense()
    torch.testing.assert_close(p.T @ p, torch.eye(rank, dtype=torch.float64), atol=1e-12, rtol=0)
    g = torch.randn(4, sub.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    a = torch.randn(4, rank, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(sub.project(g), g @ p)
    torch.testing.assert_close(sub.expand(a), a @ p.T)
    # every layer's parameters (weights and biases) are reached: no coordinate is silently left at theta_ref
    assert (p.abs().amax(1) > 0).all()


@pytest.mark.parametrize(
    ("model_fn", "shape", "classes", "rank"),
    [
        (lambda: MLP(in_features=64, hidden=16), (1, 8, 8), 10, 96),
        (lambda: Mixed(), (2, 8, 8), 4, 40),
        (lambda: LeNet(), (1, 28, 28), 10, 2048),
    ],
)
def test_coefficient_gradients_equal_p_transpose_of_per_record_gradients(model_fn, shape, classes, rank):
    """One batched pass gives P^T g_z for each record z exactly (float64), including at generated parameters."""
    model = model_fn().double()
    sub = LayerKroneckerSubspace(model=model, rank=rank, seed=4, dtype=torch.float64)
    x, y = _data(shape, classes)
    gen = torch.Generator().manual_seed(9)
    params = {
        n: p.detach() + 0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype) for n, p in model.named_parameters()
    }
    got = sub.per_record_coefficients(model, F.cross_entropy, x, y, params=params)
    want = sub.project(per_example_gradients(model, F.cross_entropy, x, y, params=params))
    assert got.shape == (len(x), rank)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert got.abs().amax() > 1e-3  # not trivially zero
    # the module's own parameters are untouched and no .grad was written
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("rank", [5, 97, 1000, 4093, 16_384, 65_536])
def test_the_rank_split_is_exact_and_fits_every_layer(rank):
    shapes = [(lay.out, lay.cols) for lay in model_layers(LeNet())]
    split = layer_ranks(shapes, rank)
    assert sum(k1 * k2 for k1, k2 in split) == rank
    assert all(1 <= k1 <= r and 1 <= k2 <= c for (k1, k2), (r, c) in zip(split, shapes))
    if rank == 16_384:  # each layer's share is near its share of the parameters
        d = sum(r * c for r, c in shapes)
        for (k1, k2), (r, c) in zip(split, shapes):
            assert abs(k1 * k2 / rank - r * c / d) < 0.01


@pytest.mark.parametrize("allocation", ["size", "sqrt", "equal"])
@pytest.mark.parametrize("rank", [5, 1000, 16_384, 65_536])
def test_each_allocation_waterfills_its_weights_and_the_split_stays_exact(allocation, rank):
    shapes = [(lay.out, lay.cols) for lay in model_layers(LeNet())]
    sizes = [r * c for r, c in shapes]
    t = allocation_targets(sizes, rank, allocation)
    assert sum(t) == pytest.approx(rank) and all(0 < x <= n for x, n in zip(t, sizes))
    weight = {"size": float, "sqrt": lambda n: n**0.5, "equal": lambda n: 1.0}[allocation]
    free = [i for i in range(len(sizes)) if t[i] < sizes[i]]  # uncapped layers share in proportion to the weight
    ratios = [t[i] / weight(sizes[i]) for i in free]
    assert max(ratios) == pytest.approx(min(ratios))
    capped = [i for i in range(len(sizes)) if t[i] == sizes[i]]  # a capped layer would have had more
    assert all(weight(sizes[i]) * ratios[0] >= sizes[i] for i in capped) if free else True
    split = layer_ranks(shapes, rank, allocation)
    assert sum(k1 * k2 for k1, k2 in split) == rank
    assert all(1 <= k1 <= r and 1 <= k2 <= c for (k1, k2), (r, c) in zip(split, shapes))
    if rank == 16_384:  # every layer but the largest (which takes the remainder) gets its target to a few %
        big = sizes.index(max(sizes))
        assert all(abs(k1 * k2 - t[i]) <= 0.05 * t[i] + 1 for i, (k1, k2) in enumerate(split) if i != big)


def test_the_sqrt_allocation_gives_small_layers_more_and_changes_p_only_through_its_shapes():
    shapes = [(lay.out, lay.cols) for lay in model_layers(LeNet())]
    by_size, by_sqrt = layer_ranks(shapes, 16_384), layer_ranks(shapes, 16_384, "sqrt")
    small = min(range(len(shapes)), key=lambda i: shapes[i][0] * shapes[i][1])
    assert by_sqrt[small][0] * by_sqrt[small][1] > by_size[small][0] * by_size[small][1]
    p = make_subspace(dim=85_822, rank=16_384, seed=41, transform="layer-kronecker", model=LeNet(), allocation="sqrt")
    assert p.shapes == by_sqrt and p.to("cpu", dtype=torch.float64).shapes == by_sqrt  # to() keeps it
    v = torch.randn(2, 16_384, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(p.project(p.expand(v)), v, atol=1e-5, rtol=0)


def test_lenet_p_is_deterministic_in_the_seed_and_served_by_make_subspace():
    model = LeNet()
    a = make_subspace(dim=85_822, rank=16_384, seed=41, transform="layer-kronecker", model=model)
    b = LayerKroneckerSubspace(model=LeNet(), rank=16_384, seed=41)
    c = LayerKroneckerSubspace(model=model, rank=16_384, seed=42)
    assert all(torch.equal(x, y) for x, y in zip(a.A + a.B, b.A + b.B))
    assert not torch.equal(a.A[0], c.A[0])
    v = torch.randn(2, 16_384, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(a.project(a.expand(v)), v, atol=1e-5, rtol=0)  # float32 orthonormal to rounding


def test_models_it_cannot_serve_are_refused_with_the_alternative_named():
    with pytest.raises(ValueError, match="BatchNorm1d.*'kronecker' or 'blocked-dct'"):
        LayerKroneckerSubspace(model=nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), rank=4, seed=0)
    with pytest.raises(ValueError, match="grouped convolution"):
        LayerKroneckerSubspace(model=nn.Conv2d(4, 4, 3, groups=2), rank=4, seed=0)
    with pytest.raises(ValueError, match="below the number of layers"):
        LayerKroneckerSubspace(model=LeNet(), rank=3, seed=0)
    with pytest.raises(ValueError, match="pass model="):
        make_subspace(dim=10, rank=2, seed=0, transform="layer-kronecker")

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(torch.relu(self.fc(x)))

    sub = LayerKroneckerSubspace(model=Twice(), rank=4, seed=0)
    with pytest.raises(ValueError, match="ran twice"):
        sub.per_record_coefficients(Twice(), F.cross_entropy, torch.rand(2, 3), torch.tensor([0, 1]))
