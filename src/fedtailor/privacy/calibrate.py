"""Noise calibration and the fixed participation schedule (``docs/privacy.md``).

Both follow Eq. 7 and Sec. 4 of *Privacy-Aligned Personalized Federated Learning with Compact Adaptation and
Variable-Length Gaussian Communication*.

The schedule is sampled from public randomness before training, independently of the data; client ``i``
takes part in ``T_i`` rounds and ``T_max = max_i T_i``. With one context release (sensitivity
``Delta_c = 2/m_c``) and ``T_i`` coefficient releases (``Delta_g = 2 C_g / m_g``) at a common ``sigma``, the
worst client has ``rho = (Delta_c^2 + T_max Delta_g^2) / (2 sigma^2)``; ``sigma`` is chosen so that this
client reaches exactly the target eps under the chosen conversion.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import brentq

from fedtailor.privacy.accountant import DEFAULT_CONVERSION, check_conversion, epsilon_from_rho
from fedtailor.privacy.rdp import closed_form_rho

__all__ = [  # the schedule helpers live in fedtailor.fl.schedule and are re-exported here for the CLI
    "calibrate_sigma",
    "gradient_sensitivity",
    "participation_counts",
    "planned_releases",
    "t_max",
    "uniform_schedule",
    "worst_client_rho",
]
from fedtailor.fl.schedule import participation_counts, t_max, uniform_schedule


def gradient_sensitivity(*, batch_size: int, clip: float) -> float:
    """Replace-one L2 sensitivity of a clipped sum over a fixed denominator ``m_g``: ``2 C_g / m_g``."""
    if batch_size < 1:
        raise ValueError(f"batch_size (m_g) must be >= 1, got {batch_size}.")
    if not (clip > 0.0 and math.isfinite(clip)):
        raise ValueError(f"clip norm C_g must be finite and > 0, got {clip}.")
    return 2.0 * clip / batch_size


def worst_client_rho(*, sigma: float, t_max: int, context_sensitivity: float, gradient_sensitivity: float) -> float:
    """``rho = (Delta_c^2 + T_max Delta_g^2) / (2 sigma^2)`` of the client with the most releases."""
    return (context_sensitivity**2 + t_max * gradient_sensitivity**2) / (2.0 * sigma**2)


def calibrate_sigma(
    *,
    eps: float,
    delta: float,
    t_max: int,
    context_sensitivity: float,
    gradient_sensitivity: float,
    conversion: str = DEFAULT_CONVERSION,
) -> float:
    """Smallest common ``sigma`` such that the client with ``T_max`` releases reaches at most ``eps``.

    ``"closed-form"`` uses the compact-adaptation paper's closed form ``sigma = sqrt(S / (2 rho*))`` with
    ``S = Delta_c^2 + T_max Delta_g^2`` and ``rho* = (sqrt(log(1/delta) + eps) - sqrt(log(1/delta)))^2``.
    ``"balle"`` and ``"exact"`` solve ``eps(sigma) = eps`` by Brent's method on ``log sigma``, bracketed
    below the closed-form sigma (which is always private enough, since both are tighter). The result is
    nudged up by ulps if rounding left ``eps(sigma)`` above the target, so that the calibrated schedule
    always passes a budget check.
    """
    check_conversion(conversion)
    eps = float(eps)
    if not (eps > 0.0 and math.isfinite(eps)):
        raise ValueError(f"target eps must be finite and > 0, got {eps!r}.")
    if isinstance(t_max, bool) or int(t_max) != t_max or t_max < 0:
        raise ValueError(f"t_max must be an int >= 0, got {t_max!r}.")
    for name, value in (
        ("context_sensitivity", context_sensitivity),
        ("gradient_sensitivity", gradient_sensitivity),
    ):
        if not (value >= 0.0 and math.isfinite(value)):
            raise ValueError(f"{name} must be finite and >= 0, got {value!r}.")
    total = context_sensitivity**2 + int(t_max) * gradient_sensitivity**2
    if total == 0.0:
        raise ValueError("nothing to calibrate: every release has zero sensitivity (t_max=0 and no context).")

    def eps_at(sigma: float) -> float:
        return epsilon_from_rho(total / (2.0 * sigma * sigma), delta=delta, conversion=conversion)

    sigma_cf = math.sqrt(total / (2.0 * closed_form_rho(eps, delta=delta)))
    if conversion == "closed-form":
        sigma = sigma_cf
    else:
        hi = math.log(sigma_cf)
        lo = hi - 0.5
        while eps_at(math.exp(lo)) <= eps:
            lo -= 0.5
        sigma = math.exp(brentq(lambda s: eps_at(math.exp(s)) - eps, lo, hi, xtol=1e-15, rtol=8.9e-16))
    while eps_at(sigma) > eps:  # eps(sigma) decreases in sigma, so this ends within a few ulps
        sigma = math.nextafter(sigma, math.inf)
    return sigma


def planned_releases(
    schedule: np.ndarray,
    *,
    num_clients: int,
    sigma: float,
    context_sensitivity: float,
    gradient_sensitivity: float,
) -> dict[int, list[tuple[float, float]]]:
    """``{client: [(Delta_c, sigma), (Delta_g, sigma) x T_i]}`` for clients ``0..num_clients-1``.

    The plan a :class:`fedtailor.privacy.ledger.BudgetGuard` checks before training: one context release
    per client plus one coefficient-gradient release per scheduled participation.
    """
    counts = participation_counts(schedule, num_clients)
    return {
        client: [(context_sensitivity, sigma)] + [(gradient_sensitivity, sigma)] * int(t)
        for client, t in enumerate(counts)
    }
