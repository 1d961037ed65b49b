"""Noise of the privacy mechanisms: a cryptographic bit stream and a Gaussian sampler hardened against
floating-point attacks.

Every random draw of a release (the dense Gaussian noise, the context noise, LRSUQ's radius and dithers) comes
from :func:`stream_words`: SHAKE-256 (the FIPS 202 extendable-output function, a cryptographic PRF of its input)
of a 256-bit key and a label. Nothing is global and nothing depends on how many draws came before.

Where the key comes from is the *randomness mode* (docs/privacy.md, "Randomness"):

* ``simulation``: keys are :func:`fedtailor.rng.derive_key` of the run's seed, so a run is reproducible and
  resumes bit for bit. The seed is in the config, so whoever has the config can regenerate every noise draw
  and subtract it: the eps of such a run is a simulation figure.
* ``secure``: every key is :func:`fedtailor.rng.fresh_key` (256 bits from the operating system's CSPRNG) drawn
  by the client that adds the noise; nothing about it is in the config, the seed or the checkpoint of another
  party.

The Gaussian sampler follows Opacus's ``secure_mode`` and goes beyond it. Opacus draws from a CSPRNG (AES-CTR of
torchcsprng) and returns the sum of four Gaussian draws divided by two, the defence of Holohan and Braghin
("Secure Random Sampling in Differential Privacy", 2021, arXiv:2107.10138) against the floating-point attack on
Box-Muller/polar samplers of Jin, McMurtry, Rubinstein and Ohrimenko ("Are We There Yet? Timing and
Floating-Point Attacks on Differential Privacy Systems", 2022, arXiv:2112.05307). Here: the stream is SHAKE-256
with a 256-bit key, the uniforms carry 52 random bits (not 24), the Box-Muller transform runs in float64, and the
sum of four draws over two is taken in float64 before any rounding to the release's float32.
LRSUQ's decoded output ``beta (M + V_K)`` is computed from the shared randomness and the integer index alone,
never from ``u + noise``, so the floating-point attack on additive noise does not apply to it.
"""

from __future__ import annotations

import hashlib
import math
import numbers

import numpy as np

from fedtailor.rng import KeyPart

#: Bits of every mechanism key (:func:`fedtailor.rng.fresh_key`, :func:`fedtailor.rng.derive_key`).
KEY_BITS = 256
#: Gaussian draws summed per output sample (Opacus ``secure_mode``: 4, divided by 2).
DRAWS_PER_SAMPLE = 4
_TWO_M52 = 2.0**-52


def check_key(key: object) -> int:
    """``key`` as a Python int in [0, 2^256); a clear error otherwise."""
    if isinstance(key, bool) or not isinstance(key, numbers.Integral):
        raise TypeError(f"key must be an int (fedtailor.rng.fresh_key() or derive_key(...)), got {type(key).__name__}")
    k = int(key)
    if not 0 <= k < 2**KEY_BITS:
        raise ValueError(
            f"key must lie in [0, 2^{KEY_BITS}), got {k}; use fedtailor.rng.fresh_key() or derive_key(...)"
        )
    return k


def _label_bytes(label: tuple[KeyPart, ...]) -> bytes:
    out = bytearray()
    for part in label:
        if isinstance(part, bool) or not isinstance(part, (int, str, bytes, np.integer)):
            raise TypeError(f"label parts must be int, str or bytes, got {type(part).__name__}: {part!r}")
        raw = part if isinstance(part, bytes) else part.encode() if isinstance(part, str) else str(int(part)).encode()
        out += len(raw).to_bytes(8, "little") + raw
    return bytes(out)


def stream_words(key: int, *label: KeyPart, count: int) -> np.ndarray:
    """``count`` uint64 words of SHAKE-256(key || label): independent streams for distinct labels."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    seed = check_key(key).to_bytes(KEY_BITS // 8, "little") + _label_bytes(label)
    return np.frombuffer(hashlib.shake_256(seed).digest(8 * count), dtype="<u8")


def open_unit(words: np.ndarray) -> np.ndarray:
    """Top 52 bits plus one half: exact dyadic uniforms strictly inside (0, 1) (no log(0))."""
    return ((words >> np.uint64(12)).astype(np.float64) + 0.5) * _TWO_M52


def gaussian_noise(key: int, *label: KeyPart, sigma: float, size: int) -> np.ndarray:
    """``size`` draws of ``N(0, sigma^2)`` (float64) from the stream ``(key, label)``.

    Each is ``sigma (Z_1 + Z_2 + Z_3 + Z_4) / 2`` with ``Z_j`` standard normals from Box-Muller pairs of 52-bit
    uniforms; the sum of four independent N(0, 1) over two is exactly N(0, 1)."""
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"sigma must be finite and >= 0, got {sigma!r}")
    pairs = -(-DRAWS_PER_SAMPLE * size // 2)
    u = open_unit(stream_words(key, "gaussian", *label, count=2 * pairs)).reshape(2, pairs)
    radius = np.sqrt(-2.0 * np.log(u[0]))
    angle = (2.0 * math.pi) * u[1]
    z = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[: DRAWS_PER_SAMPLE * size]
    return (sigma / 2.0) * z.reshape(DRAWS_PER_SAMPLE, size).sum(axis=0)
