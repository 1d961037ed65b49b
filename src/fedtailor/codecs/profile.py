"""The public size profile of a variable-length codec: message sizes measured on public inputs only, from which a
run fixes the one padded size every release is sent at (so that sizes reveal nothing about the data)."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from fedtailor.rng import derive_key, derive_seed


def public_codec_profile(
    codec: Any, *, k: int, sigma: float, clip: float, seed: int, keys: int = 8
) -> dict[str, float]:
    """Message sizes and coding time of ``codec`` on public inputs only, measured once before training.

    Probes: u = 0, and ||u|| = clip spread evenly over the coordinates, on one coordinate, and along a public
    random direction, each with ``keys`` public keys. Reported instead of per-release sizes (which depend on the
    data): the rate at u = 0 and at ||u|| = clip, and the padded size ``pad_bytes`` = the largest probe plus six
    times the largest standard deviation over keys plus 16 bytes (a message's size is a sum over thousands of
    independent blocks, so it exceeds this with negligible probability; a release longer than that is refused,
    not sent)."""
    rng = np.random.default_rng(derive_seed(seed, "codec-probe"))
    direction = rng.standard_normal(k)
    probes = {
        "zero": np.zeros(k),
        "spread": np.full(k, clip / math.sqrt(k)),
        "spike": np.eye(1, k).ravel() * clip,
        "random": clip * direction / np.linalg.norm(direction),
    }
    sizes: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for name, u in probes.items():
        sizes[name] = [
            len(codec.encode(u, key=derive_key(seed, "codec-probe", name, i), sigma=sigma)) for i in range(keys)
        ]
    ms = 1e3 * (time.perf_counter() - t0) / (keys * len(probes))
    worst = max(max(v) for v in sizes.values())
    spread = max(float(np.std(v)) for v in sizes.values())
    at_clip = [n for name in ("spread", "spike", "random") for n in sizes[name]]
    return {
        "bits_per_coefficient_at_u0": 8.0 * float(np.mean(sizes["zero"])) / k,
        "bits_per_coefficient_at_clip": 8.0 * float(np.mean(at_clip)) / k,
        "encode_ms": ms,
        "pad_bytes": float(math.ceil(worst + 6 * spread + 16)),
    }
