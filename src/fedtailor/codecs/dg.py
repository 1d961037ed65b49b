"""Direct Gaussian baselines (compared variants, ``docs/compact.md``): DG FP32 and DG+Q12.

* ``dg-fp32``: ``y = u + e``, ``e ~ N(0, sigma^2 I)`` drawn from the encoder's private ``noise_key`` (the shared
  release key only makes the header's check tag, so its holder cannot regenerate ``e``), sent as dense float32
  (32 bits per coefficient). The decoded vector is ``y`` rounded to float32.

The noise: with a ``noise_key`` (secure mode) :func:`fedtailor.privacy.noise.secure_gaussian_noise` (ChaCha20,
four Box-Muller draws from distinct pairs over two, about 0.6 ms at k = 16,384); without one (simulation)
:func:`fedtailor.privacy.noise.gaussian_noise` of the shared release key (SHAKE-256, unchanged bit for bit).
* ``dg-q12``: the communication comparison of *Privacy-Aligned Personalized Federated Learning with Compact
  Adaptation and Variable-Length Gaussian Communication*: the noisy vector quantised *after* noising to 12
  bits, uniformly over its range ``[min y, max y]`` (both float64 in the payload); decoded as
  ``lo + q (hi - lo) / 4095``. Its error is not Gaussian: the quantisation distortion comes on top of ``e``.
"""

from __future__ import annotations

import struct

import numpy as np

from fedtailor.codecs.base import Codec, CodecError, check_dim, check_input, check_key, check_sigma
from fedtailor.codecs.format import Frame, open_message, seal
from fedtailor.privacy import noise

LEVELS = 4095


def gaussian_noise(key: int, sigma: float, dim: int) -> np.ndarray:
    """``N(0, sigma^2 I_dim)`` from the release key (:func:`fedtailor.privacy.noise.gaussian_noise`, label "dg")."""
    return noise.gaussian_noise(key, "dg", sigma=sigma, size=dim)


def secure_gaussian_noise(noise_key: int, sigma: float, dim: int) -> np.ndarray:
    """``N(0, sigma^2 I_dim)`` from the encoder's own key (:func:`fedtailor.privacy.noise.secure_gaussian_noise`)."""
    return noise.secure_gaussian_noise(noise_key, "dg", sigma=sigma, size=dim)


def dense_noise(key: int, noise_key: int | None, sigma: float, dim: int) -> np.ndarray:
    """The dense noise of a release: from the encoder's own ``noise_key`` (secure mode, ChaCha20), else
    (simulation) from the shared key (SHAKE-256: whoever holds ``key`` can regenerate it)."""
    if noise_key is None:
        return gaussian_noise(key, sigma, dim)
    return secure_gaussian_noise(check_key(noise_key), sigma, dim)


def _decode_args(key: object, sigma: object, dim: object, *, allow_zero: bool = False) -> tuple[int, float, int]:
    try:
        return check_key(key), check_sigma(sigma, allow_zero=allow_zero), check_dim(dim)
    except (TypeError, ValueError) as err:
        raise CodecError(str(err)) from err


class DirectGaussianCodec(Codec):
    """DG FP32: noise from the key, then the dense float32 vector. ``sigma = 0`` sends ``u`` itself (the
    noiseless controls of the compact-adaptation paper)."""

    name = "dg-fp32"
    codec_id = 1
    frame = Frame(1, 0, 0, 0)
    private_noise = True

    def encode(self, u: np.ndarray, *, key: int, sigma: float, noise_key: int | None = None) -> bytes:
        key, sigma = check_key(key), check_sigma(sigma, allow_zero=True)
        u = check_input(u, sigma, bound_sigmas=False)
        y = (u + dense_noise(key, noise_key, sigma, u.size)).astype("<f4")
        if not np.all(np.isfinite(y)):
            raise ValueError("u + noise overflows float32; rescale u")
        return seal(self.frame, dim=u.size, key=key, sigma=sigma, payload=y.tobytes())

    def decode(self, message: bytes, *, key: int, sigma: float, dim: int) -> np.ndarray:
        key, sigma, dim = _decode_args(key, sigma, dim, allow_zero=True)
        payload = open_message(message, self.frame, dim=dim, key=key, sigma=sigma)
        if len(payload) != 4 * dim:
            raise CodecError(f"payload holds {len(payload)} bytes, {4 * dim} expected for {dim} float32 values")
        y = np.frombuffer(payload, dtype="<f4").astype(np.float64)
        if not np.all(np.isfinite(y)):
            raise CodecError("payload holds NaN or infinite values")
        return y


def pack12(q: np.ndarray) -> bytes:
    """12-bit unsigned values, big-endian nibble order, two per three bytes; ceil(12 n / 8) bytes."""
    n = q.size
    qq = np.zeros(n + (n % 2), dtype=np.uint16)
    qq[:n] = q
    a, b = qq[0::2], qq[1::2]
    out = np.empty((a.size, 3), dtype=np.uint8)
    out[:, 0] = a >> 4
    out[:, 1] = ((a & 0xF) << 4) | (b >> 8)
    out[:, 2] = b & 0xFF
    return out.tobytes()[: (12 * n + 7) // 8]


def unpack12(data: bytes, n: int) -> np.ndarray:
    """Inverse of :func:`pack12`; the padding nibble of an odd count must be zero."""
    raw = np.zeros(3 * ((n + 1) // 2), dtype=np.uint8)
    raw[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    raw = raw.reshape(-1, 3).astype(np.uint16)
    a = (raw[:, 0] << 4) | (raw[:, 1] >> 4)
    b = ((raw[:, 1] & 0xF) << 8) | raw[:, 2]
    if n % 2 and b[-1] != 0:
        raise CodecError("payload padding bits are not zero")
    q = np.empty(a.size + b.size, dtype=np.uint16)
    q[0::2], q[1::2] = a, b
    return q[:n]


class DGQ12Codec(Codec):
    """DG+Q12: noise from the key, then 12-bit uniform quantisation over the range of the noisy vector."""

    name = "dg-q12"
    codec_id = 2
    frame = Frame(2, 0, 0, 0)
    private_noise = True

    def encode(self, u: np.ndarray, *, key: int, sigma: float, noise_key: int | None = None) -> bytes:
        key, sigma = check_key(key), check_sigma(sigma)
        u = check_input(u, sigma, bound_sigmas=False)
        y = u + dense_noise(key, noise_key, sigma, u.size)
        lo, hi = float(y.min()), float(y.max())
        if not np.isfinite(hi - lo):
            raise ValueError("the range of u + noise overflows float64; rescale u")
        q = np.zeros(y.size, dtype=np.uint16) if hi == lo else np.rint((y - lo) * (LEVELS / (hi - lo)))
        payload = struct.pack("<dd", lo, hi) + pack12(np.clip(q, 0, LEVELS).astype(np.uint16))
        return seal(self.frame, dim=u.size, key=key, sigma=sigma, payload=payload)

    def decode(self, message: bytes, *, key: int, sigma: float, dim: int) -> np.ndarray:
        key, sigma, dim = _decode_args(key, sigma, dim)
        payload = open_message(message, self.frame, dim=dim, key=key, sigma=sigma)
        expected = 16 + (12 * dim + 7) // 8
        if len(payload) != expected:
            raise CodecError(f"payload holds {len(payload)} bytes, {expected} expected for {dim} 12-bit values")
        lo, hi = struct.unpack_from("<dd", payload)
        if not (np.isfinite(lo) and np.isfinite(hi) and lo <= hi and np.isfinite(hi - lo)):
            raise CodecError(f"payload range [{lo}, {hi}] is not a finite interval")
        q = unpack12(payload[16:], dim).astype(np.float64)
        return lo + q * ((hi - lo) / LEVELS)
