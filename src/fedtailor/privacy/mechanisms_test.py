"""Per-record gradients equal a Python loop; clipping, fixed-denominator mean and noise behave as stated."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from scipy import stats
from torch import nn

from fedtailor.privacy.mechanisms import (
    clip_rows,
    clipped_mean,
    flatten_named,
    gaussian_mechanism,
    per_example_gradients,
    row_norms,
    unflatten_like,
)
from fedtailor.rng import torch_generator


class SmallLeNet(nn.Module):
    """LeNet shape at small size: conv-relu-pool twice, then three linear layers (1x16x16 inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 6, 3), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(6 * 2 * 2, 12), nn.ReLU(), nn.Linear(12, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _mlp_with_buffers() -> nn.Module:
    """An MLP with a BatchNorm in eval mode: its running statistics are buffers that change the output."""
    model = nn.Sequential(nn.Linear(7, 9), nn.BatchNorm1d(9), nn.Tanh(), nn.Linear(9, 3))
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    return model.eval()


def _loop_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    rows = []
    for i in range(x.shape[0]):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        rows.append(torch.cat([p.grad.reshape(-1) for _, p in model.named_parameters()]))
    return torch.stack(rows)


@pytest.mark.parametrize("kind", ["lenet", "mlp"])
def test_per_example_gradients_equal_a_python_loop(kind: str) -> None:
    torch.manual_seed(0)
    if kind == "lenet":
        model, x = SmallLeNet().double(), torch.rand(12, 1, 16, 16, dtype=torch.float64)
        y = torch.randint(0, 10, (12,))
    else:
        model, x = _mlp_with_buffers().double(), torch.randn(12, 7, dtype=torch.float64)
        y = torch.randint(0, 3, (12,))
    got = per_example_gradients(model, nn.functional.cross_entropy, x, y)
    want = _loop_gradients(model, x, y)
    assert got.shape == (12, sum(p.numel() for p in model.parameters()))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    chunked = per_example_gradients(model, nn.functional.cross_entropy, x, y, chunk_size=5)
    torch.testing.assert_close(chunked, want, rtol=1e-10, atol=1e-12)


def test_buffers_are_used() -> None:
    """Changing the BatchNorm running statistics must change the per-record gradients."""
    torch.manual_seed(1)
    model = _mlp_with_buffers()
    x, y = torch.randn(4, 7), torch.randint(0, 3, (4,))
    before = per_example_gradients(model, nn.functional.cross_entropy, x, y)
    with torch.no_grad():
        model[1].running_var.mul_(4.0)
    after = per_example_gradients(model, nn.functional.cross_entropy, x, y)
    torch.testing.assert_close(after, _loop_gradients(model, x, y), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(before, after)


def test_params_override_differentiates_at_the_given_point() -> None:
    torch.manual_seed(2)
    model = SmallLeNet()
    x, y = torch.rand(5, 1, 16, 16), torch.randint(0, 10, (5,))
    theta = {name: p.detach() * 1.5 + 0.01 for name, p in reversed(list(model.named_parameters()))}
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in moved.named_parameters():
            p.copy_(theta[name])
    got = per_example_gradients(model, nn.functional.cross_entropy, x, y, params=theta)
    torch.testing.assert_close(got, _loop_gradients(moved, x, y), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="missing"):
        per_example_gradients(model, nn.functional.cross_entropy, x, y, params=dict(list(theta.items())[1:]))


def test_unsafe_modules_and_bad_shapes_are_refused() -> None:
    model = _mlp_with_buffers().train()
    x, y = torch.randn(3, 7), torch.randint(0, 3, (3,))
    with pytest.raises(ValueError, match="BatchNorm in training mode"):
        per_example_gradients(model, nn.functional.cross_entropy, x, y)
    drop = nn.Sequential(nn.Linear(7, 3), nn.Dropout(0.5))
    with pytest.raises(ValueError, match="dropout"):
        per_example_gradients(drop, nn.functional.cross_entropy, x, y)
    with pytest.raises(ValueError, match="records"):
        per_example_gradients(model.eval(), nn.functional.cross_entropy, x, y[:2])


def test_flatten_unflatten_round_trip_in_named_parameter_order() -> None:
    model = SmallLeNet()
    named = dict(model.named_parameters())
    flat = flatten_named(named)
    assert flat.shape == (sum(p.numel() for p in model.parameters()),)
    torch.testing.assert_close(flat, torch.cat([p.reshape(-1) for p in model.parameters()]), rtol=0, atol=0)
    back = unflatten_like(flat, named)
    assert list(back) == list(named)
    for name, p in named.items():
        assert torch.equal(back[name], p)
    rows = torch.stack([flat, 2 * flat])
    back_rows = unflatten_like(rows, named)
    assert torch.equal(back_rows["head.3.bias"][1], 2 * named["head.3.bias"])
    with pytest.raises(ValueError, match="entries per row"):
        unflatten_like(flat[:-1], named)


def test_clip_rows_bounds_norms_and_leaves_small_rows_untouched() -> None:
    g = torch.randn(200, 50, generator=torch.Generator().manual_seed(3))
    g[::2] *= 0.01  # half the rows well below the clip norm
    g[7] = 0.0
    clipped = clip_rows(g, clip=1.0)
    norms = row_norms(clipped)
    assert torch.all(norms <= 1.0 + 1e-6)
    small = row_norms(g) <= 1.0
    assert small.sum() >= 100
    assert torch.equal(clipped[small], g[small])
    big = ~small
    torch.testing.assert_close(norms[big], torch.ones_like(norms[big]))
    cos = nn.functional.cosine_similarity(clipped[big], g[big], dim=1)
    torch.testing.assert_close(cos, torch.ones_like(cos))


def test_clipped_mean_has_fixed_denominator_and_bounded_replace_one_change() -> None:
    gen = torch.Generator().manual_seed(4)
    g = 5 * torch.randn(10, 6, generator=gen, dtype=torch.float64)
    mean = clipped_mean(g, clip=2.0, denominator=333)
    torch.testing.assert_close(mean, clip_rows(g, clip=2.0).sum(0) / 333)
    # Replace one record by its worst-case opposite: the change is at most 2 C / denominator.
    g2 = g.clone()
    g2[3] = -g[3]
    change = torch.linalg.vector_norm(clipped_mean(g2, clip=2.0, denominator=333) - mean)
    assert change <= 2 * 2.0 / 333 + 1e-12
    assert change == pytest.approx(2 * 2.0 / 333, rel=1e-9)  # row 3 has norm > 2: the bound is attained
    with pytest.raises(ValueError, match="denominator"):
        clipped_mean(g, clip=1.0, denominator=0)


def test_gaussian_noise_has_std_sigma() -> None:
    """Variance test: (n-1) s^2 / sigma^2 ~ chi2(n-1), two-sided at level 1e-4 (n = 200,000).

    Power: noise with std 1% off shifts the statistic by 0.0201 sqrt(n/2) = 6.4 standard deviations,
    rejected with probability > 0.99. Also the mean (z-test) and the normal shape (KS) are checked.
    """
    sigma, n = 0.37, 200_000
    value = torch.full((n,), 3.0)
    out = gaussian_mechanism(value, sigma=sigma, generator=torch_generator(0, "noise-test"))
    noise = (out - value).double().numpy()
    stat = (n - 1) * noise.var(ddof=1) / sigma**2
    p_var = 2 * min(stats.chi2.cdf(stat, n - 1), stats.chi2.sf(stat, n - 1))
    assert p_var > 1e-4
    assert abs(noise.mean()) / (sigma / math.sqrt(n)) < 3.9
    assert stats.kstest(noise / sigma, "norm").pvalue > 1e-4
    # Negative control: the same test rejects noise scaled by 1.01.
    stat_bad = (n - 1) * (1.01 * noise).var(ddof=1) / sigma**2
    assert stats.chi2.sf(stat_bad, n - 1) < 1e-4


def test_gaussian_mechanism_is_reproducible_and_checked() -> None:
    v = torch.zeros(5, dtype=torch.float64)
    a = gaussian_mechanism(v, sigma=1.0, generator=torch_generator(1, "x"))
    b = gaussian_mechanism(v, sigma=1.0, generator=torch_generator(1, "x"))
    c = gaussian_mechanism(v, sigma=1.0, generator=torch_generator(2, "x"))
    assert a.dtype == torch.float64 and torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(gaussian_mechanism(v, sigma=0.0, generator=torch_generator(1, "x")), v)
    with pytest.raises(ValueError, match="sigma"):
        gaussian_mechanism(v, sigma=-1.0, generator=torch_generator(1, "x"))
    with pytest.raises(ValueError, match="floating"):
        gaussian_mechanism(torch.zeros(3, dtype=torch.int64), sigma=1.0, generator=torch_generator(1, "x"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_path() -> None:
    dev = torch.device("cuda")
    model = SmallLeNet().to(dev)
    x, y = torch.rand(6, 1, 16, 16, device=dev), torch.randint(0, 10, (6,), device=dev)
    g = per_example_gradients(model, nn.functional.cross_entropy, x, y)
    assert g.device.type == "cuda"
    torch.testing.assert_close(g.cpu(), _loop_gradients(model.cpu(), x.cpu(), y.cpu()), rtol=1e-4, atol=1e-5)
    noisy = gaussian_mechanism(
        clipped_mean(g, clip=1.0, denominator=6), sigma=0.1, generator=torch_generator(0, "n", device=dev)
    )
    assert noisy.device.type == "cuda"
    with pytest.raises(ValueError, match="generator is on"):
        gaussian_mechanism(noisy, sigma=0.1, generator=torch_generator(0, "n"))
