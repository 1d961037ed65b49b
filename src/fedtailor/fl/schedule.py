"""Client schedules fixed before training from the seed alone (independent of the data).

The schedule is sampled from public randomness before training; client ``i`` takes part in ``T_i`` rounds and
``T_max = max_i T_i`` calibrates the noise of private methods (:mod:`fedtailor.privacy.calibrate`).
"""

from __future__ import annotations

import numpy as np

from fedtailor.rng import numpy_rng


def uniform_schedule(*, num_clients: int, rounds: int, per_round: int, seed: int) -> np.ndarray:
    """The fixed schedule: each round picks ``per_round`` distinct clients uniformly out of ``num_clients``.

    Drawn from ``numpy_rng(seed, "schedule")`` with ``rng.choice(num_clients, size=per_round,
    replace=False)`` per round. Returns an int64 array of shape ``(rounds, per_round)``.
    """
    if num_clients < 1 or rounds < 0 or per_round < 1:
        raise ValueError(
            f"need num_clients >= 1, rounds >= 0, per_round >= 1; got {num_clients}, {rounds}, {per_round}."
        )
    if per_round > num_clients:
        raise ValueError(f"per_round={per_round} exceeds num_clients={num_clients}; lower per_round.")
    rng = numpy_rng(seed, "schedule")
    schedule = np.empty((rounds, per_round), dtype=np.int64)
    for t in range(rounds):
        schedule[t] = rng.choice(num_clients, size=per_round, replace=False)
    return schedule


def _check_schedule(schedule: np.ndarray, num_clients: int | None) -> np.ndarray:
    arr = np.asarray(schedule)
    if arr.ndim != 2:
        raise ValueError(f"schedule must be a 2-D array (rounds, clients per round), got shape {arr.shape}.")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"schedule must hold integer client ids, got dtype {arr.dtype}.")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 0:
        raise ValueError(f"schedule holds a negative client id ({arr.min()}); ids are 0..num_clients-1.")
    if num_clients is not None and arr.size and arr.max() >= num_clients:
        raise ValueError(
            f"schedule names client {arr.max()} but num_clients={num_clients}; ids are 0..num_clients-1."
        )
    sorted_rows = np.sort(arr, axis=1)
    dup = np.nonzero((sorted_rows[:, 1:] == sorted_rows[:, :-1]).any(axis=1))[0]
    if dup.size:
        raise ValueError(
            f"round {int(dup[0])} selects a client twice ({arr[dup[0]].tolist()}); each round must select "
            "distinct clients."
        )
    return arr


def participation_counts(schedule: np.ndarray, num_clients: int) -> np.ndarray:
    """``T_i`` for every client ``i`` in ``0..num_clients-1``: the number of rounds that select it (int64)."""
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}.")
    arr = _check_schedule(schedule, num_clients)
    return np.bincount(arr.ravel(), minlength=num_clients).astype(np.int64)


def t_max(schedule: np.ndarray) -> int:
    """``T_max = max_i T_i`` of a schedule (0 for an empty schedule)."""
    arr = _check_schedule(schedule, None)
    if arr.size == 0:
        return 0
    return int(np.bincount(arr.ravel()).max())
