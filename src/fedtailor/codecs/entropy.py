"""Entropy coding of the LRSUQ indices (K, M) of one release (``docs/codecs.md``).

Two coders, both vectorised over blocks:

* ``elias`` -- universal codes only. ``K`` (one per block) as a gamma group; the blocks whose ``M`` is non-zero
  as a count and gaps (gamma); the coordinates of those blocks as gamma codes of ``zigzag(M) + 1`` (``zigzag(M)``
  for b = 1, where a listed block is non-zero by definition).
* ``ans`` -- an ANS stack coder (``constriction``). ``K`` with its exact law, Geometric(p) truncated at
  ``k_max``. ``M`` per coordinate with a model conditioned on the shared dither ``V_K``: the decoder knows
  how close ``V_K`` lies to the cell boundary, and ``M_i != 0`` needs ``|u_i| >= 2 rho * distance`` on the side
  opposite to ``V_i``. Coordinates are grouped in 24 half-octave buckets of that distance; per bucket the
  symbol ``M_i * side_i`` in {0, +1, -1, escape} is coded with the bucket's exact counts, sent in a header of
  gamma codes (two-pass, semi-static modelling). Escapes (``|M_i| >= 2``) follow as gamma codes.

Every model is built from integers (counts) or from ``p`` by multiplications, so encoder and decoder build
bit-identical models on any IEEE-754 machine.
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from fedtailor.codecs.base import CodecError
from fedtailor.codecs.bits import BitReader, BitWriter, unzigzag, zigzag
from fedtailor.codecs.lattices import Lattice

# A block needs more than k_max iterations with probability (1 - p)^k_max < K_TAIL; decoders reject larger K.
K_TAIL = 1e-30
# |M| above this is refused (keeps zigzag codes below 2^53 and beta * (M + V) exact to 2^-2 of a cell).
MAX_ABS_M = 2**50
N_BUCKETS = 24
_EXPONENT_SHIFT = np.uint64(52)
_FRACTION = np.uint64(2**52 - 1)
_SQRT_TWO_FRACTION = np.array(2 * 0.7071067811865476).view(np.uint64) & _FRACTION  # sqrt(2) = 2 sqrt(1/2) exactly
_ESCAPE = 3
# Symbol of M_i * side_i clipped to [-2, 2] (index + 2): 0 -> 0, +1 -> 1, -1 -> 2, |.| >= 2 -> escape.
_SYMBOL = np.array([_ESCAPE, 2, 0, 1, _ESCAPE], dtype=np.int32)
# M_i * side_i of a symbol (escapes are filled in separately).
_SIGNED = np.array([0, 1, -1, 0], dtype=np.int64)


@dataclass(frozen=True)
class IterationLaw:
    """K ~ Geometric(p) on {1, 2, ...}, truncated at ``k_max`` = min{k : (1 - p)^k < K_TAIL}."""

    p: float

    @cached_property
    def k_max(self) -> int:
        if self.p >= 1.0:
            return 1
        tail, k = 1.0, 0
        while tail >= K_TAIL:
            tail *= 1.0 - self.p
            k += 1
        return k

    @cached_property
    def probabilities(self) -> np.ndarray:
        """P(K = k) for k = 1..k_max, by repeated multiplication (reproducible bit for bit)."""
        out = np.empty(self.k_max)
        mass = self.p
        for i in range(self.k_max):
            out[i] = mass
            mass *= 1.0 - self.p
        return out

    @property
    def coded(self) -> bool:
        """K carries information only when p < 1 (for b = 1 every block is accepted at once)."""
        return self.p < 1.0

    def entropy_bits(self) -> float:
        """H(K) in bits: h(p) / p."""
        if not self.coded:
            return 0.0
        p = self.p
        return float(-(p * np.log2(p) + (1 - p) * np.log2(1 - p)) / p)


DitherLookup = Callable[[np.ndarray], np.ndarray]


class EntropyCoder(ABC):
    """Maps (K (n,), M (n, b), V_K (n, b)) to a payload and back."""

    name: str
    coder_id: int

    def __init__(self, law: IterationLaw, lattice: Lattice) -> None:
        self.law = law
        self.lattice = lattice

    @abstractmethod
    def encode(self, k: np.ndarray, m: np.ndarray, v: np.ndarray) -> bytes:
        """Payload for one release."""

    @abstractmethod
    def decode(self, payload: bytes, n_blocks: int, dithers: DitherLookup) -> tuple[np.ndarray, np.ndarray]:
        """(K, M) from a payload; ``dithers(K)`` regenerates V_K when the model needs it."""


class EliasCoder(EntropyCoder):
    """Universal codes only (no model, no dependency)."""

    name = "elias"
    coder_id = 1

    def encode(self, k: np.ndarray, m: np.ndarray, v: np.ndarray) -> bytes:
        w = BitWriter()
        if self.law.coded:
            w.gamma(k)
        nonzero = np.flatnonzero((m != 0) @ np.ones(m.shape[1], dtype=bool))  # rows with a non-zero M (logical or)
        w.gamma(np.array([nonzero.size + 1]))
        w.gamma(np.diff(nonzero, prepend=-1))
        z = zigzag(m[nonzero])
        w.gamma(z if m.shape[1] == 1 else z + 1)
        return w.getvalue()

    def decode(self, payload: bytes, n_blocks: int, dithers: DitherLookup) -> tuple[np.ndarray, np.ndarray]:
        b = self.lattice.b
        r = BitReader(payload)
        k = r.gamma(n_blocks, limit=self.law.k_max) if self.law.coded else np.ones(n_blocks, dtype=np.int64)
        count = int(r.gamma(1, limit=n_blocks + 1)[0]) - 1
        rows = np.cumsum(r.gamma(count, limit=n_blocks)) - 1
        if count and rows[-1] >= n_blocks:
            raise CodecError(f"payload lists a non-zero block {rows[-1]} beyond the {n_blocks} blocks")
        z = r.gamma(count * b, limit=2 * MAX_ABS_M + 1)
        r.finish()
        m = np.zeros((n_blocks, b), dtype=np.int64)
        vals = unzigzag(z if b == 1 else z - 1).reshape(count, b)
        if b > 1 and count and not np.all(np.any(vals != 0, axis=1)):
            raise CodecError("payload lists an all-zero block as non-zero (not a canonical message)")
        m[rows] = vals
        return k, m


def boundary_buckets(delta: np.ndarray) -> np.ndarray:
    """Half-octave bucket of a boundary distance in [0, 1/2]: 0 for [2^-1.5, 1/2], 1 for [2^-2, 2^-1.5), ...

    With ``frexp(delta) = (mant, exp)``: ``q = 2 (-1 - exp) + [mant < sqrt(1/2)]``, clipped to [0, 23]; 0 (and any
    subnormal) in the last bucket. Read off the float64's bits (``exp = E - 1022`` for the biased exponent E, and
    ``mant < sqrt(1/2)`` iff the 52 fraction bits are below those of sqrt(2)): integer operations only, so it is
    exact on every machine.
    """
    bits = np.ascontiguousarray(delta, dtype=np.float64).view(np.uint64)
    q = (bits >> _EXPONENT_SHIFT).view(np.int64) * -2
    q += 2042
    q += (bits & _FRACTION) < _SQRT_TWO_FRACTION
    return np.clip(q, 0, N_BUCKETS - 1, out=q)


def _ans():
    try:
        import constriction
    except ImportError as err:  # pragma: no cover - exercised only without the optional dependency
        raise ImportError(
            "coder='ans' needs the 'constriction' package: pip install 'fedtailor[codecs]' (or use coder='elias')"
        ) from err
    return constriction


class AnsCoder(EntropyCoder):
    """ANS with the exact law of K and boundary-conditioned, count-based models for M (module docstring)."""

    name = "ans"
    coder_id = 2

    def __init__(self, law: IterationLaw, lattice: Lattice) -> None:
        super().__init__(law, lattice)
        self._c = _ans()
        self._k_model = self._c.stream.model.Categorical(law.probabilities, perfect=False) if law.coded else None

    def __reduce__(self) -> tuple[type[AnsCoder], tuple[IterationLaw, Lattice]]:
        return type(self), (self.law, self.lattice)  # rebuilt from its law: constriction's models do not pickle

    def _models(self, counts: np.ndarray) -> list[object | None]:
        """Per bucket: the model of its symbols from their counts; None when it holds at most one symbol (no bits)."""
        live = np.count_nonzero(counts, axis=1)
        probabilities = counts.astype(np.float64)
        categorical = self._c.stream.model.Categorical
        return [categorical(probabilities[q], perfect=False) if live[q] > 1 else None for q in range(N_BUCKETS)]

    def _ans_words(
        self, k: np.ndarray, sym_by_bucket: np.ndarray, bounds: np.ndarray, models: list[object | None]
    ) -> np.ndarray:
        """ANS words: K first to decode, then bucket 0, 1, ... (pushed in reverse: ANS is a stack)."""
        coder = self._c.stream.stack.AnsCoder()
        for q in range(N_BUCKETS - 1, -1, -1):
            if models[q] is not None:
                coder.encode_reverse(sym_by_bucket[bounds[q] : bounds[q + 1]], models[q])
        if self.law.coded:
            coder.encode_reverse((k - 1).astype(np.int32), self._k_model)
        return coder.get_compressed()

    @staticmethod
    def _group(bucket: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Coordinates sorted by bucket (stable: coordinate order within a bucket), bucket sizes and bounds."""
        order = np.argsort(bucket.astype(np.uint8), kind="stable")  # radix sort for 8-bit keys
        sizes = np.bincount(bucket, minlength=N_BUCKETS)
        return order, sizes, np.concatenate([[0], np.cumsum(sizes)])

    def encode(self, k: np.ndarray, m: np.ndarray, v: np.ndarray) -> bytes:
        delta, side = self.lattice.boundary_context(v)
        bucket = boundary_buckets(delta).ravel()
        s = (m * side).ravel()
        sym = _SYMBOL.take(np.clip(s, -2, 2, out=s) + 2)
        order, _, bounds = self._group(bucket)
        counts = np.bincount(bucket * 4 + sym, minlength=4 * N_BUCKETS).reshape(N_BUCKETS, 4)
        w = BitWriter()
        w.gamma(counts[:, 1:].ravel() + 1)
        w.gamma(zigzag(m.ravel()[sym == _ESCAPE]) - 2)
        bits = w.getvalue()
        words = self._ans_words(k, sym.take(order), bounds, self._models(counts))
        return struct.pack("<I", len(bits)) + bits + words.astype("<u4").tobytes()

    def decode(self, payload: bytes, n_blocks: int, dithers: DitherLookup) -> tuple[np.ndarray, np.ndarray]:
        b = self.lattice.b
        n = n_blocks * b
        if len(payload) < 4:
            raise CodecError("payload truncated: missing the length of its bit section")
        (nbytes,) = struct.unpack_from("<I", payload)
        if 4 + nbytes > len(payload) or (len(payload) - 4 - nbytes) % 4:
            raise CodecError("payload malformed: bit section length does not leave whole 32-bit ANS words")
        r = BitReader(payload[4 : 4 + nbytes])
        counts = np.zeros((N_BUCKETS, 4), dtype=np.int64)
        counts[:, 1:] = (r.gamma(3 * N_BUCKETS, limit=n + 1) - 1).reshape(N_BUCKETS, 3)
        escapes = unzigzag(r.gamma(int(counts[:, _ESCAPE].sum()), limit=2 * MAX_ABS_M) + 2)
        r.finish()
        words = np.frombuffer(payload[4 + nbytes :], dtype="<u4").astype(np.uint32)
        try:
            coder = self._c.stream.stack.AnsCoder(words)
            if self.law.coded:
                k = coder.decode(self._k_model, n_blocks).astype(np.int64) + 1
            else:
                k = np.ones(n_blocks, dtype=np.int64)
        except ValueError as err:
            raise CodecError(f"ANS section invalid: {err}") from err
        delta, side = self.lattice.boundary_context(dithers(k))
        order, sizes, bounds = self._group(boundary_buckets(delta).ravel())
        counts[:, 0] = sizes - counts[:, 1:].sum(axis=1)
        if np.any(counts[:, 0] < 0):
            raise CodecError("payload malformed: symbol counts exceed the coordinates of their bucket")
        models = self._models(counts)
        only = (counts > 0).argmax(axis=1)  # the symbol of a bucket without a model (if it has coordinates)
        sym_by_bucket = np.empty(n, dtype=np.int32)
        for q in range(N_BUCKETS):
            part = sym_by_bucket[bounds[q] : bounds[q + 1]]
            if models[q] is not None:
                part[:] = coder.decode(models[q], part.size)
            else:
                part[:] = only[q]
        bucket_of = np.repeat(np.arange(0, 4 * N_BUCKETS, 4), sizes)
        if not np.array_equal(np.bincount(bucket_of + sym_by_bucket, minlength=4 * N_BUCKETS), counts.ravel()):
            raise CodecError("payload corrupted: decoded symbols disagree with the announced counts")
        if not coder.is_empty():
            raise CodecError("payload corrupted: ANS data left over after the last symbol")
        # Canonical form: the ANS words must be exactly what the encoder writes for these symbols.
        if not np.array_equal(self._ans_words(k, sym_by_bucket, bounds, models), words):
            raise CodecError("payload is not in canonical form (ANS words differ from a fresh encoding)")
        sym = np.empty(n, dtype=np.int32)
        sym[order] = sym_by_bucket
        m = _SIGNED.take(sym)
        m *= side.ravel()
        m[sym == _ESCAPE] = escapes
        return k, m.reshape(n_blocks, b)


def make_coder(name: str, law: IterationLaw, lattice: Lattice) -> EntropyCoder:
    """``"elias"`` or ``"ans"``."""
    if name == "elias":
        return EliasCoder(law, lattice)
    if name == "ans":
        return AnsCoder(law, lattice)
    raise ValueError(f"unknown coder {name!r}; use 'elias' (universal codes) or 'ans' (needs constriction)")
