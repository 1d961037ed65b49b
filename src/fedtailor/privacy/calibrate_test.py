"""Calibration reproduces the worked values of docs/privacy.md.

The uniform schedule is the one the federated loop uses.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from fedtailor.privacy.accountant import CONVERSIONS, epsilon_from_rho
from fedtailor.privacy.calibrate import (
    calibrate_sigma,
    gradient_sensitivity,
    participation_counts,
    planned_releases,
    t_max,
    uniform_schedule,
    worst_client_rho,
)
from fedtailor.rng import numpy_rng

D = 2 / 333
WORKED = {  # docs/privacy.md, T_max = 40, m_c = m_g = 333, C_g = 1, delta = 1e-5, eps = 4, 8, 16, 32
    "closed-form": ("0.04984", "0.02655", "0.01468", "0.00849"),
    "balle": ("0.04452", "0.02452", "0.01394", "0.00822"),
    "exact": ("0.04158", "0.02308", "0.01324", "0.00788"),
}


@pytest.mark.parametrize("conversion", CONVERSIONS)
def test_worked_values_to_the_printed_digits(conversion: str) -> None:
    for eps, printed in zip((4, 8, 16, 32), WORKED[conversion], strict=True):
        sigma = calibrate_sigma(
            eps=eps,
            delta=1e-5,
            t_max=40,
            context_sensitivity=D,
            gradient_sensitivity=D,
            conversion=conversion,
        )
        assert f"{sigma:.5f}" == printed


@pytest.mark.parametrize("conversion", CONVERSIONS)
def test_calibrated_sigma_reaches_the_target_from_below(conversion: str) -> None:
    rng = np.random.default_rng(5)
    for _ in range(6):
        eps, delta, tm = rng.uniform(0.2, 40), 10 ** rng.uniform(-9, -3), int(rng.integers(1, 200))
        d_c, d_g = rng.uniform(1e-3, 0.1), rng.uniform(1e-3, 0.1)
        sigma = calibrate_sigma(
            eps=eps,
            delta=delta,
            t_max=tm,
            context_sensitivity=d_c,
            gradient_sensitivity=d_g,
            conversion=conversion,
        )
        rho = worst_client_rho(sigma=sigma, t_max=tm, context_sensitivity=d_c, gradient_sensitivity=d_g)
        reached = epsilon_from_rho(rho, delta=delta, conversion=conversion)
        assert reached <= eps
        assert reached == pytest.approx(eps, rel=1e-10)


def test_tighter_conversions_need_less_noise() -> None:
    kw = {"eps": 8.0, "delta": 1e-5, "t_max": 37, "context_sensitivity": D, "gradient_sensitivity": D}
    s_cf, s_b, s_ex = (calibrate_sigma(**kw, conversion=c) for c in CONVERSIONS)
    assert s_cf > s_b > s_ex


def test_uniform_schedule_matches_the_documented_draw() -> None:
    sched = uniform_schedule(num_clients=40, rounds=500, per_round=2, seed=41)
    assert sched.shape == (500, 2) and sched.dtype == np.int64
    rng = numpy_rng(41, "schedule")
    expected = np.stack([rng.choice(40, size=2, replace=False) for _ in range(500)])
    np.testing.assert_array_equal(sched, expected)
    assert np.all(sched[:, 0] != sched[:, 1])
    np.testing.assert_array_equal(sched, uniform_schedule(num_clients=40, rounds=500, per_round=2, seed=41))
    assert not np.array_equal(sched, uniform_schedule(num_clients=40, rounds=500, per_round=2, seed=42))


def test_realised_t_max_for_seeds_41_to_45() -> None:
    got = [t_max(uniform_schedule(num_clients=40, rounds=500, per_round=2, seed=s)) for s in range(41, 46)]
    assert got == [36, 37, 34, 37, 33]


def test_schedule_is_uniform_over_clients() -> None:
    """Chi-square goodness of fit of the counts of 4000 rounds x 2 against uniform (alpha = 1e-3).

    Counts are not independent multinomial cells (two distinct per round), which makes them slightly
    less dispersed than multinomial; the test is conservative for uniformity. Power: a sampler whose client
    weights rise linearly from 0.75 to 1.25 gives noncentrality 175 against the critical value 72 (df 39),
    rejected with probability > 0.999; one that never picks a client (off-by-one range) adds 200 alone.
    """
    schedule = uniform_schedule(num_clients=40, rounds=4000, per_round=2, seed=9)
    counts = participation_counts(schedule, 40)
    assert all(counts[i] == (schedule == i).any(axis=1).sum() for i in range(40))
    assert stats.chisquare(counts).pvalue > 1e-3


def test_participation_counts_and_plan() -> None:
    sched = np.array([[0, 2], [2, 1], [2, 0]])
    np.testing.assert_array_equal(participation_counts(sched, 4), [2, 1, 3, 0])
    assert t_max(sched) == 3
    assert t_max(np.zeros((0, 2), dtype=np.int64)) == 0
    plan = planned_releases(sched, num_clients=4, sigma=0.5, context_sensitivity=0.1, gradient_sensitivity=0.2)
    assert plan[2] == [(0.1, 0.5), (0.2, 0.5), (0.2, 0.5), (0.2, 0.5)]
    assert plan[3] == [(0.1, 0.5)]
    assert gradient_sensitivity(batch_size=333, clip=1.0) == pytest.approx(D)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: participation_counts(np.array([[0, 0]]), 3), "twice"),
        (lambda: participation_counts(np.array([[0, 5]]), 3), "num_clients=3"),
        (lambda: participation_counts(np.array([0, 1]), 3), "2-D"),
        (lambda: participation_counts(np.array([[-1, 1]]), 3), "negative"),
        (lambda: uniform_schedule(num_clients=2, rounds=3, per_round=3, seed=0), "per_round"),
        (
            lambda: calibrate_sigma(eps=0, delta=1e-5, t_max=1, context_sensitivity=D, gradient_sensitivity=D),
            "eps",
        ),
        (
            lambda: calibrate_sigma(
                eps=1, delta=1e-5, t_max=1, context_sensitivity=D, gradient_sensitivity=D, conversion="x"
            ),
            "choose one of",
        ),
        (
            lambda: calibrate_sigma(eps=1, delta=1e-5, t_max=0, context_sensitivity=0, gradient_sensitivity=D),
            "nothing",
        ),
        (lambda: gradient_sensitivity(batch_size=0, clip=1.0), "batch_size"),
    ],
)
def test_bad_input_is_refused(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
