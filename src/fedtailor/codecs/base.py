"""The codec interface: a release ``u + N(0, sigma^2 I)`` realised as one variable-length byte string.

Every codec maps a float vector ``u`` and a per-release key to ``bytes`` (``encode``) and back to the noisy
float64 vector (``decode``). The key is what encoder and decoder share for one release (LRSUQ: its shared
randomness; the dense codecs: only the header's check tag); it is derived from (secret, client, round) by
:func:`release_key` and must never be reused for another release. A codec whose noise the decoder does not need
(``private_noise``: DG FP32, DG+Q12) draws it from ``noise_key``, a key the encoder never shares, so that the
holder of the shared key cannot regenerate it. Keys are 256-bit ints; LRSUQ's shared random words come from
ChaCha20 keystreams keyed by ``derive_key(key, "lrsuq", purpose)`` (:class:`fedtailor.codecs.lrsuq.KeyStream`),
the DG simulation noise of a release key from :func:`fedtailor.privacy.noise.stream_words` (SHAKE-256), the
private noise of a ``noise_key`` from :func:`fedtailor.privacy.noise.secure_stream_words` (ChaCha20).
Every failure to decode raises :class:`CodecError` with a message that names the problem.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod

import numpy as np

from fedtailor.privacy.noise import check_key  # noqa: F401  (re-exported: the codecs check keys with it)
from fedtailor.rng import derive_key

# Inputs beyond this many sigmas are refused: the float64 error E = y - u would lose more than 2^-20 of its
# resolution (and no sensitivity-bounded statistic comes near it).
MAX_INPUT_SIGMAS = 2.0**32
# Largest dimension a message may declare (the header stores it in 32 bits).
MAX_DIM = 2**31 - 1


class CodecError(ValueError):
    """A message cannot be decoded (truncated, corrupted, hostile, or meant for another codec/key/size)."""


def release_key(secret: int, client: int, round: int) -> int:
    """The shared-randomness key of client ``client``'s release in round ``round`` (256-bit).

    Derived as ``derive_key(secret, "release", client, round)``, so every (client, round) gets a fresh,
    independent key; encoder and decoder both call this with the same secret: in secure mode a 256-bit secret
    the client drew from OS entropy and gave only to the decoder, in simulation one derived from the run seed.
    """
    return derive_key(secret, "release", client, round)


class Codec(ABC):
    """Encode ``u`` into a message whose decoding is ``u + e`` with ``e`` the codec's noise.

    ``name`` is the registry name (``get_codec(name)``); ``codec_id`` is the id stored in the header.
    """

    name: str
    codec_id: int
    #: True when the decoder needs none of the noise's randomness (the noise is drawn from ``noise_key``, which
    #: never leaves the encoder); False when the noise is a function of the shared key (LRSUQ's quantisation
    #: error: the decoder, holding the key, knows each block's layer and dithers, docs/privacy.md).
    private_noise: bool = False

    @abstractmethod
    def encode(self, u: np.ndarray, *, key: int, sigma: float, noise_key: int | None = None) -> bytes:
        """One release of ``u`` (shape ``(d,)``) with noise scale ``sigma`` and shared key ``key``.

        ``noise_key``: the encoder's own key for codecs with ``private_noise`` (ignored by the others); None
        draws the noise from ``key`` (simulation: whoever holds ``key`` can then regenerate the noise)."""

    @abstractmethod
    def decode(self, message: bytes, *, key: int, sigma: float, dim: int) -> np.ndarray:
        """The released float64 vector of shape ``(dim,)``; raises :class:`CodecError` on any bad message."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def check_sigma(sigma: object, *, allow_zero: bool = False) -> float:
    """``sigma`` as a positive finite float (or zero, for a noiseless dense release, with ``allow_zero``)."""
    if isinstance(sigma, bool) or not isinstance(sigma, numbers.Real):
        raise TypeError(f"sigma must be a positive float, got {type(sigma).__name__}")
    s = float(sigma)
    if allow_zero and s == 0.0:
        return s
    if not (math.isfinite(s) and s > 0.0):
        raise ValueError(f"sigma must be positive and finite, got {s}; calibrate it with fedtailor.privacy")
    return s


def check_dim(dim: object) -> int:
    """``dim`` as an int in [1, MAX_DIM]."""
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    d = int(dim)
    if not 1 <= d <= MAX_DIM:
        raise ValueError(f"dim must lie in [1, {MAX_DIM}], got {d}")
    return d


def check_input(u: object, sigma: float, *, bound_sigmas: bool) -> np.ndarray:
    """``u`` as a contiguous float64 vector; refuses other ranks, empty, non-finite and (optionally) huge inputs."""
    arr = np.asarray(u)
    if arr.dtype.kind not in "fiu" or arr.dtype == np.bool_:
        raise ValueError(f"u must be a real float array, got dtype {arr.dtype}; convert with np.asarray(u, float)")
    if arr.ndim != 1:
        raise ValueError(f"u must be a vector of shape (d,), got shape {arr.shape}; flatten it first (u.ravel())")
    if arr.size == 0 or arr.size > MAX_DIM:
        raise ValueError(f"u must have between 1 and {MAX_DIM} entries, got {arr.size}")
    arr = np.ascontiguousarray(arr, dtype=np.float64)
    if not np.all(np.isfinite(arr)):
        raise ValueError("u contains NaN or infinite entries; the release is undefined for them")
    if bound_sigmas:
        peak = float(np.max(np.abs(arr)))
        if peak > MAX_INPUT_SIGMAS * sigma:
            raise ValueError(
                f"max |u| = {peak:.3g} exceeds 2^32 sigma = {MAX_INPUT_SIGMAS * sigma:.3g}: the quantiser's float64 "
                "error would lose resolution; clip or rescale u (a sensitivity-bounded release never comes near this)"
            )
    return arr
