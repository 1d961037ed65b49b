"""LRSUQ: the Gaussian mechanism realised exactly by layered rejection-sampled universal quantisation.

As in *Privacy-Aligned Personalized Federated Learning with Compact Adaptation and Variable-Length Gaussian
Communication* (its section on communication, refs [8, 16]; see ``docs/codecs.md``). Per block ``u`` in R^b:

1. Layer: ``rho = sigma * chi_{b+2}`` from the shared randomness. A point uniform in the ball ``B(0, rho)``
   with this radius law is exactly ``N(0, sigma^2 I_b)``.
2. Rejection-sampled universal quantiser of ``Uniform(B(0, rho))`` on a lattice scaled by ``beta`` with
   ``beta V0`` containing the ball (``beta = 2 rho`` on Z^b, ``sqrt(2) rho`` on D4): shared dithers
   ``V_1, V_2, ...`` uniform on the cell; for j = 1, 2, ...: ``M_j = Q(u/beta - V_j)``,
   ``E_j = beta (M_j + V_j) - u``; stop at the first ``||E_j|| <= rho`` and send ``(K = j, M = M_j)``.
3. Decoder: ``y = beta (M + V_K) = u + E`` with ``E ~ N(0, sigma^2 I_b)`` exactly, independent of ``u``;
   ``K ~ Geometric(p)``, ``p = vol(B_b) / vol(cell)`` (0.308 on Z^4, 0.617 on D4, 1 for b = 1).

Shared randomness of a release with key ``key`` (SHAKE-256 streams of :func:`fedtailor.privacy.noise.stream_words`,
nothing global; ``K_p = derive_key(key, "lrsuq", p)``):

* radius: words of the stream ``(K_radius)``, ``(b + 2) // 2`` per block (two more for odd b), block-major;
  ``chi^2_{b+2} = -2 ln(U_1 ... U_m) [+ Z^2]``, ``U = (w >> 12 + 1/2) 2^-52`` in (0, 1).
* dithers of iteration j: the stream ``(K_dither, j)``; its words ``r b .. r b + b - 1`` belong to the r-th
  block (in block order) still unaccepted before iteration j.
  The encoder draws one array per iteration for all unaccepted blocks; the decoder, knowing every K, knows
  the unaccepted sets too and regenerates only V_K of each block (iterations 1..max K, one array each).

All loops run over iterations, never over blocks.
"""

from __future__ import annotations

import hashlib
import math
import numbers

import numpy as np

from fedtailor.codecs.base import Codec, CodecError, check_dim, check_input, check_key, check_sigma
from fedtailor.codecs.entropy import MAX_ABS_M, IterationLaw, make_coder
from fedtailor.codecs.format import Frame, open_message, seal
from fedtailor.codecs.lattices import Lattice, make_lattice
from fedtailor.privacy.noise import KEY_BITS, open_unit, stream_words
from fedtailor.rng import derive_key

CODEC_ID = 3
MAX_BLOCK = 8


class IterationStream:
    """The dither stream of one release: iteration j reads the SHAKE-256 stream ``(key, j)`` (any order).

    The words are those of ``stream_words(key, iteration, count=count)``; the key's bytes are encoded once per
    release instead of once per iteration (about 50 streams a release)."""

    def __init__(self, key: int) -> None:
        self._key = key
        self._prefix = check_key(key).to_bytes(KEY_BITS // 8, "little")

    def words(self, iteration: int, count: int) -> np.ndarray:
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        raw = str(int(iteration)).encode()  # the length-prefixed int label of stream_words
        seed = self._prefix + len(raw).to_bytes(8, "little") + raw
        return np.frombuffer(hashlib.shake_256(seed).digest(8 * count), dtype="<u8")


def chi_square_from_words(words: np.ndarray, dof: int) -> np.ndarray:
    """chi^2_dof per row of ``words`` (shape (n, dof // 2 + 2 * (dof % 2))): sums of Exp(1/2) and one Z^2."""
    half = dof // 2
    u = open_unit(words)
    out = np.zeros(u.shape[0])
    if half:
        prod = u[:, 0].copy()
        for c in range(1, half):  # column products: much faster than np.prod over a short axis
            prod *= u[:, c]
        out -= 2.0 * np.log(prod)
    if dof % 2:
        out += -2.0 * np.log(u[:, half]) * np.cos(2.0 * math.pi * u[:, half + 1]) ** 2
    return out


class LRSUQCodec(Codec):
    """Exact Gaussian release by LRSUQ on Z^b (b = 1..8) or D4, with an Elias or ANS coder."""

    codec_id = CODEC_ID

    def __init__(
        self, *, block_size: int = 4, lattice: str = "Z", coder: str = "elias", name: str | None = None
    ) -> None:
        valid = isinstance(block_size, numbers.Integral) and not isinstance(block_size, bool)
        if not valid or not 1 <= block_size <= MAX_BLOCK:
            raise ValueError(f"block_size must be an int in [1, {MAX_BLOCK}], got {block_size!r}")
        self.block_size = int(block_size)
        self.lattice: Lattice = make_lattice(lattice, self.block_size)
        self.law = IterationLaw(self.lattice.accept_prob)
        self.coder = make_coder(coder, self.law, self.lattice)
        self.frame = Frame(CODEC_ID, self.lattice.lattice_id, self.coder.coder_id, self.block_size)
        self.name = name or ("layered" if self.block_size == 1 else "lrsuq")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, block_size={self.block_size}, "
            f"lattice={self.lattice.name!r}, coder={self.coder.name!r})"
        )

    # --- shared randomness -------------------------------------------------------------------------------
    def stream_key(self, key: int, purpose: str) -> int:
        """Key of one stream of a release (``purpose`` = "radius" or "dither")."""
        return derive_key(key, "lrsuq", purpose)

    def radius_dof(self) -> int:
        """Degrees of freedom of the layer radius: rho / sigma ~ chi_{b+2}."""
        return self.block_size + 2

    def radius(self, key: int, sigma: float, n_blocks: int) -> np.ndarray:
        """The layer radius rho of every block (step 1 of the module docstring)."""
        dof = self.radius_dof()
        per_block = dof // 2 + 2 * (dof % 2)
        words = stream_words(self.stream_key(key, "radius"), count=n_blocks * per_block).reshape(n_blocks, per_block)
        return sigma * np.sqrt(chi_square_from_words(words, dof))

    def decoder_radius(self, key: int, sigma: float, n_blocks: int) -> np.ndarray:
        """The radius as the decoder regenerates it (the same stream as the encoder's)."""
        return self.radius(key, sigma, n_blocks)

    def cell_scale(self) -> float:
        """beta / rho."""
        return self.lattice.cell_scale

    def dither_stream(self, key: int) -> IterationStream:
        """The dither stream of a release, keyed by ``stream_key(key, "dither")``."""
        return IterationStream(self.stream_key(key, "dither"))

    def dither_words(self, stream: IterationStream, iteration: int, n_active: int) -> np.ndarray:
        """Raw words of iteration ``iteration`` for the ``n_active`` blocks still unaccepted, shape (n_active, b)."""
        b = self.block_size
        return stream.words(iteration, n_active * b).reshape(n_active, b)

    def candidate_error(self, m: np.ndarray, v: np.ndarray, x: np.ndarray) -> np.ndarray:
        """E_j / beta = (M_j + V_j) - u / beta, what the acceptance test looks at (step 2).

        Accepting ``||E_j|| <= rho`` is accepting ``||E_j / beta|| <= 1 / cell_scale``: no per-block scale in the loop.
        """
        return m + v - x

    def decoder_iteration(self, k: np.ndarray) -> np.ndarray:
        """Which iteration's dither the decoder uses for each block: K."""
        return k

    # --- the mechanism on blocks ---------------------------------------------------------------------------
    def encode_blocks(self, ub: np.ndarray, *, key: int, sigma: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(K, M, V_K) for the blocks ``ub`` (shape (n, b)); vectorised over the unaccepted blocks.

        Each iteration works on the still unaccepted blocks only; the accepted ones are kept as (rows, M, V)
        pieces and put in block order once at the end (one gather per array, no scatter per iteration)."""
        n, b = ub.shape
        x = ub / (self.radius(key, sigma, n) * self.cell_scale())[:, None]
        if np.max(np.abs(x)) >= MAX_ABS_M:
            raise CodecError("input too large relative to the layer radius: lattice index beyond 2^50")
        bound = 1.0 / self.cell_scale() ** 2
        ones = np.ones(b)
        index = np.arange(n)
        rows, ms, vs, counts, iters = [], [], [], [], []
        stream = self.dither_stream(key)
        for j in range(1, self.law.k_max + 1):
            v = self.lattice.dither(self.dither_words(stream, j, index.size))
            t = np.subtract(x, v)
            m = self.lattice.quantize(t)
            e = self.candidate_error(m, v, x)
            np.multiply(e, e, out=e)
            ok = e @ ones <= bound
            accepted = np.count_nonzero(ok)
            if accepted == index.size:  # the last iteration (and most of the tail): no compress
                rows.append(index)
                ms.append(m)
                vs.append(v)
                counts.append(accepted)
                iters.append(j)
                order = np.empty(n, dtype=np.int64)  # order[block] = its position among the pieces
                order[np.concatenate(rows)] = np.arange(n)
                k = np.repeat(iters, counts)[order]
                return (
                    k,
                    np.concatenate(ms).astype(np.int64).take(order, axis=0),
                    np.concatenate(vs).take(order, axis=0),
                )
            if accepted:
                # np.compress is several times faster than boolean indexing on (n, b) arrays.
                rows.append(index.compress(ok))
                ms.append(m.compress(ok, axis=0))
                vs.append(v.compress(ok, axis=0))
                counts.append(accepted)
                iters.append(j)
                keep = ~ok
                index, x = index.compress(keep), x.compress(keep, axis=0)
        raise CodecError(
            f"{index.size} block(s) unaccepted after k_max = {self.law.k_max} iterations (probability < 1e-30 "
            "per block): check that the lattice cell contains the ball"
        )

    def dithers_at(self, key: int, k: np.ndarray, iteration: np.ndarray) -> np.ndarray:
        """V at ``iteration[i]`` for every block i, given the iteration counts K (which fix the active sets).

        Iteration j's words go, b at a time, to the blocks with K >= j in block order (all blocks for j <= 1).
        The wanted words of every iteration are gathered first and turned into dithers in one call.
        """
        n, b = k.size, self.block_size
        if n == 0:
            return np.empty((n, b))
        stream = self.dither_stream(key)
        active = np.arange(n)
        targets, pieces = [], []
        for j in range(int(iteration.min()), int(iteration.max()) + 1):
            active = active.compress(k.take(active) >= j)
            want = (iteration.take(active) == j).nonzero()[0]
            if want.size:
                words = self.dither_words(stream, j, int(want[-1]) + 1)
                targets.append(active[want])
                pieces.append(words.take(want, axis=0))
        if not targets:
            return np.empty((n, b))
        rows, words = np.concatenate(targets), np.concatenate(pieces)
        if rows.size < n:  # some block's iteration is beyond its K (a broken variant): its row stays undefined
            v = np.empty((n, b))
            v[rows] = self.lattice.dither(words)
            return v
        order = np.empty(n, dtype=np.int64)
        order[rows] = np.arange(n)
        return self.lattice.dither(words.take(order, axis=0))

    def decoder_dithers(self, key: int, k: np.ndarray) -> np.ndarray:
        """V_K of every block as the decoder regenerates it."""
        return self.dithers_at(key, k, self.decoder_iteration(k))

    def decode_blocks(
        self, k: np.ndarray, m: np.ndarray, *, key: int, sigma: float, v: np.ndarray | None = None
    ) -> np.ndarray:
        """y = beta (M + V_K) for every block (step 3); ``v`` if V_K is already regenerated."""
        if v is None:
            v = self.decoder_dithers(key, k)
        beta = self.decoder_radius(key, sigma, k.size) * self.cell_scale()
        return beta[:, None] * (m + v)

    # --- bytes ---------------------------------------------------------------------------------------------
    def blocks_of(self, dim: int) -> int:
        return -(-dim // self.block_size)

    def encode(self, u: np.ndarray, *, key: int, sigma: float, noise_key: int | None = None) -> bytes:
        """``noise_key`` is ignored: LRSUQ's noise is its quantisation error, a function of the shared key."""
        key, sigma = check_key(key), check_sigma(sigma)
        u = check_input(u, sigma, bound_sigmas=True)
        n = self.blocks_of(u.size)
        ub = np.zeros(n * self.block_size)
        ub[: u.size] = u
        k, m, v = self.encode_blocks(ub.reshape(n, self.block_size), key=key, sigma=sigma)
        return seal(self.frame, dim=u.size, key=key, sigma=sigma, payload=self.coder.encode(k, m, v))

    def decode_indices(
        self, message: bytes, *, key: int, sigma: float, dim: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(K, M, V_K or None) of a message, after every check of the frame and payload.

        V_K comes back when the coder already regenerated it for its model (ANS), so decoding draws it once.
        """
        try:
            key, sigma, dim = check_key(key), check_sigma(sigma), check_dim(dim)
        except (TypeError, ValueError) as err:
            raise CodecError(str(err)) from err
        payload = open_message(message, self.frame, dim=dim, key=key, sigma=sigma)
        drawn: list[np.ndarray] = []

        def lookup(kk: np.ndarray) -> np.ndarray:
            drawn.append(self.decoder_dithers(key, kk))
            return drawn[-1]

        k, m = self.coder.decode(payload, self.blocks_of(dim), lookup)
        if not np.all(self.lattice.contains(m)):
            raise CodecError(f"payload holds an index that is not a point of the {self.lattice.name} lattice")
        return k, m, (drawn[-1] if drawn else None)

    def decode(self, message: bytes, *, key: int, sigma: float, dim: int) -> np.ndarray:
        k, m, v = self.decode_indices(message, key=key, sigma=sigma, dim=dim)
        y = self.decode_blocks(k, m, key=int(key), sigma=float(sigma), v=v)
        return y.ravel()[:dim].copy()
