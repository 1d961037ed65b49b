"""Explicit random keys (fedjax style): every random draw names where it comes from.

A key path such as ``(seed, "schedule")`` or ``(seed, "noise", round, client)`` is hashed to a 64-bit seed,
so the draws of one round or client never depend on how many draws happened before them. This is what
makes runs reproducible, resumable from a checkpoint, and identical between the in-process loop and a
distributed (Flower) run.
"""

from __future__ import annotations

import hashlib

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported lazily so that numpy-only users (data, partitions) load fast
    import torch

KeyPart = int | str | bytes


def derive_seed(*path: KeyPart) -> int:
    """A 63-bit seed determined by ``path`` alone (SHA-256 of its canonical encoding)."""
    if not path:
        raise ValueError("derive_seed needs at least one key part, e.g. derive_seed(seed, 'partition').")
    h = hashlib.sha256()
    for part in path:
        if isinstance(part, bool) or not isinstance(part, (int, str, bytes, np.integer)):
            raise TypeError(f"key parts must be int, str or bytes, got {type(part).__name__}: {part!r}")
        if isinstance(part, bytes):
            tag, raw = b"b", part
        elif isinstance(part, str):
            tag, raw = b"s", part.encode()
        else:
            tag, raw = b"i", str(int(part)).encode()
        h.update(tag + len(raw).to_bytes(8, "little") + raw)
    return int.from_bytes(h.digest()[:8], "little") >> 1


def numpy_rng(*path: KeyPart) -> np.random.Generator:
    """A NumPy generator (PCG64) seeded from ``path``."""
    return np.random.Generator(np.random.PCG64(derive_seed(*path)))


def torch_generator(*path: KeyPart, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch generator on ``device`` seeded from ``path``."""
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(*path))
    return g
