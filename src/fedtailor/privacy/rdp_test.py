"""Tests of the RDP conversions: closed form against brute-force minimisation, Balle bound properties."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedtailor.privacy.rdp import (
    balle_epsilon,
    balle_epsilon_gaussian,
    closed_form_epsilon,
    closed_form_rho,
    composed_rho,
    gaussian_rdp,
)

ALPHAS = 1.0 + np.geomspace(1e-4, 1e7, 200_001)  # brute-force order grid


def _draws(n: int, seed: int) -> list[tuple[float, float]]:
    rng = np.random.default_rng(seed)
    return [(10 ** rng.uniform(-6, 1.5), 10 ** rng.uniform(-12, -2)) for _ in range(n)]


@pytest.mark.parametrize(("rho", "delta"), _draws(20, 0))
def test_closed_form_is_the_continuous_minimum_of_the_basic_conversion(rho: float, delta: float) -> None:
    brute = np.min(ALPHAS * rho + math.log(1 / delta) / (ALPHAS - 1))
    eps = closed_form_epsilon(rho, delta=delta)
    assert eps <= brute * (1 + 1e-12)
    assert eps == pytest.approx(brute, rel=1e-6)


@pytest.mark.parametrize(("rho", "delta"), _draws(20, 1))
def test_balle_is_continuous_minimum_below_every_grid_order_and_below_closed_form(rho: float, delta: float) -> None:
    grid = ALPHAS * rho + np.log1p(-1 / ALPHAS) - (math.log(delta) + np.log(ALPHAS)) / (ALPHAS - 1)
    brute = max(0.0, float(np.min(grid)))
    eps = balle_epsilon_gaussian(rho, delta=delta)
    assert eps <= brute + 1e-12 * max(1.0, brute)
    assert eps == pytest.approx(brute, rel=1e-6, abs=1e-12)
    assert eps < closed_form_epsilon(rho, delta=delta)


def test_balle_returns_the_minimising_order_and_handles_a_generic_curve() -> None:
    # A non-Gaussian RDP curve (Laplace-like, bounded): the minimiser must still sit at a grid minimum.
    def curve(alpha: np.ndarray) -> np.ndarray:
        return np.minimum(0.5 * alpha * 0.01, 2.0)

    eps, alpha = balle_epsilon(curve, delta=1e-6)
    direct = (
        float(curve(np.array([alpha]))[0]) + math.log1p(-1 / alpha) - (math.log(1e-6) + math.log(alpha)) / (alpha - 1)
    )
    assert eps == pytest.approx(direct, rel=1e-12)
    grid = curve(ALPHAS) + np.log1p(-1 / ALPHAS) - (math.log(1e-6) + np.log(ALPHAS)) / (ALPHAS - 1)
    assert eps <= grid.min() + 1e-9


def test_closed_form_rho_inverts_closed_form_epsilon() -> None:
    for eps in (1e-6, 0.1, 1.0, 4.0, 16.0, 1e3):
        for delta in (1e-12, 1e-5, 0.1):
            rho = closed_form_rho(eps, delta=delta)
            assert closed_form_epsilon(rho, delta=delta) == pytest.approx(eps, rel=1e-12)
    log_inv = math.log(1e5)
    assert closed_form_rho(16.0, delta=1e-5) == pytest.approx(
        (math.sqrt(log_inv + 16) - math.sqrt(log_inv)) ** 2, rel=1e-14
    )


def test_gaussian_rdp_and_composition() -> None:
    assert gaussian_rdp(3.0, sensitivity=2.0, sigma=4.0) == pytest.approx(3.0 * 4.0 / 32.0)
    np.testing.assert_allclose(gaussian_rdp(np.array([2.0, 4.0]), sensitivity=1.0, sigma=1.0), [1.0, 2.0])
    releases = [(2 / 333, 0.0147)] + [(2 / 333, 0.0147)] * 40
    assert composed_rho(releases) == pytest.approx(41 * (2 / 333) ** 2 / (2 * 0.0147**2), rel=1e-14)
    assert composed_rho([]) == 0.0
    assert balle_epsilon_gaussian(0.0, delta=1e-5) == 0.0
    assert closed_form_epsilon(0.0, delta=1e-5) == 0.0


def test_tiny_rho_uses_the_kl_bound() -> None:
    # delta >= sqrt(1 - exp(-rho)) gives eps = 0, as in dp-accounting.
    assert balle_epsilon_gaussian(1e-12, delta=1e-5) == 0.0
    assert balle_epsilon_gaussian(1e-8, delta=1e-5) > 0.0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: closed_form_epsilon(1.0, delta=0.0), "delta"),
        (lambda: closed_form_epsilon(1.0, delta=1.0), "delta"),
        (lambda: closed_form_epsilon(-1.0, delta=1e-5), "rho"),
        (lambda: closed_form_rho(0.0, delta=1e-5), "eps"),
        (lambda: composed_rho([(1.0, 0.0)]), "sigma"),
        (lambda: composed_rho([(-1.0, 1.0)]), "sensitivity"),
        (lambda: balle_epsilon(lambda a: a * np.nan, delta=1e-5), "NaN"),
    ],
)
def test_bad_input_is_refused(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
