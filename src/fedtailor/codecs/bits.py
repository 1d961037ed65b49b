"""Vectorised bit packing and Elias-gamma codes (no per-bit or per-value Python loops).

A *gamma group* codes ``n`` integers ``x >= 1`` with Elias's gamma code (Elias 1975): ``floor(log2 x)`` zeros,
then ``x`` in binary. Within a group the bits are reordered, not changed: first every value's unary prefix
(``L_i`` zeros and the leading one), then every value's remaining ``L_i`` mantissa bits. The length is exactly
that of the gamma code, and the reader finds all prefixes at once from the positions of the ones.
"""

from __future__ import annotations

import numpy as np

from fedtailor.codecs.base import CodecError

# Largest value a gamma group may hold: sums of mantissa bits are formed in float64, exact below 2^53.
MAX_GAMMA = 2**53 - 1


def bit_lengths(x: np.ndarray) -> np.ndarray:
    """``floor(log2 x)`` for integers ``1 <= x < 2^53`` (exact via the float exponent)."""
    _, exp = np.frexp(x.astype(np.float64))
    return exp.astype(np.int64) - 1


def zigzag(m: np.ndarray) -> np.ndarray:
    """Signed to unsigned: 0, -1, 1, -2, 2, ... -> 0, 1, 2, 3, 4, ..."""
    m = m.astype(np.int64)
    return np.where(m >= 0, 2 * m, -2 * m - 1)


def unzigzag(z: np.ndarray) -> np.ndarray:
    """Inverse of :func:`zigzag`."""
    z = z.astype(np.int64)
    return np.where(z % 2 == 0, z // 2, -(z + 1) // 2)


def gamma_bits(x: np.ndarray) -> int:
    """Total length in bits of the gamma codes of ``x``."""
    if x.size == 0:
        return 0
    return int(np.sum(2 * bit_lengths(x) + 1))


class BitWriter:
    """Collects bit groups; ``getvalue`` packs them MSB-first into bytes (zero padding at the end)."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []

    def bits(self, b: np.ndarray) -> None:
        """Append raw bits (array of 0/1)."""
        self._parts.append(np.asarray(b, dtype=np.uint8))

    def gamma(self, x: np.ndarray) -> None:
        """Append a gamma group for integers ``1 <= x <= MAX_GAMMA``."""
        x = np.asarray(x, dtype=np.int64).ravel()
        if x.size == 0:
            return
        if x.min() < 1 or x.max() > MAX_GAMMA:
            raise ValueError(f"gamma codes need integers in [1, 2^53), got range [{x.min()}, {x.max()}]")
        n = bit_lengths(x)
        prefix = np.zeros(int(n.sum()) + x.size, dtype=np.uint8)
        prefix[np.cumsum(n) + np.arange(x.size)] = 1
        self._parts.append(prefix)
        self.low_bits(x, n)

    def low_bits(self, x: np.ndarray, n: np.ndarray) -> None:
        """Append the ``n_i`` lowest bits of each ``x_i`` (most significant first; ``0 <= n_i <= 53``)."""
        end = np.cumsum(n)  # value i's bits are end[i] - n[i] .. end[i] - 1, most significant first
        total = int(end[-1]) if end.size else 0
        owner = np.repeat(np.arange(x.size), n)
        shift = (end - 1).take(owner)
        shift -= np.arange(total)
        self._parts.append(((np.asarray(x, dtype=np.int64).take(owner) >> shift) & 1).astype(np.uint8))

    def getvalue(self) -> bytes:
        if not self._parts:
            return b""
        return np.packbits(np.concatenate(self._parts)).tobytes()


class BitReader:
    """Reads what :class:`BitWriter` wrote; every overrun or malformed code raises :class:`CodecError`."""

    def __init__(self, data: bytes) -> None:
        self._bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
        self._pos = 0

    def bits(self, n: int) -> np.ndarray:
        if n > self._bits.size - self._pos:
            raise CodecError(f"payload truncated: needed {n} more bits, {self._bits.size - self._pos} left")
        out = self._bits[self._pos : self._pos + n]
        self._pos += n
        return out

    def gamma(self, count: int, *, limit: int = MAX_GAMMA) -> np.ndarray:
        """Read a gamma group of ``count`` values, each required to lie in [1, limit]."""
        if count == 0:
            return np.zeros(0, dtype=np.int64)
        longest = int(limit).bit_length() - 1  # most leading zeros a value in [1, limit] has
        span = count * (longest + 1)  # the prefixes of count such values fit in this many bits
        ones = np.flatnonzero(self._bits[self._pos : self._pos + span])
        if ones.size < count:
            if self._bits.size - self._pos < span:
                raise CodecError(f"payload truncated: a group of {count} gamma codes ends after {ones.size}")
            raise CodecError(f"gamma code too long (more than {longest} leading zeros): a value exceeds {limit}")
        ones = ones[:count]
        n = np.empty(count, dtype=np.int64)
        n[0] = ones[0]
        np.subtract(ones[1:], ones[:-1], out=n[1:])
        n[1:] -= 1
        if n.max() > longest:
            raise CodecError(f"gamma code too long ({n.max()} leading zeros): value exceeds {limit}")
        self._pos += int(ones[-1]) + 1
        x = (np.int64(1) << n) + self.low_bits(n)
        if x.max() > limit:
            raise CodecError(f"gamma-coded value {x.max()} exceeds its bound {limit}")
        return x

    def low_bits(self, n: np.ndarray) -> np.ndarray:
        """Read values of ``n_i`` bits each (most significant first; what :meth:`BitWriter.low_bits` wrote)."""
        end = np.cumsum(n)
        total = int(end[-1]) if end.size else 0
        bits = self.bits(total).astype(np.float64)
        owner = np.repeat(np.arange(n.size), n)
        shift = (end - 1).take(owner)
        shift -= np.arange(total)
        return np.bincount(owner, weights=bits * np.exp2(shift), minlength=n.size).astype(np.int64)

    def finish(self) -> None:
        """Require that only zero padding (< 8 bits) is left."""
        left = self._bits.size - self._pos
        if left >= 8:
            raise CodecError(f"payload has {left // 8} unused trailing bytes")
        if left and self._bits[self._pos :].any():
            raise CodecError("payload padding bits are not zero")
