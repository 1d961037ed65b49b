"""The battery's own machinery: the Anderson-Darling p-value, Holm's correction, the input classes."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from fedtailor.codecs.battery import BatteryResult, _adinf, anderson_darling, input_classes


@pytest.mark.parametrize("z, upper", [(1.933, 0.10), (2.492, 0.05), (3.070, 0.025), (3.857, 0.01)])
def test_ad_asymptotic_law_matches_stephens_critical_values(z: float, upper: float) -> None:
    assert 1 - _adinf(z) == pytest.approx(upper, abs=4e-4)


@pytest.mark.parametrize("shift", [0.0, 0.25, 0.5])
def test_ad_pvalue_agrees_with_scipy_monte_carlo(shift: float) -> None:
    """Independent check: scipy's goodness_of_fit simulates the null law of A^2 (all parameters known)."""
    x = np.random.default_rng(3).normal(shift, 1.0, 60)
    ours = anderson_darling(x, stats.norm(0, 1))
    ref = stats.goodness_of_fit(
        stats.norm,
        x,
        known_params={"loc": 0.0, "scale": 1.0},
        statistic="ad",
        n_mc_samples=4000,
        rng=np.random.default_rng(4),
    )
    assert ours[0] == pytest.approx(ref.statistic, rel=1e-10)
    assert ours[1] == pytest.approx(ref.pvalue, abs=0.03)  # MC standard error <= 0.008


def test_ad_detects_a_scale_error_that_means_would_miss() -> None:
    x = np.random.default_rng(5).normal(0, 1.05, 20_000)
    assert anderson_darling(x, stats.norm(0, 1))[1] < 1e-6
    assert anderson_darling(x / 1.05, stats.norm(0, 1))[1] > 1e-3


def test_holm_correction() -> None:
    r = BatteryResult({"a": 0.001, "b": 0.02, "c": 0.5}, alpha=0.01)
    assert r.holm_p == pytest.approx(0.003)
    assert r.adjusted() == pytest.approx({"a": 0.003, "b": 0.04, "c": 0.5})
    assert r.rejected() == ["a"] and not r.passed
    assert not BatteryResult({"a": 0.004, "b": 0.9}, alpha=0.01).passed
    assert BatteryResult({"a": 0.006, "b": 0.9}, alpha=0.01).passed


def test_input_classes_cover_the_extremes() -> None:
    c = input_classes(100, 4, 0.01, seed=0)
    assert set(c) == {"zero", "tiny", "huge", "boundary", "gaussian"}
    assert all(v.shape == (400,) for v in c.values())
    assert np.all(c["zero"] == 0) and np.abs(c["huge"]).min() == pytest.approx(10.0)
    assert np.abs(c["tiny"]).max() <= 1e-14
    assert np.any(np.abs(c["tiny"]) == 5e-324)
