"""Noise of the privacy mechanisms: cryptographic bit streams and Gaussian samplers hardened against
floating-point attacks.

Every random draw of a release comes from a keyed cryptographic stream of a 256-bit key and a label: simulation
noise from :func:`stream_words`, SHAKE-256 (the FIPS 202 extendable-output function, a cryptographic PRF of its
input); secure-mode noise that only its client draws (the dense codecs' noise, the context noise) from
:func:`secure_stream_words`, ChaCha20, about 10x faster. (LRSUQ's shared randomness, which its decoder
regenerates, reads ChaCha20 keystreams of its own keys: :class:`fedtailor.codecs.lrsuq.KeyStream`.) Nothing is
global and nothing depends on how many draws came before.

Where the key comes from is the *randomness mode* (docs/privacy.md, "Randomness"):

* ``simulation``: keys are :func:`fedtailor.rng.derive_key` of the run's seed, so a run is reproducible and
  resumes bit for bit. The seed is in the config, so whoever has the config can regenerate every noise draw
  and subtract it: the eps of such a run is a simulation figure.
* ``secure``: every key is :func:`fedtailor.rng.fresh_key` (256 bits from the operating system's CSPRNG) drawn
  by the client that adds the noise; nothing about it is in the config, the seed or the checkpoint of another
  party.

Two Gaussian samplers, one per mode, both hardened against the floating-point attack on Box-Muller/polar
samplers of Jin, McMurtry, Rubinstein and Ohrimenko ("Are We There Yet? Timing and Floating-Point Attacks on
Differential Privacy Systems", 2022, arXiv:2112.05307) the way Opacus's ``secure_mode`` is: Opacus 1.6
(``opacus.optimizers.optimizer._generate_noise``) draws from a CSPRNG (torchcsprng's ``/dev/urandom`` device)
and returns the sum of 2n = 4 Gaussian draws divided by sqrt(2n) = 2, each draw a separate call of
``torch.normal``, the defence of Holohan and Braghin ("Secure Random Sampling in Differential Privacy", 2021,
arXiv:2107.10138, section 5.1, n = 2).

* :func:`secure_gaussian_noise` (secure mode: the dense codecs' and the context's noise from a client's fresh key):
  the stream is ChaCha20 (RFC 8439, OpenSSL through ``cryptography``) keyed by 256 bits derived from the key and
  the label, about 3 GB/s on one core. Every output is ``sigma (Z_1 + Z_2 + Z_3 + Z_4) / 2`` with the four
  ``Z_j`` from four *distinct* Box-Muller pairs (each pair's cosine goes to one output, its sine to the next),
  as in Opacus where the four draws come from four independent calls; uniforms carry 52 random bits (Opacus's
  float32: 24), the transform and the sum run in float64 before any rounding to the release's float32.
* :func:`gaussian_noise` (simulation, and the dense codecs' noise without a ``noise_key``): SHAKE-256 streams
  (:func:`stream_words`), kept bit for bit as they were so that simulation runs do not move. Its four draws per
  output are the cosine and sine of two Box-Muller pairs, so it averages two independent pairs, not four: a
  weaker floating-point defence, which does not matter in simulation, where the key comes from the config and
  anyone can regenerate the noise outright.

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
#: Gaussian draws summed per output sample (Opacus ``secure_mode``: 2n = 4, divided by sqrt(2n) = 2).
DRAWS_PER_SAMPLE = 4
_EXP_ONE = np.uint64(0x3FF0000000000000)  # the exponent bits of 1.0: (m | _EXP_ONE) viewed as float64 is 1 + m 2^-52
_ONE_MINUS_HALF_ULP = 1.0 - 2.0**-53
#: Largest stream of one ChaCha20 key and nonce: 2^32 blocks of 64 bytes (its 32-bit block counter).
_CHACHA_MAX_WORDS = 2**32 * 8


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


def open_unit(words: np.ndarray, *, inplace: bool = False) -> np.ndarray:
    """Top 52 bits plus one half: exact dyadic uniforms ``((w >> 12) + 1/2) 2^-52`` strictly inside (0, 1).

    Formed as ``(1 + m 2^-52) - (1 - 2^-53)`` from the float64 whose mantissa is ``m = w >> 12``: both steps are
    exact (the subtraction by Sterbenz's lemma, the result ``(2m + 1) 2^-53`` has 53 significant bits), so the
    values are those of ``((w >> 12) + 0.5) * 2^-52``, bit for bit, at a third of the cost. ``inplace``: in the
    words' own (writable) memory, which then holds the uniforms: no new array."""
    if inplace:
        np.right_shift(words, np.uint64(12), out=words)
        np.bitwise_or(words, _EXP_ONE, out=words)
        out = words.view(np.float64)
    else:
        out = ((words >> np.uint64(12)) | _EXP_ONE).view(np.float64)
    out -= _ONE_MINUS_HALF_ULP
    return out


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


def secure_stream_words(key: int, *label: KeyPart, count: int) -> np.ndarray:
    """``count`` uint64 words of ChaCha20 keyed by the first 32 bytes of ``stream_words(key, "chacha20", *label)``,
    in a writable array of their own.

    Nonce and block counter start at zero: each (key, label) has its own ChaCha20 key, used for this stream only.
    A cryptographically secure stream at ChaCha20's speed (OpenSSL, about 0.15 ms per 512 KB here, against
    1.2-2 ms for SHAKE-256); for secret noise that no one else regenerates (secure mode). The keystream is the
    encryption of zeros, done in place in the output's memory (no plaintext buffer, no copy)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    if not 0 <= count <= _CHACHA_MAX_WORDS:
        raise ValueError(f"count must lie in [0, 2^35], got {count}")
    chacha_key = stream_words(key, "chacha20", *label, count=4).tobytes()
    buf = bytearray(8 * count)
    if count:
        Cipher(algorithms.ChaCha20(chacha_key, bytes(16)), mode=None).encryptor().update_into(memoryview(buf), buf)
    return np.frombuffer(buf, dtype="<u8")


def _secure_pairs(key: int, label: tuple[KeyPart, ...], n: int) -> tuple[np.ndarray, np.ndarray]:
    """``R_p cos A_p`` and ``R_p sin A_p`` of the ``2n`` Box-Muller pairs of :func:`secure_gaussian_components`."""
    import torch

    u = open_unit(secure_stream_words(key, "gaussian", *label, count=4 * n), inplace=True)
    # SLEEF-vectorised log and trig (torch): several times numpy's float64 ones on this CPU
    radius = torch.from_numpy(u[: 2 * n]).log_().mul_(-2.0).sqrt_().numpy()
    angle = torch.from_numpy(u[2 * n :]).mul_(2.0 * math.pi)
    cos, sin = torch.cos(angle).numpy(), torch.sin(angle).numpy()
    cos *= radius
    sin *= radius
    return cos, sin


def secure_gaussian_components(key: int, *label: KeyPart, size: int) -> np.ndarray:
    """The four standard normals of every output of :func:`secure_gaussian_noise`, shape ``(4, size)`` (float64).

    With ``n = max(size, 2)`` and ``2n`` Box-Muller pairs ``p`` (uniforms ``U_p`` and ``U_{2n + p}`` of the stream
    ``secure_stream_words(key, "gaussian", *label)``; ``R_p = sqrt(-2 ln U_p)``, ``A_p = 2 pi U_{2n + p}``), output
    ``i`` takes ``R_p cos A_p`` of pairs ``p = i`` and ``n + i`` and ``R_p sin A_p`` of pairs ``p = (i + 1) mod n``
    and ``n + (i + 1) mod n``: four distinct pairs, every normal used once, as Opacus's four separate draws."""
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    n = max(size, 2)
    cos, sin = _secure_pairs(key, label, n)
    z = np.empty((DRAWS_PER_SAMPLE, n))
    z[0], z[1] = cos[:n], cos[n:]
    z[2] = np.roll(sin[:n], -1)
    z[3] = np.roll(sin[n:], -1)
    return z[:, :size]


def secure_gaussian_noise(key: int, *label: KeyPart, sigma: float, size: int) -> np.ndarray:
    """``size`` draws of ``N(0, sigma^2)`` (float64) from the ChaCha20 stream of ``(key, label)`` (secure mode).

    Each is ``sigma (((Z_1 + Z_2) + Z_3) + Z_4) / 2`` in float64 with the ``Z_j`` of
    :func:`secure_gaussian_components`: Opacus ``secure_mode``'s sum of four independent draws over two, exactly
    N(0, 1) before the scale. ``key`` must be the client's own fresh secret (:func:`fedtailor.rng.fresh_key`); a
    given key reproduces its stream on one machine (the vectorised cosine may differ by an ulp elsewhere)."""
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"sigma must be finite and >= 0, got {sigma!r}")
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    n = max(size, 2)
    cos, sin = _secure_pairs(key, label, n)
    out = cos[:n] + cos[n:]  # the components' sum, in their order, without forming them
    out[:-1] += sin[1:n]
    out[-1] += sin[0]
    out[:-1] += sin[n + 1 :]
    out[-1] += sin[n]
    out *= sigma / 2.0
    return out[:size]
