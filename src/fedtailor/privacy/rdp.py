"""Rényi-DP of composed Gaussian mechanisms and two RDP -> (eps, delta) conversions (``docs/privacy.md``).

A Gaussian mechanism with L2 sensitivity ``Delta`` and noise ``N(0, sigma^2 I)`` has RDP
``alpha * Delta^2 / (2 sigma^2)`` at every order ``alpha > 1`` (Mironov 2017, Prop. 7). RDP adds up under
composition, so a client's releases ``(Delta_j, sigma_j)`` together have RDP ``alpha * rho`` with (Eq. 7 of
*Privacy-Aligned Personalized Federated Learning with Compact Adaptation and Variable-Length Gaussian
Communication*)

    rho = sum_j Delta_j^2 / (2 sigma_j^2)

Conversions to ``(eps, delta)``:

* closed form (the compact-adaptation paper's): ``eps = min_alpha [alpha rho + log(1/delta)/(alpha - 1)]``
  over continuous ``alpha``, which is ``rho + 2 sqrt(rho log(1/delta))``; its inverse gives the calibration
  target ``rho* = (sqrt(log(1/delta) + eps) - sqrt(log(1/delta)))^2``.
* Balle et al. 2020 (Prop. 12 of arXiv:2004.00010; the conversion Opacus and dp-accounting use):
  ``eps = rdp(alpha) + log((alpha - 1)/alpha) - (log delta + log alpha)/(alpha - 1)``, minimised here over
  continuous ``alpha > 1`` (dense log grid, then bounded Brent between the grid neighbours of the best
  point), not only over a fixed grid of orders.

Everything here is plain float math (NumPy/SciPy), no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np
from scipy.optimize import minimize_scalar

RdpCurve = Callable[[np.ndarray], np.ndarray]

# Search range for log(alpha - 1): alpha - 1 from e^-14 (~8e-7) to e^40 (~2e17). The optimum of the
# Balle conversion for a Gaussian sits near sqrt(log(1/delta)/rho) + 1, inside this range for every
# rho in [1e-30, 1e10] and delta in [1e-300, 1).
_LOG_ALPHA_M1_RANGE = (-14.0, 40.0)
_GRID_POINTS = 2049


def _check_delta(delta: float) -> float:
    delta = float(delta)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}; typical values are 1e-5 or 1/n.")
    return delta


def _check_rho(rho: float) -> float:
    rho = float(rho)
    if not (rho >= 0.0 and math.isfinite(rho)):
        raise ValueError(f"rho (the RDP slope sum Delta^2/(2 sigma^2)) must be finite and >= 0, got {rho!r}.")
    return rho


def check_release(sensitivity: float, sigma: float) -> tuple[float, float]:
    """Validate one Gaussian release: finite ``sensitivity >= 0`` and finite ``sigma > 0``."""
    sensitivity, sigma = float(sensitivity), float(sigma)
    if not (sensitivity >= 0.0 and math.isfinite(sensitivity)):
        raise ValueError(f"sensitivity must be finite and >= 0, got {sensitivity!r}.")
    if not (sigma > 0.0 and math.isfinite(sigma)):
        raise ValueError(f"sigma must be finite and > 0, got {sigma!r}; a release without noise has no finite epsilon.")
    return sensitivity, sigma


def gaussian_rdp(alpha: float | np.ndarray, *, sensitivity: float, sigma: float) -> float | np.ndarray:
    """RDP of one Gaussian mechanism at order ``alpha``: ``alpha Delta^2 / (2 sigma^2)`` (Mironov 2017)."""
    sensitivity, sigma = check_release(sensitivity, sigma)
    slope = sensitivity**2 / (2.0 * sigma**2)
    return alpha * slope if isinstance(alpha, np.ndarray) else float(alpha) * slope


def composed_rho(releases: Iterable[tuple[float, float]]) -> float:
    """``rho = sum_j Delta_j^2 / (2 sigma_j^2)`` over ``(sensitivity, sigma)`` pairs (exactly rounded sum)."""
    terms = []
    for sensitivity, sigma in releases:
        sensitivity, sigma = check_release(sensitivity, sigma)
        terms.append(sensitivity**2 / (2.0 * sigma**2))
    return math.fsum(terms)


def closed_form_epsilon(rho: float, *, delta: float) -> float:
    """The compact-adaptation paper's conversion: ``eps = rho + 2 sqrt(rho log(1/delta))``
    (continuous-order optimum)."""
    rho, delta = _check_rho(rho), _check_delta(delta)
    return rho + 2.0 * math.sqrt(rho * -math.log(delta))


def closed_form_rho(eps: float, *, delta: float) -> float:
    """Inverse of :func:`closed_form_epsilon`: ``rho* = (sqrt(L + eps) - sqrt(L))^2``, ``L = log(1/delta)``.

    Written as ``eps^2 / (sqrt(L + eps) + sqrt(L))^2`` to avoid cancellation for small ``eps``.
    """
    eps, delta = float(eps), _check_delta(delta)
    if not (eps > 0.0 and math.isfinite(eps)):
        raise ValueError(f"target eps must be finite and > 0, got {eps!r}.")
    log_inv_delta = -math.log(delta)
    return eps**2 / (math.sqrt(log_inv_delta + eps) + math.sqrt(log_inv_delta)) ** 2


def _balle_terms(log_am1: np.ndarray, rdp: RdpCurve, log_delta: float) -> np.ndarray:
    """Balle et al. bound as a function of ``x = log(alpha - 1)``, evaluated stably for alpha near 1."""
    am1 = np.exp(log_am1)
    alpha = 1.0 + am1
    log_alpha = np.log1p(am1)
    # log((alpha-1)/alpha) = x - log(alpha)
    return rdp(alpha) + (log_am1 - log_alpha) - (log_delta + log_alpha) / am1


def balle_epsilon(rdp: RdpCurve, *, delta: float, kl: float | None = None) -> tuple[float, float]:
    """``min_{alpha > 1} rdp(alpha) + log((alpha-1)/alpha) - (log delta + log alpha)/(alpha - 1)``.

    ``rdp`` maps an array of orders to RDP values (vectorised). Minimised over continuous ``alpha``: the
    bound is evaluated on a dense grid of ``log(alpha - 1)`` and refined by bounded Brent between the two
    grid neighbours of the best grid point. ``kl`` (the RDP at order 1, i.e. the KL divergence), when
    given, adds the bound ``eps = 0`` whenever ``delta >= sqrt(1 - exp(-kl))`` (total variation via
    Bretagnolle-Huber), as dp-accounting does. Returns ``(eps, alpha)``; eps is clipped at 0.
    """
    delta = _check_delta(delta)
    log_delta = math.log(delta)
    if kl is not None and delta**2 + math.expm1(-float(kl)) > 0.0:
        return 0.0, 1.0
    grid = np.linspace(*_LOG_ALPHA_M1_RANGE, _GRID_POINTS)
    values = _balle_terms(grid, rdp, log_delta)
    if np.isnan(values).any() or (values == -np.inf).any():
        raise ValueError("the RDP curve returned NaN or -inf; it must be finite and >= 0 for alpha > 1.")
    best = int(np.argmin(values))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, _GRID_POINTS - 1)]
    res = minimize_scalar(
        lambda x: float(_balle_terms(np.array([x]), rdp, log_delta)[0]),
        bounds=(lo, hi),
        method="bounded",
        options={"xatol": 1e-12},
    )
    x_best, eps = grid[best], float(values[best])
    if res.fun < eps:
        x_best, eps = float(res.x), float(res.fun)
    return max(0.0, eps), 1.0 + math.exp(x_best)


def balle_epsilon_gaussian(rho: float, *, delta: float) -> float:
    """Balle et al. conversion for composed Gaussians (``rdp(alpha) = alpha rho``), minimised continuously."""
    rho = _check_rho(rho)
    if rho == 0.0:
        return 0.0
    eps, _ = balle_epsilon(lambda alpha: alpha * rho, delta=delta, kl=rho)
    return eps
