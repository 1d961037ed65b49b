"""Ledger numbers, exact save/load/continue, and the budget guard's refusals."""

from __future__ import annotations

import json
import math

import pytest

from fedtailor.privacy.accountant import CONVERSIONS, epsilon_from_rho
from fedtailor.privacy.calibrate import calibrate_sigma, planned_releases, t_max, uniform_schedule
from fedtailor.privacy.ledger import BudgetGuard, PrivacyBudgetExceeded, PrivacyLedger

D = 2 / 333


def _run_rounds(ledger: PrivacyLedger, schedule, sigma: float, rounds: range) -> None:
    for t in rounds:
        for client in schedule[t]:
            ledger.record(client=int(client), round=t, sensitivity=D, sigma=sigma, mechanism="coef-grad")


def test_ledger_reports_per_client_and_max_epsilon() -> None:
    ledger = PrivacyLedger(delta=1e-5)
    assert ledger.max_epsilon() == 0.0
    for c in range(3):
        ledger.record(client=c, round=-1, sensitivity=D, sigma=0.02, mechanism="context")
    for t in range(5):
        ledger.record(client=0, round=t, sensitivity=D, sigma=0.02, mechanism="coef-grad")
    ledger.record(client=1, round=2, sensitivity=D, sigma=0.01, mechanism="coef-grad")
    rho0 = 6 * D**2 / (2 * 0.02**2)
    rho1 = D**2 / (2 * 0.02**2) + D**2 / (2 * 0.01**2)
    assert ledger.rho(0) == pytest.approx(rho0, rel=1e-14)
    assert ledger.rho(1) == pytest.approx(rho1, rel=1e-14)
    assert ledger.rho(99) == 0.0
    for conv in CONVERSIONS:
        eps = ledger.epsilons(conversion=conv)
        assert set(eps) == {0, 1, 2}
        assert eps[0] == pytest.approx(epsilon_from_rho(rho0, delta=1e-5, conversion=conv), rel=1e-14)
        assert ledger.max_epsilon(conversion=conv) == max(eps.values())
    assert ledger.max_epsilon() == ledger.epsilon(0)  # rho0 = 6 * D^2/(2*0.02^2) > rho1 = 5 * (the same)
    assert ledger.epsilon(0, delta=1e-3) < ledger.epsilon(0)


def test_save_load_same_numbers_then_continue() -> None:
    schedule = uniform_schedule(num_clients=10, rounds=60, per_round=2, seed=3)
    sigma = 0.0213
    full = PrivacyLedger(delta=1e-5, conversion="balle")
    _run_rounds(full, schedule, sigma, range(60))

    first = PrivacyLedger(delta=1e-5, conversion="balle")
    _run_rounds(first, schedule, sigma, range(25))
    text = first.to_json()
    json.loads(text)  # plain JSON
    resumed = PrivacyLedger.from_json(text)
    assert resumed.releases == first.releases
    assert resumed.conversion == "balle" and resumed.delta == 1e-5
    for conv in CONVERSIONS:
        assert resumed.epsilons(conversion=conv) == first.epsilons(conversion=conv)  # bit-identical
    _run_rounds(resumed, schedule, sigma, range(25, 60))
    assert resumed.epsilons() == full.epsilons()
    assert PrivacyLedger.from_dict(full.to_dict()).releases == full.releases
    with pytest.raises(ValueError, match="already recorded"):
        _run_rounds(resumed, schedule, sigma, range(59, 60))  # a resume that repeats a round is refused
    with pytest.raises(ValueError, match="not a privacy ledger"):
        PrivacyLedger.from_dict({"format": "other"})


def test_guard_accepts_the_calibrated_schedule_exactly_at_the_target() -> None:
    schedule = uniform_schedule(num_clients=40, rounds=500, per_round=2, seed=41)
    tm = t_max(schedule)
    for conv in CONVERSIONS:
        sigma = calibrate_sigma(
            eps=16.0, delta=1e-5, t_max=tm, context_sensitivity=D, gradient_sensitivity=D, conversion=conv
        )
        ledger = PrivacyLedger(delta=1e-5, conversion=conv)
        guard = BudgetGuard(ledger, target_eps=16.0)
        plan = planned_releases(schedule, num_clients=40, sigma=sigma, context_sensitivity=D, gradient_sensitivity=D)
        final = guard.check_plan(plan)
        assert max(final.values()) == pytest.approx(16.0, rel=1e-9)
        # A hair less noise must be refused by the same check.
        tight = planned_releases(
            schedule, num_clients=40, sigma=sigma * (1 - 1e-6), context_sensitivity=D, gradient_sensitivity=D
        )
        with pytest.raises(PrivacyBudgetExceeded):
            guard.check_plan(tight)


def test_guard_refuses_the_release_that_overshoots_and_records_nothing() -> None:
    sigma = calibrate_sigma(eps=8.0, delta=1e-5, t_max=3, context_sensitivity=D, gradient_sensitivity=D)
    ledger = PrivacyLedger(delta=1e-5)
    guard = BudgetGuard(ledger, target_eps=8.0)
    guard.record(client=4, round=-1, sensitivity=D, sigma=sigma, mechanism="context")
    for t in range(3):
        guard.record(client=4, round=t, sensitivity=D, sigma=sigma, mechanism="coef-grad")
    assert ledger.epsilon(4) == pytest.approx(8.0, rel=1e-9)
    with pytest.raises(PrivacyBudgetExceeded) as info:
        guard.record(client=4, round=3, sensitivity=D, sigma=sigma, mechanism="coef-grad")
    err = info.value
    assert isinstance(err, RuntimeError)
    would = epsilon_from_rho(5 * D**2 / (2 * sigma**2), delta=1e-5)
    assert err.client == 4 and err.target == 8.0
    assert err.epsilon == pytest.approx(would, rel=1e-12)
    assert err.overshoot == pytest.approx(would - 8.0, rel=1e-9)
    msg = str(err)
    assert "client 4" in msg and f"{would:.6g}" in msg and "target eps = 8" in msg
    assert f"{would - 8.0:.3g}" in msg and "round 3" in msg
    assert len(ledger.releases) == 4  # the refused release was not recorded
    guard.record(client=5, round=3, sensitivity=D, sigma=sigma, mechanism="coef-grad")  # others continue


def test_plan_check_names_the_worst_client_and_counts_existing_releases() -> None:
    ledger = PrivacyLedger(delta=1e-5, conversion="exact")
    for t in range(10):
        ledger.record(client=2, round=t, sensitivity=D, sigma=0.02, mechanism="coef-grad")
    guard = BudgetGuard(ledger, target_eps=4.0)
    plan = {0: [(D, 0.02)] * 5, 1: [(D, 0.02)] * 30, 2: [(D, 0.02)] * 25}
    with pytest.raises(PrivacyBudgetExceeded, match=r"client 2 .*1 other client") as info:
        guard.check_plan(plan)
    assert info.value.epsilon == pytest.approx(
        epsilon_from_rho(35 * D**2 / (2 * 0.02**2), delta=1e-5, conversion="exact"), rel=1e-12
    )
    assert guard.check_plan({0: [(D, 0.02)] * 5})[0] < 4.0


def test_bad_input_is_refused() -> None:
    ledger = PrivacyLedger(delta=1e-5)
    with pytest.raises(ValueError, match="delta"):
        PrivacyLedger(delta=0.0)
    with pytest.raises(ValueError, match="choose one of"):
        PrivacyLedger(delta=1e-5, conversion="moments")
    with pytest.raises(ValueError, match="sigma"):
        ledger.record(client=0, round=0, sensitivity=D, sigma=0.0, mechanism="coef-grad")
    with pytest.raises(ValueError, match="mechanism"):
        ledger.record(client=0, round=0, sensitivity=D, sigma=1.0, mechanism="")
    with pytest.raises(ValueError, match="client"):
        ledger.record(client=1.5, round=0, sensitivity=D, sigma=1.0, mechanism="x")
    with pytest.raises(ValueError, match="target_eps"):
        BudgetGuard(ledger, target_eps=math.inf)
