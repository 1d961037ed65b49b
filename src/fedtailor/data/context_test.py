"""Tests for the context statistic phi and its one-shot release (``docs/subspace.md``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedtailor.data.context import context_features, context_mean, context_sensitivity, release_context
from fedtailor.rng import derive_key, fresh_key

M_C = 333


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_channels_are_grouped() -> None:
    """3 channels with distinct values: constant 0.2, half 0 / half 1, a ramp; against a numpy computation."""
    x = torch.zeros(2, 3, 4, 6)
    x[:, 0] = 0.2
    x[:, 1, :2] = 1.0
    x[:, 2] = torch.linspace(0, 1, 24).reshape(4, 6)
    x[1] = 1 - x[1]
    phi = context_features(x)
    assert phi.shape == (2, 6)
    ramp = np.linspace(0, 1, 24)
    mu0 = np.array([0.2, 0.5, ramp.mean()])
    nu0 = np.array([0.04, 0.5, (ramp**2).mean()])
    mu1 = np.array([0.8, 0.5, (1 - ramp).mean()])
    nu1 = np.array([0.64, 0.5, ((1 - ramp) ** 2).mean()])
    expected = np.stack([np.concatenate([mu0, nu0]), np.concatenate([mu1, nu1])]) / math.sqrt(6)
    np.testing.assert_allclose(phi.numpy(), expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(context_mean(x).numpy(), expected.mean(0), rtol=1e-6, atol=1e-7)


def test_single_channel_and_other_layouts() -> None:
    x = torch.rand(5, 1, 28, 28, generator=_gen(0))
    phi = context_features(x)
    assert phi.shape == (5, 2)
    torch.testing.assert_close(phi[:, 0], x.mean(dim=(1, 2, 3)) / math.sqrt(2))
    torch.testing.assert_close(phi[:, 1], (x**2).mean(dim=(1, 2, 3)) / math.sqrt(2))
    torch.testing.assert_close(context_features(x.reshape(5, 1, 784)), phi)  # (n, C, L) works the same
    torch.testing.assert_close(context_features(x.double()), phi.double(), rtol=1e-6, atol=1e-7)


def test_norm_bound_at_extremes() -> None:
    for channels in (1, 3):
        zeros = torch.zeros(1, channels, 8, 8)
        ones = torch.ones(1, channels, 8, 8)
        assert context_features(zeros).norm().item() == 0.0
        assert context_features(ones).norm().item() == pytest.approx(1.0, abs=1e-6)  # the bound is attained
        rand = torch.rand(1000, channels, 8, 8, generator=_gen(channels))
        assert context_features(rand).norm(dim=-1).max().item() < 1.0


@settings(max_examples=60, deadline=None)
@given(
    channels=st.integers(1, 4),
    side=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
    binary=st.booleans(),
)
def test_norm_bound_property(channels: int, side: int, seed: int, binary: bool) -> None:
    x = torch.rand(8, channels, side, side, generator=_gen(seed))
    if binary:
        x = x.round()
    assert context_features(x).norm(dim=-1).max().item() <= 1.0 + 1e-6


def test_replace_one_sensitivity() -> None:
    """Replacing one of m_c records moves the mean by at most 2/m_c (the bound of *Privacy-Aligned
    Personalized Federated Learning with Compact Adaptation and Variable-Length Gaussian Communication*, the
    default) and in fact by at most 1/m_c (the tight bound), which an all-zeros -> all-ones replacement
    attains."""
    assert context_sensitivity(M_C) == pytest.approx(2 / M_C)
    assert context_sensitivity(M_C, tight=True) == pytest.approx(1 / M_C)
    base = torch.rand(M_C, 3, 8, 8, generator=_gen(1))
    base[0] = 0.0
    ref = context_mean(base)
    worst = base.clone()
    worst[0] = 1.0
    shift = (context_mean(worst) - ref).norm().item()
    assert shift == pytest.approx(1 / M_C, rel=1e-4)
    assert shift <= context_sensitivity(M_C) and shift <= context_sensitivity(M_C, tight=True) * (1 + 1e-5)
    # Adversarial search: replace record 0 by random, binary and constant images; none moves it further.
    gen = _gen(2)
    candidates = torch.cat(
        [
            torch.rand(200, 3, 8, 8, generator=gen),
            torch.rand(200, 3, 8, 8, generator=gen).round(),
            torch.rand(200, 3, 1, 1, generator=gen).round().expand(200, 3, 8, 8),
        ]
    )
    phi_base = context_features(base)
    for src in (0, 1):  # replacing the all-zeros record, and a random one
        others = phi_base.sum(0) - phi_base[src]
        means = (others + context_features(candidates)) / M_C
        shifts = (means - phi_base.mean(0)).norm(dim=-1)
        assert shifts.max().item() <= context_sensitivity(M_C, tight=True) * (1 + 1e-5)
    with pytest.raises(ValueError, match="positive record count"):
        context_sensitivity(0)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (torch.full((2, 1, 4, 4), -0.1), r"\[0, 1\]"),
        (torch.full((2, 3, 4, 4), 1.5), r"\[0, 1\]"),
        (torch.full((2, 1, 4, 4), 255.0), "unnormalised"),
        (torch.full((2, 1, 4, 4), float("nan")), "non-finite"),
        (torch.full((2, 1, 4, 4), 3, dtype=torch.uint8), "x.float"),
        (torch.rand(2, 28), "unsqueeze"),
        (torch.zeros(0, 1, 4, 4), "empty"),
    ],
)
def test_rejects_bad_input(bad: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        context_features(bad)


def test_rounding_slack_is_accepted_and_clamped() -> None:
    x = torch.full((1, 1, 2, 2), 1.0 + 1e-7)
    assert context_features(x).norm().item() <= 1.0 + 1e-7
    assert context_features(torch.full((1, 1, 2, 2), -1e-7)).abs().max().item() == 0.0


def test_release_noise_statistics() -> None:
    """5000 releases x 6 coordinates = 30,000 draws: the sample std has relative standard error 1/sqrt(2N) = 0.4%,
    so the 2% tolerance is 5 standard errors, and sigma off by 10% (or a variance used as std) fails for sure."""
    x = torch.rand(M_C, 3, 4, 4, generator=_gen(3))
    mean = context_mean(x)
    sigma = 0.3
    noise = torch.stack([release_context(x, sigma=sigma, key=derive_key(4, i)) - mean for i in range(5000)])
    assert noise.shape == (5000, 6)
    assert noise.std().item() == pytest.approx(sigma, rel=0.02)
    assert abs(noise.mean().item()) < 5 * sigma / math.sqrt(noise.numel())
    per_coord = noise.std(dim=0) / sigma  # each coordinate has std sigma (independent, isotropic)
    assert (per_coord - 1).abs().max().item() < 0.06  # 5000 draws: SE 1%, 6 sigma
    assert noise.T.corrcoef().fill_diagonal_(0).abs().max().item() < 0.06


def test_release_is_keyed_and_exact_without_noise() -> None:
    x = torch.rand(M_C, 1, 28, 28, generator=_gen(5))
    a = release_context(x, sigma=0.05, key=derive_key(41, "context", 3))
    b = release_context(x, sigma=0.05, key=derive_key(41, "context", 3))
    c = release_context(x, sigma=0.05, key=derive_key(41, "context", 4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    # secure mode: fresh OS entropy, so two releases of the same data differ and no seed reproduces either
    assert not torch.equal(
        release_context(x, sigma=0.05, key=fresh_key()), release_context(x, sigma=0.05, key=fresh_key())
    )
    torch.testing.assert_close(release_context(x, sigma=0.0, key=fresh_key()), context_mean(x))
    with pytest.raises(ValueError, match="non-negative"):
        release_context(x, sigma=-1.0, key=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_release_on_cuda() -> None:
    x = torch.rand(M_C, 3, 32, 32, generator=_gen(6)).cuda()
    out = release_context(x, sigma=0.1, key=derive_key(1, "context"))
    assert out.device == x.device and out.shape == (6,)
