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

Shared randomness of a release with key ``key``: two ChaCha20 streams (:class:`KeyStream`), each keyed by its own
256-bit ``K_p = derive_key(key, "lrsuq", p)`` (nonce and counter zero; a fresh release key gives fresh keys, and
nothing is global):

* radius, ``K_radius``: ``(b + 2) // 2`` words per block, block-major, ``chi^2_{b+2} = -2 ln(U_1 ... U_m)``; for
  odd b then one Box-Muller pair per two blocks for their ``Z^2`` (:func:`chi_square_from_words`);
  ``U = (w >> 12 + 1/2) 2^-52`` in (0, 1).
* dithers, ``K_dither``: one row of b words per (iteration, unaccepted block), iteration-major: iteration j's rows
  follow those of iterations 1..j-1, one per block still unaccepted before iteration j, in block order.
  The encoder draws the rows of a typical release ahead (``n / p`` plus four standard deviations; more in the
  rare release that needs them) and reads iteration j's as a view; the decoder, knowing every K, knows every
  iteration's unaccepted set, locates each block's V_K row and draws the stream once up to the last of them.

All loops run over iterations, never over blocks.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from fedtailor.codecs.base import Codec, CodecError, check_dim, check_input, check_key, check_sigma
from fedtailor.codecs.entropy import MAX_ABS_M, IterationLaw, make_coder
from fedtailor.codecs.format import Frame, open_message, seal
from fedtailor.codecs.lattices import Lattice, make_lattice
from fedtailor.privacy.noise import KEY_BITS, open_unit
from fedtailor.rng import derive_key

CODEC_ID = 3
MAX_BLOCK = 8


class KeyStream:
    """The ChaCha20 keystream (RFC 8439, OpenSSL through ``cryptography``) of one 256-bit key, read front to back
    as little-endian uint64 words; nonce and block counter start at zero. Each key is used for one stream only."""

    def __init__(self, key: int) -> None:
        self._encryptor = self.cipher(check_key(key).to_bytes(KEY_BITS // 8, "little")).encryptor()
        self._zeros = memoryview(b"")

    @staticmethod
    def cipher(raw_key: bytes) -> Cipher:
        """The stream cipher of a 32-byte key (subclasses choose another, e.g. AES-CTR)."""
        return Cipher(algorithms.ChaCha20(raw_key, bytes(16)), mode=None)

    def words(self, count: int) -> np.ndarray:
        """The next ``count`` words of the stream."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if len(self._zeros) < 8 * count:  # the plaintext: zeros, kept for the next (usually smaller) read
            self._zeros = memoryview(bytes(8 * count))
        return np.frombuffer(self._encryptor.update(self._zeros[: 8 * count]), dtype="<u8")


def radius_words(n: int, dof: int) -> int:
    """Words of the radius stream of ``n`` blocks: ``dof // 2`` per block, then for odd dof one pair per two blocks."""
    return n * (dof // 2) + (dof % 2) * 2 * (-(-n // 2))


def chi_square_from_words(words: np.ndarray, n: int, dof: int) -> np.ndarray:
    """chi^2_dof for each of ``n`` blocks from the ``radius_words(n, dof)`` words of the radius stream.

    The first ``n (dof // 2)`` words, block-major, are ``dof // 2`` uniforms per block: ``-2 ln(U_1 ... U_m)``, a sum
    of m independent chi^2_2 (one log per block). For odd dof the rest are Box-Muller pairs ``(U, U')``, pair i for
    blocks 2i and 2i + 1: with ``R^2 = -2 ln U`` and ``A = (pi / 2) U'``, ``R^2 cos^2 A`` and ``R^2 sin^2 A`` are
    two independent chi^2_1 (only squares are used, so a quarter turn gives their law; one log and one cosine per
    two blocks).
    """
    half = dof // 2
    out = np.zeros(n)
    if half:
        u = open_unit(words[: n * half]).reshape(n, half)
        prod = u[:, 0].copy()
        for c in range(1, half):  # column products: much faster than np.prod over a short axis
            prod *= u[:, c]
        out -= 2.0 * np.log(prod)
    if dof % 2:
        pairs = open_unit(words[n * half :]).reshape(-1, 2)
        r2 = np.log(pairs[:, 0])
        r2 *= -2.0
        cos2 = np.cos((0.5 * math.pi) * pairs[:, 1])
        cos2 *= cos2
        z2 = np.empty(2 * r2.size)
        z2[0::2] = r2 * cos2
        z2[1::2] = r2 - z2[0::2]  # R^2 sin^2 A
        out += z2[:n]
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
        words = KeyStream(self.stream_key(key, "radius")).words(radius_words(n_blocks, dof))
        return sigma * np.sqrt(chi_square_from_words(words, n_blocks, dof))

    def decoder_radius(self, key: int, sigma: float, n_blocks: int) -> np.ndarray:
        """The radius as the decoder regenerates it (the same stream as the encoder's)."""
        return self.radius(key, sigma, n_blocks)

    def cell_scale(self) -> float:
        """beta / rho."""
        return self.lattice.cell_scale

    def dither_stream(self, key: int) -> KeyStream:
        """The dither stream of a release, keyed by ``stream_key(key, "dither")``."""
        return KeyStream(self.stream_key(key, "dither"))

    def candidate_error(self, m: np.ndarray, v: np.ndarray, x: np.ndarray) -> np.ndarray:
        """E_j / beta = (M_j + V_j) - u / beta, what the acceptance test looks at (step 2).

        Accepting ``||E_j|| <= rho`` is accepting ``||E_j / beta|| <= 1 / cell_scale``: no per-block scale in the loop.
        """
        out = m + v
        out -= x
        return out

    def decoder_iteration(self, k: np.ndarray) -> np.ndarray:
        """Which iteration's dither the decoder uses for each block: K."""
        return k

    # --- the mechanism on blocks ---------------------------------------------------------------------------
    def encode_blocks(self, ub: np.ndarray, *, key: int, sigma: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(K, M, V_K) for the blocks ``ub`` (shape (n, b)); vectorised over the unaccepted blocks.

        The dithers are drawn ahead, enough for a typical release at once: iteration j's are then a view of the
        next rows. Each iteration works on the still unaccepted blocks only and keeps its (blocks, accepted, M);
        the accepted rows are put in block order once at the end (one gather per array)."""
        n, b = ub.shape
        x = ub / (self.radius(key, sigma, n) * self.cell_scale())[:, None]
        if np.max(np.abs(x)) >= MAX_ABS_M:
            raise CodecError("input too large relative to the layer radius: lattice index beyond 2^50")
        bound = 1.0 / self.cell_scale() ** 2
        ones = np.ones(b)
        stream = self.dither_stream(key)
        dithers = self.draw_dithers(stream, self.rows_ahead(n))
        index, used = np.arange(n), 0
        actives, rejected, ms = [], [], []
        for _ in range(self.law.k_max):
            missing = used + index.size - dithers.shape[0]
            if missing > 0:  # rare: a release that needs more rows than drawn ahead
                more = self.draw_dithers(stream, max(missing, self.rows_ahead(index.size)))
                dithers = np.concatenate([dithers, more])
            v = dithers[used : used + index.size]
            used += index.size
            m = self.lattice.quantize(x - v)
            e = self.candidate_error(m, v, x)
            np.multiply(e, e, out=e)
            rejected.append(e @ ones > bound)
            actives.append(index)
            ms.append(m)
            keep = rejected[-1].nonzero()[0]  # nonzero + take: faster than boolean indexing or compress here
            index, x = index.take(keep), x.take(keep, axis=0)
            if not index.size:
                accepted = np.flatnonzero(~np.concatenate(rejected))  # stream rows of the accepted dithers
                order = np.empty(n, dtype=np.int64)  # order[block] = its accepted row's rank
                order[np.concatenate(actives).take(accepted)] = np.arange(n)
                rows = accepted.take(order)
                k = np.repeat(np.arange(1, len(ms) + 1), [a.size for a in actives]).take(rows)
                return k, np.concatenate(ms).take(rows, axis=0).astype(np.int64), dithers.take(rows, axis=0)
        raise CodecError(
            f"{index.size} block(s) unaccepted after k_max = {self.law.k_max} iterations (probability < 1e-30 "
            "per block): check that the lattice cell contains the ball"
        )

    def rows_ahead(self, n_active: int) -> int:
        """Dither rows the encoder draws at once for ``n_active`` unaccepted blocks: their expected sum of K,
        ``n_active / p``, plus four standard deviations (more are drawn in the rare release that needs them)."""
        p = self.law.p
        return math.ceil((n_active + 4.0 * math.sqrt(n_active * (1.0 - p))) / p)

    def draw_dithers(self, stream: KeyStream, rows: int) -> np.ndarray:
        """The next ``rows`` dithers of the stream (b words each)."""
        return self.lattice.dither(stream.words(rows * self.block_size).reshape(rows, self.block_size))

    def dithers_at(self, key: int, k: np.ndarray, iteration: np.ndarray) -> np.ndarray:
        """V at ``iteration[i]`` (in [1, K_i]) for every block i, given the iteration counts K.

        Iteration j's dithers follow those of iterations 1..j-1 in the stream and go, one row of b words each, to
        the blocks with K >= j in block order. Each wanted block's row is located iteration by iteration; the
        stream up to the last wanted row is drawn in one call and the wanted rows are gathered once.
        """
        n, b = k.size, self.block_size
        if np.any(iteration < 1) or np.any(iteration > k):
            raise ValueError("a block's dither iteration must lie in [1, K]")
        row = np.empty(n, dtype=np.int64)  # each block's row in the stream
        active, k_active, it_active = np.arange(n), k, iteration
        offset = 0
        for j in range(1, int(iteration.max(initial=0)) + 1):
            want = (it_active == j).nonzero()[0]  # ranks among the blocks active in iteration j
            row[active.take(want)] = want + offset
            offset += active.size
            keep = (k_active > j).nonzero()[0]
            active, k_active, it_active = active.take(keep), k_active.take(keep), it_active.take(keep)
        words = self.dither_stream(key).words(b * (int(row.max(initial=-1)) + 1)).reshape(-1, b)
        return self.lattice.dither(words.take(row, axis=0))

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
