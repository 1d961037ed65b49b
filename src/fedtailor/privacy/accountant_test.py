"""Accountants cross-checked against Google's dp-accounting (RDP with dense orders, PLD, analytic Gaussian).

Our releases are replace-one Gaussian mechanisms with L2 sensitivity Delta; dp-accounting's
``GaussianDpEvent(noise_multiplier)`` is the same mechanism with sensitivity 1, so ``z = sigma / Delta``.
"""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting import pld, rdp

from fedtailor.privacy.accountant import (
    CONVERSIONS,
    BalleAccountant,
    ClosedFormAccountant,
    ExactGaussianAccountant,
    epsilon_from_rho,
    make_accountant,
)

DENSE_ORDERS = 1.0 + np.geomspace(0.0101, 1e5, 4000)


def _draw(rng: np.random.Generator) -> dict[str, float]:
    """One random client: context + T coefficient releases at a common sigma, and a delta."""
    d_c, d_g = rng.uniform(1e-3, 1e-1), rng.uniform(1e-3, 1e-1)
    return {
        "d_c": d_c,
        "d_g": d_g,
        "sigma": d_g * rng.uniform(0.5, 30.0),
        "T": int(rng.integers(0, 300)),
        "delta": 10 ** rng.uniform(-9, -3),
    }


def _event(p: dict[str, float]) -> dpa.DpEvent:
    return dpa.ComposedDpEvent(
        [
            dpa.GaussianDpEvent(p["sigma"] / p["d_c"]),
            dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(p["sigma"] / p["d_g"]), p["T"]),
        ]
    )


def _ours(p: dict[str, float], conversion: str) -> float:
    acc = make_accountant(conversion)
    acc.step(sensitivity=p["d_c"], sigma=p["sigma"])
    acc.step(sensitivity=p["d_g"], sigma=p["sigma"], count=p["T"])
    return acc.get_epsilon(delta=p["delta"])


def test_balle_matches_dp_accounting_rdp_over_50_draws() -> None:
    """Continuous orders: never above dp-accounting's dense-grid value, and within 1e-4 of it.

    Against its default (sparse) order grid ours must also never be above, and within 1%.
    """
    rng = np.random.default_rng(20240501)
    for _ in range(50):
        p = _draw(rng)
        ours = _ours(p, "balle")
        dense = rdp.RdpAccountant(orders=DENSE_ORDERS)
        dense.compose(_event(p))
        theirs = dense.get_epsilon(p["delta"])
        assert ours <= theirs + 1e-12, p
        assert ours == pytest.approx(theirs, rel=1e-4), p
        default = rdp.RdpAccountant()
        default.compose(_event(p))
        theirs_default = default.get_epsilon(p["delta"])
        assert ours <= theirs_default + 1e-12, p
        assert ours >= 0.99 * theirs_default - 1e-12, p


def test_exact_matches_dp_accounting_pld_and_analytic_gaussian() -> None:
    """PLD (pessimistic, value discretisation 1e-3) is an upper bound within 2e-4 of ours; the analytic
    Gaussian calibration of dp-accounting (Balle & Wang 2018, tol 1e-12) agrees to 1e-9."""
    rng = np.random.default_rng(7)
    for _ in range(10):
        p = _draw(rng)
        ours = _ours(p, "exact")
        acc = pld.PLDAccountant(value_discretization_interval=1e-3)
        acc.compose(_event(p))
        theirs = acc.get_epsilon(p["delta"])
        assert ours <= theirs + 1e-9, p
        assert theirs - ours < 2e-4, p
        mu = math.sqrt(2 * ((p["d_c"] ** 2 + p["T"] * p["d_g"] ** 2) / (2 * p["sigma"] ** 2)))
        assert ours == pytest.approx(dpa.get_epsilon_gaussian(1 / mu, p["delta"]), rel=1e-9, abs=1e-9), p


def test_conversions_are_ordered_over_random_draws() -> None:
    rng = np.random.default_rng(11)
    for _ in range(50):
        p = _draw(rng)
        closed, balle, exact = (_ours(p, c) for c in CONVERSIONS)
        assert closed >= balle >= exact >= 0.0, p
        if p["T"] > 0:
            assert closed > balle > exact, p


def test_closed_form_accountant_is_the_papers_formula() -> None:
    acc = ClosedFormAccountant()
    acc.step(sensitivity=2 / 333, sigma=0.01468)
    acc.step(sensitivity=2 / 333, sigma=0.01468, count=40)
    rho = 41 * (2 / 333) ** 2 / (2 * 0.01468**2)
    assert acc.rho == pytest.approx(rho, rel=1e-14)
    assert acc.mu == pytest.approx(math.sqrt(2 * rho), rel=1e-14)
    assert acc.get_epsilon(delta=1e-5) == pytest.approx(rho + 2 * math.sqrt(rho * math.log(1e5)), rel=1e-14)
    assert acc.get_epsilon(delta=1e-5) == pytest.approx(16.0, abs=5e-3)  # the worked value sigma=0.01468 (rounded)


def test_compose_equals_repeated_step_and_mixed_sigmas() -> None:
    a, b = BalleAccountant(), BalleAccountant()
    sens, sigmas = [0.1, 0.2, 0.05], [1.0, 0.7, 0.3]
    a.compose(sensitivities=sens, sigmas=sigmas)
    for s, z in zip(sens, sigmas, strict=True):
        b.step(sensitivity=s, sigma=z)
    assert a.rho == b.rho
    assert a.get_epsilon(delta=1e-6) == b.get_epsilon(delta=1e-6)
    # Mixed sigmas against dp-accounting's exact Gaussian composition (PLD).
    exact = ExactGaussianAccountant()
    exact.compose(sensitivities=sens, sigmas=sigmas)
    acc = pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dpa.ComposedDpEvent([dpa.GaussianDpEvent(z / s) for s, z in zip(sens, sigmas, strict=True)]))
    assert exact.get_epsilon(delta=1e-6) == pytest.approx(acc.get_epsilon(1e-6), abs=1e-3)


def test_epsilon_from_rho_and_bad_input() -> None:
    assert epsilon_from_rho(0.0, delta=1e-5, conversion="exact") == 0.0
    with pytest.raises(ValueError, match="closed-form, balle, exact"):
        make_accountant("rdp")
    acc = make_accountant()
    assert isinstance(acc, ClosedFormAccountant)
    with pytest.raises(ValueError, match="sigma"):
        acc.step(sensitivity=1.0, sigma=0.0)
    with pytest.raises(ValueError, match="count"):
        acc.step(sensitivity=1.0, sigma=1.0, count=-1)
    with pytest.raises(ValueError, match="one sigma per release"):
        acc.compose(sensitivities=[1.0, 1.0], sigmas=[1.0])
