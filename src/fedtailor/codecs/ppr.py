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
  block, Elias-gamma coded.

Search, exact and vectorised over blocks: labels are scored in T order; after the first ``L1`` (then in doubling
chunks) a block stops once the points still able to beat its best score are few: points beyond ``T_N`` can only
win if ``V < c T^-alpha``, ``c = exp(s* + alpha log r*)``, an expected ``m <= c T_N^(1 - alpha) / (alpha - 1)``
of them (``s*`` the best log score). The block then draws exactly those points (a thinned Poisson process, by
rejection from the Pareto envelope) with their labels (the count of all points before them: Poisson with the
integral of ``exp(-c s^-alpha)``) and scores them too: no point that could win is ever skipped. With
``alpha = inf`` the stop is deterministic (``T_N >= exp(s* + log r*)``). A block that would need more than
``MAX_LABELS`` labels is refused with :class:`CodecError`, never answered approximately.
"""

from __future__ import annotations

import math
import numbers
from typing import TypeVar

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from scipy import integrate, stats

from fedtailor.codecs.base import Codec, CodecError, check_dim, check_input, check_key, check_sigma
from fedtailor.codecs.bits import BitReader, BitWriter
from fedtailor.codecs.format import Frame, open_message, seal
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
MAX_LABELS = 2**24


class AesStream(KeyStream):
    """The AES-256-CTR keystream of one 256-bit key (counter from zero), read as :class:`KeyStream` reads
    ChaCha20's: a cryptographically secure stream (NIST's CTR_DRBG is built on it) at AES-instruction speed."""

    @staticmethod
    def cipher(raw_key: bytes) -> Cipher:
        return Cipher(algorithms.AES(raw_key), modes.CTR(bytes(16)))


def fwht(x: np.ndarray) -> np.ndarray:
    """The normalised Walsh-Hadamard transform of the last axis (length a power of two), in a new array.

    Orthonormal and its own inverse: ``fwht(fwht(x)) == x`` up to rounding."""
    n = x.shape[-1]
    out = np.array(x, dtype=np.float64, copy=True)
    h = 1
    while h < n:
        v = out.reshape(-1, n // (2 * h), 2, h)
        a, b = v[:, :, 0, :].copy(), v[:, :, 1, :]
        v[:, :, 0, :] += b
        v[:, :, 1, :] = a - b
        h *= 2
    out *= 1.0 / math.sqrt(n)
    return out


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


def _pairs(words: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(R^2, cos A, sin A) of the Box-Muller pairs in the last axis of ``words`` (pairs of 52-bit uniforms):
    ``R^2 = -2 ln U``, ``A = 2 pi U'``; the normals are ``R cos A`` and ``R sin A``. float64 torch tensors (SLEEF's
    vectorised log and trig, about 2.5x numpy's), used alike by encoder and decoder."""
    u = torch.from_numpy(open_unit(words))
    u = u.view(*u.shape[:-1], -1, 2)
    r2 = u[..., 0].log().mul_(-2.0)
    angle = u[..., 1].mul(2.0 * math.pi)
    return r2, angle.cos(), angle.sin_()


def _sum_last(x: torch.Tensor) -> torch.Tensor:
    """Sum over the short last axis (the b/2 pairs) by adds: several times faster than ``sum(dim=-1)`` there."""
    out = x[..., 0].clone()
    for p in range(1, x.shape[-1]):
        out += x[..., p]
    return out


def normals_from_words(words: np.ndarray, b: int) -> np.ndarray:
    """Standard normals ``(..., b)`` from rows of ``2 ceil(b / 2)`` words (:func:`_pairs`)."""
    r2, cos, sin = _pairs(words)
    radius = r2.sqrt_()
    g = torch.stack([radius * cos, radius * sin], dim=-1)
    return g.reshape(*r2.shape[:-1], -1)[..., :b].numpy()


class PPRCodec(Codec):
    """Exact Gaussian release by PPR on blocks of ``block_size`` rotated coordinates, K Elias-gamma coded.

    ``alpha`` (> 1, or ``math.inf``): the PPR parameter (privacy of the index against the decoder: ``2 alpha eps``
    for an ``eps``-DP mechanism; larger alpha, shorter search). ``clip``: the public bound on ``||u||`` the proposal
    is built for; ``spread``: the proposal's extra variance in units of ``clip^2 / k``. Inputs above the clip are
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
        self.block_size, self.alpha = int(block_size), alpha
        self.clip, self.spread = float(clip), float(spread)
        self.name = name
        self.words_per_candidate = 2 * (-(-self.block_size // 2))
        self.frame = Frame(CODEC_ID, 0, 1, self.block_size)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(block_size={self.block_size}, alpha={self.alpha}, clip={self.clip}, "
            f"spread={self.spread})"
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
        """Candidates every block scores in the first round (then the unfinished blocks double theirs): the power
        of two in [8, 256] at or above the mean bound ``E r*`` at ``||u|| = clip`` (times ``alpha / (alpha - 1)``,
        the longer search of a finite alpha). With a random rotation a block of ``u`` at the clip has
        ``|x|^2 ~ (clip^2 / k) chi^2_b``, so ``E r* = ((1 + gamma) / (1 - 1 / spread))^(b/2)`` for spread > 1."""
        gamma = self.proposal_variance(sigma, dim) / (sigma * sigma) - 1.0
        mean = ((1.0 + gamma) / (1.0 - 1.0 / self.spread)) ** (self.block_size / 2) if self.spread > 1 else math.inf
        if not math.isinf(self.alpha):
            mean *= self.alpha / (self.alpha - 1.0)
        return FIRST_MAX if mean >= FIRST_MAX else max(FIRST_MIN, 1 << math.ceil(math.log2(max(mean, 1.0))))

    def shared_words(self, key: int, blocks: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """The words of candidates ``labels`` (m, L) of blocks ``blocks`` (m,), shape (m, L, w): AES-256 under the
        release's ``shared`` key of the 16-byte inputs ``(block, (label - 1) w/2 + q)`` (two little-endian uint64),
        ``q < w/2``: every candidate has its own inputs, so any set of them is one ECB call (module docstring)."""
        half = self.words_per_candidate // 2
        counters = np.empty((*labels.shape, half, 2), dtype="<u8")
        counters[..., 0] = np.asarray(blocks, dtype=np.uint64).reshape(-1, 1, 1)
        index = labels.astype(np.uint64)
        index -= np.uint64(1)
        index *= np.uint64(half)
        counters[..., 1] = index[..., None] + np.arange(half, dtype=np.uint64)
        raw = self.stream_key(key, "shared").to_bytes(KEY_BITS // 8, "little")
        out = Cipher(algorithms.AES(raw), modes.ECB()).encryptor().update(memoryview(counters).cast("B"))
        return np.frombuffer(out, dtype="<u8").reshape(*labels.shape, self.words_per_candidate)

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

    # --- encode ----------------------------------------------------------------------------------------------
    def encode(self, u: np.ndarray, *, key: int, sigma: float, noise_key: int | None = None) -> bytes:
        """One release; the search's private randomness comes from ``noise_key`` (secure mode: never shared), or
        from ``key`` when None (simulation: whoever holds ``key`` can then regenerate it)."""
        key, sigma = check_key(key), check_sigma(sigma)
        u = check_input(u, sigma, bound_sigmas=True)
        k = self.encode_blocks(u, key=key, sigma=sigma, noise_key=noise_key)
        writer = BitWriter()
        writer.gamma(k)
        return seal(self.frame, dim=u.size, key=key, sigma=sigma, payload=writer.getvalue(), params=self.params())

    def blocks(self, u: np.ndarray, key: int) -> np.ndarray:
        """The rotated, zero-padded blocks ``(n, b)`` of ``u``."""
        b, d = self.block_size, u.size
        x = np.zeros(-(-d // b) * b)
        x[:d] = self.rotation(key, d).forward(u)
        return x.reshape(-1, b)

    def encode_blocks(self, u: np.ndarray, *, key: int, sigma: float, noise_key: int | None) -> np.ndarray:
        """The index K of every block (module docstring)."""
        target = _Target(self.blocks(u, key), sigma, self.ratio_variance(sigma, u.size))
        n = target.x.shape[0]
        first = self.first_labels(sigma, u.size)
        growth = 1.0 if math.isinf(self.alpha) else self.alpha / (self.alpha - 1.0)
        worst = float(target.log_rmax.max()) * growth
        if worst > math.log(MAX_LABELS / 8):
            raise CodecError(
                f"PPR cannot release this input exactly within {MAX_LABELS} candidates a block: a block's density "
                f"ratio bound is e^{target.log_rmax.max():.0f} (||u|| = {np.linalg.norm(u):.3g} against the clip "
                f"{self.clip} the public proposal was built for); clip u to the codec's clip or raise the clip"
            )
        private = AesStream(self.stream_key(key if noise_key is None else check_key(noise_key), "private"))

        def score(words: np.ndarray, rows: np.ndarray, t0: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            # log scores and arrival times of the candidates ``words`` (m, L, w) of blocks ``rows``
            m, labels = words.shape[:2]
            e = torch.from_numpy(open_unit(private.words(2 * m * labels))).view(2, m, labels).log_().neg_()
            t = torch.cumsum(e[0], dim=1).add_(torch.from_numpy(t0)[:, None])
            log_v = None if math.isinf(self.alpha) else e[1].log_()
            return self.log_scores(t.log(), target.log_ratio(words, rows), log_v).numpy(), t.numpy()

        # tier 1: every block, labels 1..L1
        blocks = np.arange(n)
        s, t = score(self.shared_words(key, blocks, np.tile(np.arange(1, first + 1), (n, 1))), blocks, np.zeros(n))
        best_label = np.argmin(s, axis=1) + 1
        best = s[np.arange(n), best_label - 1]
        t_last, done = t[:, -1].copy(), np.full(n, first)
        active = np.flatnonzero(self.stop_mass(best, target.log_rmax, t_last) > STOP_MASS)
        chunk = first
        while active.size:  # the blocks not yet done, in doubling chunks
            if chunk + int(done[active].max()) > MAX_LABELS:
                raise CodecError(
                    f"PPR search would exceed {MAX_LABELS} candidates in a block (||u|| far above the clip "
                    f"{self.clip} the proposal was built for?); clip u or raise the codec's clip"
                )
            labels = done[active][:, None] + np.arange(1, chunk + 1)
            s, t = score(self.shared_words(key, active, labels), active, t_last[active])
            arg = np.argmin(s, axis=1)
            s_min = s[np.arange(active.size), arg]
            better = s_min < best[active]
            best[active[better]] = s_min[better]
            best_label[active[better]] = done[active[better]] + arg[better] + 1
            t_last[active], done[active] = t[:, -1], done[active] + chunk
            active = active[self.stop_mass(best[active], target.log_rmax[active], t_last[active]) > STOP_MASS]
            chunk *= 2
        if not math.isinf(self.alpha):  # the few points beyond each block's search that could still win
            mass = self.stop_mass(best, target.log_rmax, t_last)
            for j in np.flatnonzero(open_unit(private.words(n)) < -np.expm1(-mass)):
                label, value = self.tail(target, int(j), best[j], t_last[j], int(done[j]), mass[j], private, key)
                if value < best[j]:
                    best[j], best_label[j] = value, label
        return best_label

    def tail(
        self,
        target: _Target,
        j: int,
        best: float,
        t_last: float,
        done: int,
        mass: float,
        private: AesStream,
        key: int,
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
        count = max(1, int(stats.poisson.ppf(p0 + open_unit(private.words(1))[0] * (1.0 - p0), mass)))
        draw = open_unit(private.words(3 * count)).reshape(3, count)
        t = t_last * draw[0] ** (-1.0 / (a - 1.0))
        envelope = c * t**-a
        keep = draw[1] * envelope < -np.expm1(-envelope)
        order = np.argsort(t[keep])
        t, envelope, uv = t[keep][order], envelope[keep][order], draw[2][keep][order]
        v = -np.log1p(uv * np.expm1(-envelope))
        best_label, best_value, prev, label = 0, math.inf, t_last, done
        for ti, vi in zip(t, v):
            able = integrate.quad(lambda s: -math.expm1(-c * s**-a), prev, ti, epsabs=0.0, epsrel=1e-10)[0]
            others = (ti - prev) - able
            label += 1 + (int(stats.poisson.ppf(open_unit(private.words(1))[0], others)) if others > 0 else 0)
            prev = ti
            if label > MAX_LABELS:
                raise CodecError(f"PPR search would exceed {MAX_LABELS} candidates in a block; clip u")
            words = self.shared_words(key, np.array([j]), np.array([[label]]))
            log_r = target.log_ratio(words, np.array([j]))[0, 0]
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
        reader = BitReader(payload)
        k = reader.gamma(-(-dim // self.block_size), limit=MAX_LABELS)
        reader.finish()
        return k

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
    """The blocks ``x`` of one release with what the ratio ``log r(tau g)`` needs (module docstring)."""

    def __init__(self, x: np.ndarray, sigma: float, tau2: float) -> None:
        b = x.shape[1]
        gamma = tau2 / (sigma * sigma) - 1.0
        norm2 = np.einsum("ij,ij->i", x, x)
        self.x = x
        self.odd = b % 2 == 1
        self.pairs = torch.from_numpy(np.pad(x, ((0, 0), (0, b % 2))).reshape(x.shape[0], 1, -1, 2))
        self.log_rmax = 0.5 * b * math.log1p(gamma) + norm2 / (2.0 * (tau2 - sigma * sigma))
        self.const = torch.from_numpy(0.5 * b * math.log1p(gamma) - norm2 / (2.0 * sigma * sigma))
        self.coef, self.beta = math.sqrt(tau2) / (sigma * sigma), 0.5 * gamma

    def log_ratio(self, words: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        """log r(tau g) for the candidates drawn from ``words`` (m, L, 2 ceil(b/2)) of the blocks ``rows``:
        ``(b/2) log(tau^2/sigma^2) - |x|^2 / (2 sigma^2) + (tau / sigma^2) <g, x> - (gamma / 2) |g|^2``, from the
        Box-Muller pairs directly (``|g|^2`` is a sum of ``R^2``; no normal is formed)."""
        r2, cos, sin = _pairs(words)
        norm2 = _sum_last(r2)
        if self.odd:  # the last pair's second normal (R sin A) is not used
            norm2 -= r2[..., -1] * sin[..., -1] ** 2
        index = torch.from_numpy(np.asarray(rows))
        x = self.pairs[index]  # (m, 1, pairs, 2)
        cos *= x[..., 0]
        sin *= x[..., 1]
        cos += sin
        dot = _sum_last(cos.mul_(r2.sqrt_()))
        return dot.mul_(self.coef).add_(self.const[index][:, None]).sub_(norm2.mul_(self.beta))
