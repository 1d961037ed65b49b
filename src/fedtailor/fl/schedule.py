"""Client schedules fixed before training from the seed alone (independent of the data)."""

from __future__ import annotations

import numpy as np

from fedtailor.rng import numpy_rng


def uniform_schedule(*, num_clients: int, rounds: int, per_round: int, seed: int) -> np.ndarray:
    """(rounds, per_round) int64: each round draws ``per_round`` distinct clients uniformly out of ``num_clients``.

    Drawn from the key ``(seed, "schedule")``; entries index the list of training clients.
    """
    if not 1 <= per_round <= num_clients:
        raise ValueError(f"per_round must be in [1, num_clients={num_clients}], got {per_round}.")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}.")
    rng = numpy_rng(seed, "schedule")
    return np.stack([rng.choice(num_clients, size=per_round, replace=False) for _ in range(rounds)]).astype(np.int64)


def participation_counts(schedule: np.ndarray, num_clients: int) -> np.ndarray:
    """T_i: the number of rounds in which each client takes part."""
    return np.bincount(np.asarray(schedule).reshape(-1), minlength=num_clients)
