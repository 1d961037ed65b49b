"""PPR: the Gaussian mechanism realised exactly by the Poisson private representation, on rotated blocks.

As in *Universal Exact Compression of Differentially Private Mechanisms* (Liu, Chen, Ozgur, Li, NeurIPS 2024,
arXiv:2405.20782), built on the Poisson functional representation (Li & El Gamal 2018). Notation
(``docs/codecs.md``, "PPR"):

* ``u`` in R^k is rotated by a shared random orthonormal ``R`` (random signs and two overlapping normalised
  Walsh-Hadamard transforms, from the release key) and cut into ``n`` blocks ``x`` of ``b`` coordinates (the last
  padded with zeros). Each block's release is one sample ``z ~ P = N(x, sigma^2 I_b)``; the decoder outputs
  ``R^T z``, i.e. ``u + N(0, sigma^2 I_k)`` exactly (rotation invariance), and drops the padding.
* Proposal ``Q = N(0, tau^2 I_b)``, ``tau^2 = sigma^2 + spread * clip^2 / k``: public (sigma, the clip C, k);
  the density ratio ``r(z) = dP/dQ(z)`` is bounded by ``r* = (tau / sigma)^b exp(|x|^2 / (2 (tau^2 - sigma^2)))``.
* Shared randomness: candidates ``Z_1, Z_2, ... ~ Q`` i.i.d. per block (``Z_i = tau g_i``, ``g_i`` standard
  normals from Box-Muller pairs of 52-bit uniforms). The words of candidate ``i`` of block ``j`` are AES-256 (a
  pseudorandom permutation, keyed per release) of the inputs ``(j, (i - 1) w/2 + q)``, ``q < w/2``
  (``w = 2 ceil(b/2)`` words a candidate): counter mode with a counter per candidate, so any set of candidates is
  one ECB call (:meth:`PPRCodec.shared_words`; AES instructions make it about 2.5x ChaCha20's speed here).
* Private randomness (the encoder's alone: ``noise_key`` in secure mode): a Poisson process ``T_1 < T_2 < ...``
  of rate 1 and marks ``V_i ~ Exp(1)``.
* Selection (the paper's Algorithm 1): ``K = argmin_i (T_i / r(Z_i))^alpha V_i``. Since ``{T_i / r(Z_i)}`` with
  marks ``Z_i`` is a rate-1 Poisson process with i.i.d. marks ``~ P`` (mapping theorem), and the rule looks at
  the ``T_i / r(Z_i)`` only through exponential races, ``Z_K ~ P`` exactly; and
  ``P(K = k | Z, T) = (r(Z_k) / T_k)^alpha / sum_i (r(Z_i) / T_i)^alpha``, so a decoder holding the shared
  randomness sees an index that is ``2 alpha eps``-DP whenever the simulated mechanism is ``eps``-DP (the
  paper's theorem; ``alpha = inf`` is the plain PFR argmin, with no such guarantee). The message is ``K`` per
  block, coded by :mod:`fedtailor.codecs.index_code` (``coder``: the exponent of ``K`` by adaptive ANS and its low
  bits raw, the default; or Elias-gamma).

Search, exact and vectorised over blocks. Completing the square, ``log r(tau g) = log r* - beta |g - mu|^2``
(:class:`_Target`): only candidates in a ball around ``mu`` can win. Labels are drawn in T order, a chunk a round
(the first 8 for every block, then as many as half the unfinished blocks still need at their current best, at most
doubling). A candidate can beat its block's best ``s*`` only if ``beta |g - mu|^2 < budget = log r* - log T +
(s* - log V) / alpha`` (``s*`` unset: every candidate is formed); its Box-Muller pairs are formed one at a time,
largest ``|mu_p|`` first, and it is dropped as soon as the partial distance exceeds the budget (each pair's term
is >= 0), so most candidates cost their private draws and one pair. A block stops once the points still able to
beat its best are few: points beyond ``T_N`` can only win if ``V < c T^-alpha``, ``c = exp(s* + alpha log r*)``,
an expected ``m <= c T_N^(1 - alpha) / (alpha - 1)`` of them. The block then draws exactly those points (a thinned
Poisson process, by rejection from the Pareto envelope) with their labels (the count of all points before them:
Poisson with the integral of ``exp(-c s^-alpha)``) and scores them too: no point that could win is ever skipped.
With ``alpha = inf`` the stop is deterministic (``T_N >= exp(s* + log r*)``). A block that would need more than
``MAX_LABELS`` labels is refused with :class:`CodecError`, never answered approximately.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import TypeVar

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes
from scipy import special

from fedtailor.codecs.base import Codec, CodecError, check_dim, check_input, check_key, check_sigma
from fedtailor.codecs.format import CODER_NAMES, Frame, open_message, seal
from fedtailor.codecs.index_code import CODERS, decode_indices, encode_indices
from fedtailor.codecs.lrsuq import KeyStream
from fedtailor.privacy.noise import KEY_BITS, open_unit
from fedtailor.rng import derive_key

Array = TypeVar("Array", np.ndarray, torch.Tensor)

CODEC_ID = 4
MAX_BLOCK = 32
#: Bounds on the candidates every block scores in the search's first round.
FIRST_MIN, FIRST_MAX = 8, 256
#: A block stops searching when at most this many points are expected to be still able to win.
STOP_MASS = 0.01
#: Largest label a block may use.
MAX_LABELS = 2**26
#: Labels that share one bound in the search's first test (alpha finite).
GROUP = 8


class AesStream(KeyStream):
    """The AES-256-CTR keystream of one 256-bit key (counter from zero), read as :class:`KeyStream` reads
    ChaCha20's: a cryptographically secure stream (NIST's CTR_DRBG is built on it) at AES-instruction speed."""

    @staticmethod
    def cipher(raw_key: bytes) -> Cipher:
        return Cipher(algorithms.AES(raw_key), modes.CTR(bytes(16)))


@functools.lru_cache(maxsize=16)
def _hadamard(n: int) -> np.ndarray:
    """The Sylvester Hadamard matrix of order n (a power of two), entries +-1, read-only."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    h.setflags(write=False)
    return h


def fwht(x: np.ndarray) -> np.ndarray:
    """The normalised Walsh-Hadamard transform of the last axis (length ``n``, a power of two), in a new array.

    Orthonormal and its own inverse: ``fwht(fwht(x)) == x`` up to rounding. As three small matrix products:
    ``H_n = H_a kron H_b kron H_c`` for ``n = a b c`` (Sylvester), each factor applied along one axis of the
    ``a x b x c`` reshaping of ``x`` (about 50 microseconds at n = 16,384: a third of two factors' cost, and
    far below the butterflies' in numpy)."""
    n = x.shape[-1]
    levels = n.bit_length() - 1
    a, b = 1 << levels // 3, 1 << (levels - levels // 3) // 2
    c, lead = n // (a * b), x.shape[:-1]
    out = _hadamard(a) @ np.asarray(x, dtype=np.float64).reshape(*lead, a, b * c)
    out = np.matmul(_hadamard(b), out.reshape(*lead, a, b, c))
    out = out.reshape(*lead, a * b, c) @ _hadamard(c)
    out *= 1.0 / math.sqrt(n)
    return out.reshape(x.shape)


class SharedRotation:
    """``R = H_tail D_2 H_head D_1``: random signs ``D``, normalised Hadamard ``H`` on the leading and on the
    trailing ``2^floor(log2 k)`` coordinates (together they cover all ``k`` and mix every pair); orthonormal."""

    def __init__(self, key: int, dim: int) -> None:
        """``key``: the rotation's own stream key (``PPRCodec.stream_key(release_key, "rotation")``)."""
        self.size = 1 << (dim.bit_length() - 1)
        bits = AesStream(key).words(-(-2 * dim // 64))
        signs = np.unpackbits(bits.view(np.uint8), bitorder="little")[: 2 * dim].astype(np.float64)
        self.signs = (1.0 - 2.0 * signs).reshape(2, dim)

    def forward(self, u: np.ndarray) -> np.ndarray:
        x = u * self.signs[0]
        x[: self.size] = fwht(x[: self.size])
        x *= self.signs[1]
        x[-self.size :] = fwht(x[-self.size :])
        return x

    def inverse(self, y: np.ndarray) -> np.ndarray:
        x = y.copy()
        x[-self.size :] = fwht(x[-self.size :])
        x *= self.signs[1]
        x[: self.size] = fwht(x[: self.size])
        x *= self.signs[0]
        return x


def _ecb(cipher: CipherContext, counters: np.ndarray) -> np.ndarray:
    """The words of ``cipher`` applied to the 16-byte rows of ``counters`` (written straight into a new array:
    far cheaper here than the bytes object ``update`` allocates)."""
    out = np.empty(counters.size + 2, dtype="<u8")  # update_into wants a block of slack
    if counters.size:
        cipher.update_into(memoryview(counters).cast("B"), memoryview(out).cast("B"))
    return out[: counters.size]


def normals_from_words(words: np.ndarray, b: int) -> np.ndarray:
    """Standard normals ``(..., b)`` from rows of ``2 ceil(b / 2)`` words (pairs of 52-bit uniforms ``U, U'``):
    Box-Muller, ``R = sqrt(-2 ln U)``, ``A = 2 pi U'``, normals ``R cos A`` and ``R sin A`` (float64 torch: SLEEF's
    vectorised log and trig, about 2.5x numpy's)."""
    u = torch.from_numpy(open_unit(words))
    u = u.view(*u.shape[:-1], -1, 2)
    radius = u[..., 0].log().mul_(-2.0).sqrt_()
    angle = u[..., 1].mul(2.0 * math.pi)
    g = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=-1)
    return g.reshape(*radius.shape[:-1], -1)[..., :b].numpy()


def poisson_ppf(q: float, mean: float) -> int:
    """The smallest ``n`` with ``P(N <= n) >= q`` for ``N ~ Poisson(mean)``: scipy's ``poisson.ppf`` computed as it
    computes it (``pdtrik``, then one step down where ``pdtr`` allows), without its per-call dispatch."""
    n = math.ceil(special.pdtrik(q, mean))
    below = max(n - 1, 0)
    return below if special.pdtr(below, mean) >= q else n


_NODES, _WEIGHTS = np.polynomial.legendre.leggauss(12)


def unable_mass(lo: float, hi: float, c: float, alpha: float) -> float:
    """``int_lo^hi exp(-c s^-alpha) ds``: the expected number of points of a rate-1 process in ``(lo, hi]`` whose
    ``V ~ Exp(1)`` is not below ``c s^-alpha``. A short interval (``hi - lo < lo / 20``): 12-point Gauss-Legendre
    on the smooth integrand; a long one in closed form: with ``w = c s^-alpha``, integrating by parts,
    ``[s e^-w]_lo^hi - c^(1/alpha) Gamma(1 - 1/alpha) (Q(1 - 1/alpha, w_hi) - Q(1 - 1/alpha, w_lo))``
    (``Q`` the regularised upper incomplete gamma function), which cancels badly on short ones. Within 1e-10
    relative of adaptive quadrature (``ppr_test.py``)."""
    if hi - lo < lo / 20:
        s = 0.5 * (hi + lo) + 0.5 * (hi - lo) * _NODES
        return 0.5 * (hi - lo) * float(_WEIGHTS @ np.exp(-c * s**-alpha))
    shape = 1.0 - 1.0 / alpha
    w_lo, w_hi = c * lo**-alpha, c * hi**-alpha
    gap = special.gammaincc(shape, w_hi) - special.gammaincc(shape, w_lo)
    return hi * math.exp(-w_hi) - lo * math.exp(-w_lo) - c ** (1.0 / alpha) * special.gamma(shape) * gap


class PPRCodec(Codec):
    """Exact Gaussian release by PPR on blocks of ``block_size`` rotated coordinates, K coded by ``coder``.

    ``alpha`` (> 1, or ``math.inf``): the PPR parameter (privacy of the index against the decoder: ``2 alpha eps``
    for an ``eps``-DP mechanism; larger alpha, shorter search). ``clip``: the public bound on ``||u||`` the proposal
    is built for; ``spread``: the proposal's extra variance in units of ``clip^2 / k``; ``coder``: the index code,
    ``"ans"`` (default) or ``"elias"`` (:mod:`fedtailor.codecs.index_code`). Inputs above the clip are
    released exactly too, at a search cost that grows like ``exp(|x|^2 / (2 spread clip^2 / k))`` per block.
    """

    codec_id = CODEC_ID
    #: The decoder needs none of the private randomness, but its shared candidates with the index reveal more than
    #: the release ``y = Z_K`` (the index law depends on u through every candidate): the central eps does not hold
    #: against it; the index is ``2 alpha eps``-DP against it for an ``eps``-DP mechanism (module docstring).
    private_noise = False

    def __init__(
        self,
        *,
        block_size: int = 4,
        alpha: float = 8.0,
        clip: float = 1.0,
        spread: float = 2.5,
        coder: str = "ans",
        name: str = "ppr",
    ) -> None:
        valid = isinstance(block_size, numbers.Integral) and not isinstance(block_size, bool)
        if not valid or not 1 <= block_size <= MAX_BLOCK:
            raise ValueError(f"block_size must be an int in [1, {MAX_BLOCK}], got {block_size!r}")
        alpha = float(alpha)
        if not alpha > 1.0:
            raise ValueError(f"alpha must be > 1 (or inf for the plain argmin), got {alpha}")
        for label, value in (("clip", clip), ("spread", spread)):
            if not (isinstance(value, numbers.Real) and math.isfinite(value) and value > 0):
                raise ValueError(f"{label} must be a positive finite float, got {value!r}")
        if coder not in CODERS:
            raise ValueError(f"coder must be one of {', '.join(CODERS)}, got {coder!r}")
        self.block_size, self.alpha, self.coder = int(block_size), alpha, coder
        self.clip, self.spread = float(clip), float(spread)
        self.name = name
        self.words_per_candidate = 2 * (-(-self.block_size // 2))
        coder_id = next(i for i, name in CODER_NAMES.items() if name == coder)
        self.frame = Frame(CODEC_ID, 0, coder_id, self.block_size)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(block_size={self.block_size}, alpha={self.alpha}, clip={self.clip}, "
            f"spread={self.spread}, coder={self.coder!r})"
        )

    def params(self) -> str:
        """What encoder and decoder must agree on beyond the frame (bound into the message's check tag)."""
        return f"ppr:{self.alpha!r}:{self.clip!r}:{self.spread!r}"

    # --- the proposal ----------------------------------------------------------------------------------------
    def proposal_variance(self, sigma: float, dim: int) -> float:
        """tau^2 = sigma^2 + spread clip^2 / k: public."""
        return sigma * sigma + self.spread * self.clip**2 / dim

    def ratio_variance(self, sigma: float, dim: int) -> float:
        """The proposal variance the encoder's ratio assumes: tau^2 (a hook for the negative controls)."""
        return self.proposal_variance(sigma, dim)

    # --- shared randomness -----------------------------------------------------------------------------------
    def stream_key(self, key: int, purpose: str) -> int:
        return derive_key(key, "ppr", purpose)

    def rotation(self, key: int, dim: int) -> SharedRotation:
        """The shared rotation R of a release."""
        return SharedRotation(self.stream_key(key, "rotation"), dim)

    def first_labels(self, sigma: float, dim: int) -> int:
        """Candidates every block scores in full in the first round (no best yet to prune against)."""
        return min(FIRST_MIN, self.search_chunk(sigma, dim))

    def search_chunk(self, sigma: float, dim: int) -> int:
        """Labels of the second round (then the unfinished blocks double theirs): the power of two in [1, 256] at
        or above the mean bound ``E r*`` at ``||u|| = clip`` (times ``alpha / (alpha - 1)``, the longer search of a
        finite alpha). With a random rotation a block of ``u`` at the clip has ``|x|^2 ~ (clip^2 / k) chi^2_b``, so
        ``E r* = ((1 + gamma) / (1 - 1 / spread))^(b/2)`` for spread > 1."""
        gamma = self.proposal_variance(sigma, dim) / (sigma * sigma) - 1.0
        mean = ((1.0 + gamma) / (1.0 - 1.0 / self.spread)) ** (self.block_size / 2) if self.spread > 1 else math.inf
        if not math.isinf(self.alpha):
            mean *= self.alpha / (self.alpha - 1.0)
        return FIRST_MAX if mean >= FIRST_MAX else 1 << math.ceil(math.log2(max(mean, 1.0)))

    def shared_cipher(self, key: int) -> CipherContext:
        """The release's shared candidate cipher: AES-256-ECB under ``stream_key(key, "shared")``."""
        raw = self.stream_key(key, "shared").to_bytes(KEY_BITS // 8, "little")
        return Cipher(algorithms.AES(raw), modes.ECB()).encryptor()

    def shared_words(self, key: int, blocks: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """The words of candidates ``labels`` (m, L) of blocks ``blocks`` (m,), shape (m, L, w): AES-256 under the
        release's ``shared`` key of the 16-byte inputs ``(block, (label - 1) w/2 + q)`` (two little-endian uint64),
        ``q < w/2``: every candidate has its own inputs, so any set of them is one ECB call (module docstring)."""
        half = self.words_per_candidate // 2
        counters = np.empty((*labels.shape, half, 2), dtype="<u8")
        counters[..., 0] = np.asarray(blocks, dtype=np.uint64).reshape(-1, 1, 1)
        counters[..., 1] = ((labels.astype(np.uint64) - np.uint64(1)) * np.uint64(half))[..., None]
        counters[..., 1] += np.arange(half, dtype=np.uint64)
        return _ecb(self.shared_cipher(key), counters).reshape(*labels.shape, self.words_per_candidate)

    def pair_words(self, cipher: CipherContext, blocks: np.ndarray, counters: np.ndarray) -> np.ndarray:
        """The words of one pair each (a, 2): block ``blocks`` (a,), pair counter ``counters`` (a,), the second
        input word, ``(label - 1) w/2 + p`` for pair ``p`` (the words ``2 p, 2 p + 1``) of candidate ``label``: the
        same words as :meth:`shared_words` gives, one AES block each."""
        inputs = np.empty((blocks.size, 2), dtype="<u8")
        inputs[:, 0] = blocks
        inputs[:, 1] = counters
        return _ecb(cipher, inputs).reshape(-1, 2)

    # --- selection -------------------------------------------------------------------------------------------
    def log_scores(self, log_t: Array, log_r: Array, log_v: Array | None) -> Array:
        """alpha (log T - log r) + log V (alpha finite) or log T - log r (alpha = inf); numpy or torch."""
        if math.isinf(self.alpha):
            return log_t - log_r
        out = log_t - log_r
        out *= self.alpha
        return out + log_v

    def stop_mass(self, best: np.ndarray, log_rmax: np.ndarray, t_last: np.ndarray) -> np.ndarray:
        """Bound on the expected number of points beyond ``t_last`` able to beat ``best`` (alpha finite), or for
        alpha = inf the indicator that such points exist (``t_last < exp(best + log r*)``)."""
        a = self.alpha
        if math.isinf(a):
            return (np.log(t_last) < best + log_rmax).astype(np.float64)
        return np.exp(best + a * log_rmax + (1.0 - a) * np.log(t_last)) / (a - 1.0)

    def log_stop_time(self, best: np.ndarray, log_rmax: np.ndarray) -> np.ndarray:
        """log of the arrival time at which :meth:`stop_mass` falls to ``STOP_MASS`` (alpha = inf: where it turns
        0) for the given best scores: how far a block's search must still go unless its best improves."""
        a = self.alpha
        if math.isinf(a):
            return best + log_rmax
        return (best + a * log_rmax - math.log((a - 1.0) * STOP_MASS)) / (a - 1.0)

    # --- encode ----------------------------------------------------------------------------------------------
    def encode(self, u: np.ndarray, *, key: int, sigma: float, noise_key: int | None = None) -> bytes:
        """One release; the search's private randomness comes from ``noise_key`` (secure mode: never shared), or
        from ``key`` when None (simulation: whoever holds ``key`` can then regenerate it)."""
        key, sigma = check_key(key), check_sigma(sigma)
        u = check_input(u, sigma, bound_sigmas=True)
        k = self.encode_blocks(u, key=key, sigma=sigma, noise_key=noise_key)
        payload = encode_indices(k, self.coder)
        return seal(self.frame, dim=u.size, key=key, sigma=sigma, payload=payload, params=self.params())

    def blocks(self, u: np.ndarray, key: int) -> np.ndarray:
        """The rotated, zero-padded blocks ``(n, b)`` of ``u``."""
        b, d = self.block_size, u.size
        x = np.zeros(-(-d // b) * b)
        x[:d] = self.rotation(key, d).forward(u)
        return x.reshape(-1, b)

    def encode_blocks(self, u: np.ndarray, *, key: int, sigma: float, noise_key: int | None) -> np.ndarray:
        """The index K of every block (module docstring)."""
        target = _Target(self.blocks(u, key), sigma, self.ratio_variance(sigma, u.size))
        n = target.log_rmax.size
        growth = 1.0 if math.isinf(self.alpha) else self.alpha / (self.alpha - 1.0)
        worst = float(target.log_rmax.max()) * growth
        if worst > math.log(MAX_LABELS / 8):
            raise CodecError(
                f"PPR cannot release this input exactly within {MAX_LABELS} candidates a block: a block's density "
                f"ratio bound is e^{target.log_rmax.max():.0f} (||u|| = {np.linalg.norm(u):.3g} against the clip "
                f"{self.clip} the public proposal was built for); clip u to the codec's clip or raise the clip"
            )
        private = AesStream(self.stream_key(key if noise_key is None else check_key(noise_key), "private"))
        state, cipher = _Search(n), self.shared_cipher(key)
        active, size = np.arange(n), self.first_labels(sigma, u.size)
        second = self.search_chunk(sigma, u.size)
        while active.size:  # the blocks not yet done score their next ``size`` labels
            if size + int(state.done[active].max()) > MAX_LABELS:
                raise CodecError(
                    f"PPR search would exceed {MAX_LABELS} candidates in a block (||u|| far above the clip "
                    f"{self.clip} the proposal was built for?); clip u or raise the codec's clip"
                )
            self.search_round(cipher, target, state, active, size, private)
            active = active[
                self.stop_mass(state.best[active], target.log_rmax[active], state.t_last[active]) > STOP_MASS
            ]
            if active.size:  # next: the labels half of them still need at their current best, at most doubling
                need = np.exp(self.log_stop_time(state.best[active], target.log_rmax[active])) - state.t_last[active]
                need = float(np.partition(need, need.size // 2)[need.size // 2])  # the (upper) median
                need = 2 ** math.ceil(math.log2(max(need + 2.0 * math.sqrt(max(need, 0.0)) + 1.0, 1.0)))
                size = min(need, max(second, 2 * size))
        best, best_label, t_last, done = state.best, state.label, state.t_last, state.done
        if not math.isinf(self.alpha):  # the few points beyond each block's search that could still win
            mass = self.stop_mass(best, target.log_rmax, t_last)
            for j in np.flatnonzero(open_unit(private.words(n)) < -np.expm1(-mass)):
                label, value = self.tail(target, int(j), best[j], t_last[j], int(done[j]), mass[j], private, cipher)
                if value < best[j]:
                    best[j], best_label[j] = value, label
        return best_label

    def search_round(
        self, cipher: CipherContext, target: _Target, state: _Search, rows: np.ndarray, size: int, private: AesStream
    ) -> None:
        """Score the next ``size`` labels of blocks ``rows`` and update their state.

        A candidate can beat its block's best ``s*`` only if ``log r > log T + (log V - s*) / alpha`` (``log T - s*``
        for alpha = inf), i.e. ``beta |g - mu|^2 < budget``. Since ``r <= r*`` and ``T >= T_first`` (the chunk's
        first arrival), that needs ``V < c_max = exp(s* + alpha (log r* - log T_first))`` (alpha = inf:
        ``T < exp(s* + log r*)``): a comparison of the raw uniform against one bound per block, so the others cost
        no logarithm; the rest are scored by :meth:`distances`, which forms their pairs only while they can win."""
        m = rows.size
        marks = 1 if math.isinf(self.alpha) else 2  # arrival gaps, and the marks V unless alpha = inf
        u = open_unit(private.words(marks * m * size)).reshape(marks, m, size)
        t = torch.cumsum(torch.from_numpy(u[0]).log().neg_(), dim=1)
        t = t.add_(torch.from_numpy(state.t_last[rows])[:, None]).numpy()
        best, log_rmax = state.best[rows], target.log_rmax[rows]
        may = self.may_win(t, u[1] if marks == 2 else None, best, log_rmax)
        row, col = np.divmod(may, size)
        log_t = torch.from_numpy(t.ravel()[may]).log_().numpy()
        log_v = None if marks == 1 else torch.from_numpy(u[1].ravel()[may]).log_().neg_().log_().numpy()
        if log_v is None:
            budget = (log_rmax + best)[row]
            budget -= log_t
        else:
            budget = log_rmax[row] - log_t + (best[row] - log_v) / self.alpha
        labels = state.done[rows][row]
        labels += col + 1
        dist = self.distances(cipher, target, rows[row], labels, budget)
        hit = np.flatnonzero(dist < np.inf)  # only these can win: the others keep an inf score
        scores = np.full(m * size, np.inf)
        scores[may[hit]] = self.log_scores(
            log_t[hit], log_rmax[row[hit]] - target.beta * dist[hit], None if log_v is None else log_v[hit]
        )
        s = scores.reshape(m, size)
        arg = np.argmin(s, axis=1)
        s_min = s[np.arange(m), arg]
        better = s_min < best
        state.best[rows[better]] = s_min[better]
        state.label[rows[better]] = state.done[rows[better]] + arg[better] + 1
        state.t_last[rows], state.done[rows] = t[:, -1], state.done[rows] + size

    def may_win(self, t: np.ndarray, marks: np.ndarray | None, best: np.ndarray, log_rmax: np.ndarray) -> np.ndarray:
        """Flat indices of the candidates (arrival times ``t`` (m, L), mark uniforms ``U`` with ``V = -ln U``) that
        pass the per-block bound of :meth:`search_round`, loosened past any rounding so it never drops a winner."""
        slack = 1.0 + 1e-9
        if marks is None:
            return np.flatnonzero(t < (slack * np.exp(best + log_rmax))[:, None])
        # c T^-alpha bounded on each run of GROUP labels by its first T: T^-alpha falls fast along a chunk
        size = t.shape[1]
        group = min(GROUP, size)
        first = t[:, ::group]
        with np.errstate(over="ignore"):  # a bound past float range is inf: it keeps every candidate, as it should
            c_max = slack * np.exp(best[:, None] + self.alpha * (log_rmax[:, None] - np.log(first)))
        bound = np.repeat(np.exp(-c_max), group, axis=1)[:, :size]
        return np.flatnonzero(marks > bound)  # V < c  <=>  U > exp(-c)

    def distances(
        self, cipher: CipherContext, target: _Target, blocks: np.ndarray, labels: np.ndarray, budget: np.ndarray
    ) -> np.ndarray:
        """``|g - mu|^2`` of candidates ``labels`` of ``blocks`` (all (a,)), or inf where ``beta |g - mu|^2 >=
        budget`` is certain (such a candidate cannot win; an inf budget: the candidate in full).

        Pruned pair by pair: a pair's words are one AES block, its term ``|g_p - mu_p|^2 >= 0``, and the pairs are
        added in the block's order (largest ``|mu_p|`` first), so most candidates are dropped after one pair."""
        limit = budget * ((1.0 + 1e-9) / target.beta)
        limit += 1e-9  # past any rounding: never drops a winner
        alive = np.flatnonzero(limit > 0)  # the candidates still able to win
        block, limit = blocks[alive], limit[alive]
        first = labels[alive] - 1
        first *= self.words_per_candidate // 2  # the counter of each candidate's pair 0
        total = np.zeros(alive.size)
        for p in range(target.mu_norm.shape[0]):
            if not alive.size:
                break
            pair = target.order[p][block]
            uniform = torch.from_numpy(open_unit(self.pair_words(cipher, block, first + pair)))
            r2 = uniform[:, 0].log().mul_(-2.0)
            angle = uniform[:, 1].mul(2.0 * math.pi)
            m = torch.from_numpy(target.mu_norm[p][block])
            if target.half_pair is not None and (half := pair == target.half_pair).any():
                # an odd block's last pair uses its first normal only: (R cos A - mu)^2
                term = (r2.sqrt() * angle.cos() - m).square_()
                full = torch.from_numpy(~half)
                angle, r2, mf = angle[full], r2[full], m[full]
                phase = torch.from_numpy(target.mu_angle[p][block[~half]])
                term[full] = r2 + mf * mf - 2.0 * mf * r2.sqrt() * (angle - phase).cos()
            else:
                # |g_p - mu_p|^2 = R^2 + |mu_p|^2 - 2 R |mu_p| cos(A - angle(mu_p))
                angle -= torch.from_numpy(target.mu_angle[p][block])
                term = angle.cos_().mul_(r2.sqrt()).mul_(-2.0 * m).add_(r2).add_(m * m)
            total += term.numpy()
            keep = np.flatnonzero(total < limit)  # indices, not a mask: a random mask indexes ~7x slower
            if keep.size < total.size:
                alive, block, first, limit, total = alive[keep], block[keep], first[keep], limit[keep], total[keep]
        dist = np.full(labels.size, np.inf)
        dist[alive] = total
        return dist

    def tail(
        self,
        target: _Target,
        j: int,
        best: float,
        t_last: float,
        done: int,
        mass: float,
        private: AesStream,
        cipher: CipherContext,
    ) -> tuple[int, float]:
        """(label, log score) of the best point of block ``j`` beyond ``t_last`` able to beat ``best`` (score inf if
        none), for a block whose envelope count ``~ Poisson(mass)`` the caller found non-zero.

        The points able to win have ``V < c T^-alpha``: a Poisson process of intensity ``1 - exp(-c t^-alpha)``,
        drawn by thinning the envelope ``c t^-alpha`` (count ``Poisson(mass)`` given >= 1, positions Pareto); each
        accepted point's V is Exp(1) given ``V < c t^-alpha``, and its label counts every point of the rate-1
        process up to it: the others in between are Poisson with mean ``int exp(-c s^-alpha) ds``."""
        a = self.alpha
        c = math.exp(best + a * target.log_rmax[j])
        p0 = math.exp(-mass)
        count = max(1, poisson_ppf(p0 + open_unit(private.words(1))[0] * (1.0 - p0), mass))
        draw = open_unit(private.words(3 * count)).reshape(3, count)
        t = t_last * draw[0] ** (-1.0 / (a - 1.0))
        envelope = c * t**-a
        keep = draw[1] * envelope < -np.expm1(-envelope)
        order = np.argsort(t[keep])
        t, envelope, uv = t[keep][order], envelope[keep][order], draw[2][keep][order]
        v = -np.log1p(uv * np.expm1(-envelope))
        best_label, best_value, prev, label = 0, math.inf, t_last, done
        for ti, vi in zip(t, v):
            others = unable_mass(prev, ti, c, a)
            label += 1 + (poisson_ppf(open_unit(private.words(1))[0], others) if others > 0 else 0)
            prev = ti
            if label > MAX_LABELS:
                raise CodecError(f"PPR search would exceed {MAX_LABELS} candidates in a block; clip u")
            dist = self.distances(cipher, target, np.array([j]), np.array([label]), np.array([np.inf]))
            log_r = target.log_rmax[j] - target.beta * dist[0]
            value = float(self.log_scores(math.log(ti), log_r, math.log(vi)))
            if value < best_value:
                best_label, best_value = label, value
        return best_label, best_value

    # --- decode ----------------------------------------------------------------------------------------------
    def decode_indices(self, message: bytes, *, key: int, sigma: float, dim: int) -> np.ndarray:
        """K of every block, after every check of the frame and payload."""
        try:
            key, sigma, dim = check_key(key), check_sigma(sigma), check_dim(dim)
        except (TypeError, ValueError) as err:
            raise CodecError(str(err)) from err
        payload = open_message(message, self.frame, dim=dim, key=key, sigma=sigma, params=self.params())
        return decode_indices(payload, -(-dim // self.block_size), self.coder, limit=MAX_LABELS)

    def samples(self, k: np.ndarray, *, key: int, sigma: float, dim: int) -> np.ndarray:
        """Z_K of every block (the release in the rotated domain), shape ``(n, b)``."""
        g = normals_from_words(self.shared_words(key, np.arange(k.size), k[:, None])[:, 0], self.block_size)
        return math.sqrt(self.proposal_variance(sigma, dim)) * g

    def decoder_label(self, k: np.ndarray) -> np.ndarray:
        """Which candidate the decoder outputs for each block: K (a hook for the negative controls)."""
        return k

    def decode(self, message: bytes, *, key: int, sigma: float, dim: int) -> np.ndarray:
        k = self.decoder_label(self.decode_indices(message, key=key, sigma=sigma, dim=dim))
        z = self.samples(k, key=int(key), sigma=float(sigma), dim=int(dim))
        return self.rotation(int(key), int(dim)).inverse(z.ravel()[:dim])


class _Target:
    """The blocks ``x`` of one release, in the form the search scores them: completing the square in
    ``log r(tau g) = (b/2) log(tau^2/sigma^2) - |tau g - x|^2 / (2 sigma^2) + |g|^2 / 2`` gives
    ``log r(tau g) = log r* - beta |g - mu|^2`` with ``beta = gamma / 2``, ``gamma = tau^2 / sigma^2 - 1`` and
    ``mu = tau x / (sigma^2 gamma)``: the candidates able to win lie in a ball around ``mu``. ``mu`` is kept per
    Box-Muller pair (norm and angle; an odd block's last, half pair as its signed first entry), pairs in order of
    decreasing ``|mu_p|`` (``order``)."""

    def __init__(self, x: np.ndarray, sigma: float, tau2: float) -> None:
        n, b = x.shape
        gamma = tau2 / (sigma * sigma) - 1.0
        self.beta = 0.5 * gamma
        self.log_rmax = 0.5 * b * math.log1p(gamma) + np.einsum("ij,ij->i", x, x) / (2.0 * (tau2 - sigma * sigma))
        mu = np.pad(x * (math.sqrt(tau2) / (sigma * sigma * gamma)), ((0, 0), (0, b % 2))).reshape(n, -1, 2)
        norm, angle = np.hypot(mu[..., 0], mu[..., 1]), np.arctan2(mu[..., 1], mu[..., 0])
        self.half_pair = mu.shape[1] - 1 if b % 2 else None
        if self.half_pair is not None:
            norm[:, -1], angle[:, -1] = mu[:, -1, 0], 0.0
        order = np.argsort(-np.abs(norm), axis=1, kind="stable")
        # pair-major (pairs, n): row p holds every block's p-th pair (its index, |mu_p|, angle) contiguously
        self.order = np.ascontiguousarray(order.T)
        self.mu_norm = np.ascontiguousarray(np.take_along_axis(norm, order, axis=1).T)
        self.mu_angle = np.ascontiguousarray(np.take_along_axis(angle, order, axis=1).T)


class _Search:
    """The state of every block's search: best log score and its label, last arrival time, labels scored."""

    def __init__(self, n: int) -> None:
        self.best, self.label = np.full(n, np.inf), np.zeros(n, dtype=np.int64)
        self.t_last, self.done = np.zeros(n), np.zeros(n, dtype=np.int64)
