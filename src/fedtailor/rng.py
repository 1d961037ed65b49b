"""Explicit random keys (fedjax style): every random draw names where it comes from.

A key path such as ``(seed, "schedule")`` or ``(seed, "noise", round, client)`` is hashed to a 64-bit seed,
so the draws of one round or client never depend on how many draws happened before them. This is what
makes runs reproducible, resumable from a checkpoint, and identical between the in-process loop and a
distributed (Flower) run.

That is right for public randomness (partition, schedule, initialisation, the subspace P) and for privacy noise
in *simulation*. Privacy noise outside simulation must not be a function of the config: its keys come from
:func:`fresh_key` (see ``fedtailor.privacy.noise`` and docs/privacy.md, "Randomness").
"""

from __future__ import annotations

import hashlib
import secrets
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported lazily so that numpy-only users (data, partitions) load fast
    import torch

KeyPart = int | str | bytes


def derive_seed(*path: KeyPart) -> int:
    """A 63-bit seed determined by ``path`` alone (SHA-256 of its canonical encoding)."""
    return int.from_bytes(_digest(path)[:8], "little") >> 1


def _digest(path: tuple[KeyPart, ...]) -> bytes:
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
    return h.digest()


def derive_key(*path: KeyPart) -> int:
    """A 256-bit key determined by ``path`` alone (the whole SHA-256 digest of its canonical encoding).

    Keys of the privacy mechanisms are this wide so that a secret key (:func:`fresh_key`) keeps its 256 bits of
    entropy through every derivation, instead of the 63 bits of :func:`derive_seed`."""
    return int.from_bytes(_digest(path), "little")


def fresh_key() -> int:
    """A 256-bit secret from the operating system's CSPRNG (``secrets``), never derived from a config or seed."""
    return secrets.randbits(256)


def numpy_rng(*path: KeyPart) -> np.random.Generator:
    """A NumPy generator (PCG64) seeded from ``path``."""
    return np.random.Generator(np.random.PCG64(derive_seed(*path)))


def torch_generator(*path: KeyPart, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch generator on ``device`` seeded from ``path``."""
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(*path))
    return g
