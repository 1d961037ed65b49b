"""Exact (eps, delta) accounting for composed Gaussian mechanisms (Balle & Wang 2018; Dong et al. 2019).

Composing Gaussian mechanisms ``(Delta_j, sigma_j)`` is exactly one Gaussian mechanism with
``mu = sqrt(sum_j (Delta_j / sigma_j)^2)`` (its privacy-loss distribution is N(mu^2/2, mu^2)), and its tight
privacy profile is

    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)                 (Balle & Wang 2018, Thm. 8)

``mu^2 = 2 rho`` with the RDP slope ``rho`` of :mod:`fedtailor.privacy.rdp`. This module evaluates
``log delta(eps)`` without cancellation and inverts it for ``eps`` (given delta) or ``mu`` (given eps).
"""

from __future__ import annotations

import math

from scipy.optimize import brentq
from scipy.special import erfcx, log_ndtr, ndtr

_SQRT2 = math.sqrt(2.0)


def _check_mu(mu: float) -> float:
    mu = float(mu)
    if not (mu >= 0.0 and math.isfinite(mu)):
        raise ValueError(f"mu (sqrt of sum (Delta_j/sigma_j)^2) must be finite and >= 0, got {mu!r}.")
    return mu


def log_delta_for_epsilon(eps: float, *, mu: float) -> float:
    """``log delta(eps)`` of a ``mu``-Gaussian mechanism, accurate far into the tail.

    With ``a = -eps/mu + mu/2`` and ``b = a - mu``: ``(a^2 - b^2)/2 = -eps``, so writing
    ``Phi(x) = erfcx(-x/sqrt2) exp(-x^2/2) / 2`` gives, exactly,
    ``delta = exp(-a^2/2) [erfcx(-a/sqrt2) - erfcx(-b/sqrt2)] / 2``: no ``e^eps`` factor and no difference of
    two tiny numbers. Used for ``a < 0`` (where erfcx of a positive argument cannot overflow); for ``a >= 0``
    delta is not small and the direct form is accurate.
    """
    eps, mu = float(eps), _check_mu(mu)
    if eps < 0.0 or math.isnan(eps):
        raise ValueError(f"eps must be >= 0, got {eps!r}.")
    if mu == 0.0:
        return -math.inf
    if math.isinf(eps):
        return -math.inf
    a = -eps / mu + mu / 2.0
    b = a - mu
    if a < 0.0:
        diff = erfcx(-a / _SQRT2) - erfcx(-b / _SQRT2)
        if diff <= 0.0:  # below double precision: delta underflows relative to exp(-a^2/2)
            return -math.inf
        return -0.5 * a * a + math.log(0.5) + math.log(diff)
    value = ndtr(a) - math.exp(eps) * ndtr(b) if eps < 700.0 else ndtr(a) - math.exp(eps + log_ndtr(b))
    return math.log(value) if value > 0.0 else -math.inf


def delta_for_epsilon(eps: float, *, mu: float) -> float:
    """``delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``."""
    return math.exp(log_delta_for_epsilon(eps, mu=mu))


def epsilon_for_delta(delta: float, *, mu: float) -> float:
    """Smallest ``eps >= 0`` with ``delta(eps) <= delta`` for a ``mu``-Gaussian mechanism.

    Solves ``log delta(eps) = log delta`` by Brent's method; ``delta(eps)`` is strictly decreasing. The
    bracket's upper end is the closed-form RDP bound ``mu^2/2 + mu sqrt(2 log(1/delta))``, which is always
    at least the exact eps.
    """
    delta = float(delta)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}.")
    mu = _check_mu(mu)
    if mu == 0.0:
        return 0.0
    log_target = math.log(delta)
    if log_delta_for_epsilon(0.0, mu=mu) <= log_target:
        return 0.0
    hi = mu * mu / 2.0 + mu * math.sqrt(-2.0 * log_target)
    while log_delta_for_epsilon(hi, mu=mu) > log_target:  # only guards against rounding at the bound
        hi = 2.0 * hi + 1e-300
    return float(brentq(lambda e: log_delta_for_epsilon(e, mu=mu) - log_target, 0.0, hi, xtol=1e-300, rtol=8.9e-16))


def mu_for_epsilon(eps: float, *, delta: float) -> float:
    """Largest ``mu`` whose Gaussian mechanism is ``(eps, delta)``-DP (``delta(eps; mu)`` increases in mu).

    Brent's method on ``log mu``; the lower bracket end is the closed-form RDP calibration
    ``mu = sqrt(2 rho*)``, which is always private enough.
    """
    eps, delta = float(eps), float(delta)
    if not (eps > 0.0 and math.isfinite(eps)):
        raise ValueError(f"target eps must be finite and > 0, got {eps!r}.")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}.")
    log_target = math.log(delta)
    log_inv = -log_target
    rho_cf = eps**2 / (math.sqrt(log_inv + eps) + math.sqrt(log_inv)) ** 2
    lo = math.log(math.sqrt(2.0 * rho_cf))

    def gap(log_mu: float) -> float:
        return log_delta_for_epsilon(eps, mu=math.exp(log_mu)) - log_target

    hi = lo + 1.0
    while gap(hi) < 0.0:
        hi += 1.0
    while gap(lo) > 0.0:  # only guards against rounding at the bound
        lo -= 1e-6
    return math.exp(brentq(gap, lo, hi, xtol=1e-15, rtol=8.9e-16))
