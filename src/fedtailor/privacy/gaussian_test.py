"""Tests of exact Gaussian accounting against 60-digit arithmetic and its own inverse relations."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest

from fedtailor.privacy.gaussian import (
    delta_for_epsilon,
    epsilon_for_delta,
    log_delta_for_epsilon,
    mu_for_epsilon,
)


def _log_delta_mp(eps: float, mu: float) -> float:
    with mpmath.workdps(60):
        e, m = mpmath.mpf(eps), mpmath.mpf(mu)
        d = mpmath.ncdf(-e / m + m / 2) - mpmath.exp(e) * mpmath.ncdf(-e / m - m / 2)
        return float(mpmath.log(d))


@pytest.mark.parametrize(
    ("eps", "mu"),
    [
        (0.0, 0.5),
        (0.3, 2.0),  # a >= 0 branch
        (1.0, 0.5),
        (16.0, 1.2),
        (16.0, 0.05),
        (200.0, 3.0),  # delta ~ 1e-2000: far beyond float, only the log is representable
        (1e-3, 1e-4),
        (50.0, 12.0),  # a >= 0 with large mu
    ],
)
def test_log_delta_matches_high_precision_reference(eps: float, mu: float) -> None:
    assert log_delta_for_epsilon(eps, mu=mu) == pytest.approx(_log_delta_mp(eps, mu), rel=1e-10)


def test_delta_is_the_plain_formula_where_it_is_well_conditioned() -> None:
    from scipy.stats import norm

    for eps, mu in [(0.5, 1.0), (2.0, 1.5), (4.0, 3.0)]:
        plain = norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)
        assert delta_for_epsilon(eps, mu=mu) == pytest.approx(plain, rel=1e-12)


def test_epsilon_and_mu_invert_delta() -> None:
    rng = np.random.default_rng(3)
    for _ in range(30):
        mu = 10 ** rng.uniform(-3, 1)
        delta = 10 ** rng.uniform(-12, -2)
        eps = epsilon_for_delta(delta, mu=mu)
        if eps > 0:
            assert log_delta_for_epsilon(eps, mu=mu) == pytest.approx(math.log(delta), rel=1e-9)
            assert mu_for_epsilon(eps, delta=delta) == pytest.approx(mu, rel=1e-9)
        else:
            assert delta_for_epsilon(0.0, mu=mu) <= delta


def test_exact_epsilon_is_below_the_rdp_closed_form() -> None:
    for mu in (0.01, 0.3, 1.0, 5.0):
        for delta in (1e-10, 1e-5):
            closed = mu * mu / 2 + mu * math.sqrt(2 * math.log(1 / delta))
            assert epsilon_for_delta(delta, mu=mu) < closed


def test_degenerate_and_bad_inputs() -> None:
    assert epsilon_for_delta(1e-5, mu=0.0) == 0.0
    assert log_delta_for_epsilon(1.0, mu=0.0) == -math.inf
    assert epsilon_for_delta(0.9, mu=0.1) == 0.0  # delta(0) = 2 Phi(0.05) - 1 ~ 0.04 < 0.9
    with pytest.raises(ValueError, match="delta"):
        epsilon_for_delta(0.0, mu=1.0)
    with pytest.raises(ValueError, match="mu"):
        epsilon_for_delta(1e-5, mu=-1.0)
    with pytest.raises(ValueError, match="eps"):
        log_delta_for_epsilon(-1.0, mu=1.0)
    with pytest.raises(ValueError, match="eps"):
        mu_for_epsilon(0.0, delta=1e-5)
