"""The bounded context statistic phi and its one-shot private release (``docs/subspace.md``).

Feature groups are the input channels (s = 1 for MNIST-like inputs, 3 for CIFAR). For an input x with pixel
values in [0, 1] (before any normalisation), ``mu_j(x)`` and ``nu_j(x)`` are the means of x and of x^2 over
channel j, and ``phi(x) = [mu(x); nu(x)] / sqrt(2s)``. Every entry of ``[mu; nu]`` lies in [0, 1], so
``||phi(x)||_2 <= 1``. The client releases once ``c~_i = (1/m_c) sum_{x in C_i} phi(x) + N(0, sigma^2 I_{2s})``.

Sensitivity: *Privacy-Aligned Personalized Federated Learning with Compact Adaptation and Variable-Length
Gaussian Communication* bounds the replace-one sensitivity of the mean by ``2/m_c`` (triangle inequality
with ``||phi|| <= 1``); that is the default here, so its accounting is reproduced. Because every entry of
phi lies in ``[0, 1/sqrt(2s)]``, the difference of two phi vectors has entries in ``[-1/sqrt(2s), 1/sqrt(2s)]``
and norm at most 1, so the tight sensitivity is ``1/m_c`` (attained by an all-zeros versus an all-ones input);
``context_sensitivity(m_c, tight=True)`` returns it.
"""

from __future__ import annotations

import math

import torch

#: Slack allowed on the [0, 1] input range for float rounding (e.g. after resizing); values are clamped into range.
RANGE_TOLERANCE = 1e-6


def context_features(x: torch.Tensor) -> torch.Tensor:
    """phi(x) for each record: ``(n, C, ...)`` pixels in [0, 1] -> ``(n, 2C)`` = ``[mu; nu] / sqrt(2C)``."""
    if not torch.is_floating_point(x):
        raise ValueError(
            f"context_features needs floating-point pixels in [0, 1], got dtype {x.dtype}; for uint8 images use "
            "x.float() / 255."
        )
    if x.ndim < 3:
        raise ValueError(
            f"context_features needs shape (n, channels, ...), got {tuple(x.shape)}; add a channel dimension "
            "with x.unsqueeze(1) for single-channel images."
        )
    if x.numel() == 0:
        raise ValueError(f"context_features got an empty input of shape {tuple(x.shape)}.")
    lo, hi = torch.aminmax(x)
    if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
        raise ValueError("context_features got non-finite pixel values; inputs must be finite and in [0, 1].")
    if lo.item() < -RANGE_TOLERANCE or hi.item() > 1 + RANGE_TOLERANCE:
        raise ValueError(
            f"context_features needs raw pixels in [0, 1] (before any normalisation), got range "
            f"[{lo.item():.4g}, {hi.item():.4g}]; outside it ||phi|| <= 1 and the context release's DP sensitivity "
            "do not hold. Pass the unnormalised images (e.g. x.float() / 255)."
        )
    x = x.clamp(0.0, 1.0)
    channels = x.shape[1]
    flat = x.reshape(x.shape[0], channels, -1)
    mu = flat.mean(dim=-1)
    nu = flat.square().mean(dim=-1)
    phi = torch.cat([mu, nu], dim=-1) / math.sqrt(2 * channels)
    max_norm = phi.norm(dim=-1).max().item()
    if max_norm > 1 + 1e-5:
        raise RuntimeError(f"context_features: ||phi(x)|| = {max_norm} > 1, which the construction rules out.")
    return phi


def context_mean(x: torch.Tensor) -> torch.Tensor:
    """``(1/m_c) sum_{x in C_i} phi(x)``, shape ``(2C,)``, for the records ``x`` of one conditioning set."""
    return context_features(x).mean(dim=0)


def context_sensitivity(m_c: int, *, tight: bool = False) -> float:
    """Replace-one L2 sensitivity of :func:`context_mean` over ``m_c`` records: ``2/m_c`` as in the
    compact-adaptation paper, or the tight ``1/m_c`` (every entry of phi is in [0, 1/sqrt(2s)], so two phi
    vectors are at most 1 apart)."""
    if m_c < 1:
        raise ValueError(f"m_c must be a positive record count, got {m_c}.")
    return (1.0 if tight else 2.0) / m_c


def release_context(x: torch.Tensor, *, sigma: float, key: int, secure: bool = False) -> torch.Tensor:
    """One-shot release ``c~_i = context_mean(x) + N(0, sigma^2 I_{2C})`` (docs/subspace.md), noise from ``key``.

    ``x`` is the client's whole conditioning set (``m_c`` records). Outside simulation pass
    ``key=fedtailor.rng.fresh_key(), secure=True``: the noise comes from
    :func:`fedtailor.privacy.noise.secure_gaussian_noise` (ChaCha20, Opacus's four-draw floating-point defence).
    For a reproducible run pass ``derive_key(seed, ...)`` (``secure=False``: the SHAKE-256 sampler
    :func:`fedtailor.privacy.noise.gaussian_noise`, label "context").
    """
    from fedtailor.privacy.noise import gaussian_noise, secure_gaussian_noise

    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"sigma must be a finite non-negative noise scale, got {sigma}.")
    mean = context_mean(x)
    sampler = secure_gaussian_noise if secure else gaussian_noise
    noise = torch.from_numpy(sampler(key, "context", sigma=sigma, size=mean.numel()))
    return mean + noise.to(device=mean.device, dtype=mean.dtype).reshape(mean.shape)
