"""The schedule's participation counts without the schedule: equal to counting the sampled schedule, bit for bit,
in memory that does not grow with the rounds."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from fedtailor.fl.schedule import _floyd_rounds, participation_counts, schedule_counts, uniform_schedule
from fedtailor.rng import numpy_rng


@pytest.mark.parametrize(
    ("clients", "per_round", "rounds", "seed"),
    [
        (40, 2, 500, 41),
        (40, 2, 3001, 7),
        (5, 5, 200, 1),
        (1, 1, 10, 3),
        (10, 3, 999, 2),
        (100, 7, 777, 5),
        (2, 1, 50, 9),
        (10_000, 2, 300, 4),
        (10_000, 10, 100, 3),
        (7, 6, 400, 8),
        (20_000, 500, 20, 1),
        (40, 2, 0, 1),
    ],
)
def test_schedule_counts_are_the_counts_of_the_sampled_schedule(clients, per_round, rounds, seed, monkeypatch):
    """Every branch of numpy's choice (Floyd's algorithm, k = n, the tail shuffle of a large population) and
    chunks cut anywhere (tiny chunks here)."""
    from fedtailor.fl import schedule

    want = participation_counts(
        uniform_schedule(num_clients=clients, rounds=rounds, per_round=per_round, seed=seed), clients
    )
    monkeypatch.setattr(schedule, "_DRAWS_PER_CHUNK", 97)
    got = schedule_counts(num_clients=clients, rounds=rounds, per_round=per_round, seed=seed)
    assert got.dtype == np.int64 and np.array_equal(got, want)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_vectorized_draws_follow_numpys_choice_through_redraws(k):
    """A population of 3 * 2^30 makes about one draw in four a Lemire redraw: the chunks are cut there and the
    rounds still equal numpy's own choices, and the generator ends in the same state."""
    n, rounds = 3 * 2**30, 300
    slow_rng, fast_rng = numpy_rng(5, "x"), numpy_rng(5, "x")
    slow = np.stack([np.sort(slow_rng.choice(n, size=k, replace=False)) for _ in range(rounds)])
    fast = np.sort(np.concatenate(list(_floyd_rounds(n, rounds, k, fast_rng))), axis=1)
    assert np.array_equal(slow, fast)
    a, b = slow_rng.bit_generator.state, fast_rng.bit_generator.state
    assert a["state"] == b["state"] and a["has_uint32"] == b["has_uint32"]
    assert slow_rng.integers(1 << 30) == fast_rng.integers(1 << 30)


def test_counting_a_long_schedule_does_not_hold_it():
    """10^7 rounds of 2 clients: the schedule alone would take 160 MB; the counts take a bounded chunk."""
    calls = []
    tracemalloc.start()
    try:
        counts = schedule_counts(num_clients=40, rounds=10**7, per_round=2, seed=41, progress=calls.append)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert counts.sum() == 2 * 10**7 and sum(calls) == 10**7 and len(calls) > 1
    assert peak < 100e6, peak
