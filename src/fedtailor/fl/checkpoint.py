"""Checkpoints of a run: what they hold (:class:`LoopState`), how they are written (atomically, owner-only: they
may hold decoding keys) and read (only tensors and fedtailor's state classes are unpickled, so a crafted file
cannot run code; a checkpoint is refused for another schedule)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from fedtailor.safeload import UnsafeGlobal, vetted_globals


@dataclass
class LoopState:
    """Everything needed to continue a run: what a checkpoint holds."""

    round: int
    server: Any
    clients: dict[int, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)


def _schedule_digest(schedule: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(schedule, dtype=np.int64).tobytes()).hexdigest()[:16]


def save_checkpoint(path: Path, state: LoopState, schedule: np.ndarray) -> None:
    """Atomically write the loop state (temp file + rename: a crash mid-write never corrupts the last one)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open_private(tmp) as f:  # it may hold decoding keys (docs/privacy.md): owner-only
        torch.save({"format": 1, "schedule": _schedule_digest(schedule), "state": state}, f)
    os.replace(tmp, path)


def open_private(path: Path) -> IO[bytes]:
    """``path`` opened for writing with mode 0600 from its creation (files that hold keys: checkpoints, the
    Flower server state); an existing file is truncated and set to 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "wb")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not belong to this run."""


def _checkpoint_globals(path: Path) -> list[Any]:
    """The classes a checkpoint's pickle names, each vetted (:func:`fedtailor.safeload.vetted_globals`):
    anything but fedtailor's state classes, safe builtins and numpy's array machinery is refused before
    unpickling."""
    try:
        return vetted_globals(path)
    except UnsafeGlobal as err:
        raise CheckpointError(
            f"checkpoint {path} refers to {err.name!r}, which no fedtailor checkpoint holds; it was not written "
            "by fedtailor (or was altered) and is not loaded. Delete it to restart the run from round 0, or "
            "start the run in a new directory with --out."
        ) from None


def load_checkpoint(path: Path, schedule: np.ndarray) -> LoopState:
    """Read and check a checkpoint; a truncated, empty or foreign file is a :class:`CheckpointError`. Only
    tensors and fedtailor's state classes are unpickled (``weights_only=True``): a crafted file cannot run code."""
    path = Path(path)
    try:
        allowed = _checkpoint_globals(path)
        with torch.serialization.safe_globals(allowed):
            blob = torch.load(path, weights_only=True)  # tensors return to the device they were saved from
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(
            f"checkpoint {path} is unreadable ({type(err).__name__}: {str(err)[:80]}); it is damaged or not a "
            "fedtailor checkpoint. Delete it to restart the run from round 0 (the run directory is otherwise "
            "kept), or start the run in a new directory with --out."
        ) from None
    if not isinstance(blob, dict) or not isinstance(blob.get("state"), LoopState):
        raise CheckpointError(
            f"checkpoint {path} does not hold a fedtailor loop state; delete it to restart the "
            "run from round 0, or start the run in a new directory with --out."
        )
    if blob.get("format") != 1 or blob.get("schedule") != _schedule_digest(schedule):
        raise CheckpointError(
            f"checkpoint {path} was written for a different schedule or format; "
            "resume with the same config and seed, or start a fresh run directory."
        )
    return blob["state"]
