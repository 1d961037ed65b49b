"""PPR: exactness (battery + negative controls), the search's bound, the index's privacy against the decoder,
shared randomness, hostile messages.

Power of the battery (``ppr_exactness_battery``, Holm over ~60 tests at alpha = 0.01; 6 input classes of 16,384
coordinates, 4,096 blocks of b = 4): a correct codec fails with probability <= 0.01 (the keys are fixed, so the
outcome is deterministic). The broken variants are rejected with p < 1e-15: a ratio for a 1.5x wider proposal
shifts E||E_block||^2; the index off by one releases a draw from Q (variance 1.9x); reused randomness repeats the
release (correlation 1); a search budget of 8 candidates moves 7-24% of the blocks' choices onto the prefix,
pulling E towards -x (the correlation with the input and the top-|x| projection test).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, stats

from fedtailor.codecs import CodecError, PPRCodec, get_codec, release_key
from fedtailor.codecs._testing import BROKEN_PPR
from fedtailor.codecs.battery import ppr_exactness_battery
from fedtailor.codecs.lrsuq import KeyStream
from fedtailor.codecs.ppr import SharedRotation, fwht, poisson_ppf, unable_mass
from fedtailor.privacy.noise import open_unit

SIGMA = 0.01468
K = 16384


def unit_vector(k: int, seed: int) -> np.ndarray:
    u = np.random.default_rng(seed).standard_normal(k)
    return u / np.linalg.norm(u)


# --- exactness ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options", [{}, {"alpha": math.inf}, {"block_size": 3, "alpha": 3.0, "spread": 3.0}], ids=["b4", "argmin", "b3"]
)
def test_battery_passes(options: dict) -> None:
    codec = PPRCodec(**options)
    result = ppr_exactness_battery(codec, dim=K - K % codec.block_size)
    assert result.passed, (result.holm_p, result.worst(), result.notes)


class _Unpruned(PPRCodec):
    """Every candidate scored in full (no bound, no budget): the plain argmin over all candidates the search reaches."""

    def may_win(self, t, marks, best, log_rmax):
        return np.arange(t.size)

    def distances(self, cipher, target, blocks, labels, budget):
        return super().distances(cipher, target, blocks, labels, np.full(budget.shape, np.inf))


@pytest.mark.parametrize("options", [{"block_size": 8}, {"block_size": 5, "alpha": math.inf}], ids=["b8", "b5-argmin"])
def test_pruning_never_drops_the_winner(options: dict) -> None:
    """The search skips candidates a per-block bound rules out and forms a candidate's pairs only while it can still
    beat its block's best (largest |mu_p| first); scoring every candidate in full instead picks the same index in
    every block: the messages are equal bit for bit (a bound off by a factor, or a pair added twice, changes some
    of the ~3,000 indices)."""
    for seed in range(3):
        u = unit_vector(K, seed) * (0.3 + 0.4 * seed)
        pruned = PPRCodec(**options).encode(u, key=release_key(1, 0, seed), sigma=SIGMA)
        assert _Unpruned(**options).encode(u, key=release_key(1, 0, seed), sigma=SIGMA) == pruned


@pytest.mark.parametrize("name", sorted(BROKEN_PPR))
def test_battery_rejects_each_broken_variant(name: str) -> None:
    result = ppr_exactness_battery(BROKEN_PPR[name]())
    assert result.holm_p < 1e-15, (name, result.worst())


def test_the_decoded_noise_is_gaussian_over_many_small_releases() -> None:
    """Output domain, odd dimension (a zero-padded last block, both Hadamards overlapping), 40 releases."""
    codec, d = PPRCodec(), 1001
    e = []
    for r in range(40):
        u = 0.9 * unit_vector(d, r)
        y = codec.decode(
            codec.encode(u, key=release_key(3, 0, r), sigma=0.05), key=release_key(3, 0, r), sigma=0.05, dim=d
        )
        e.append((y - u) / 0.05)
    e = np.concatenate(e)
    assert stats.kstest(e, "norm").pvalue > 1e-3
    assert abs(e.mean()) < 5 / math.sqrt(e.size) and abs(e.var() - 1) < 5 * math.sqrt(2 / e.size)


def test_a_search_beyond_its_bound_is_refused_not_approximated() -> None:
    codec = PPRCodec()
    with pytest.raises(CodecError, match="clip u to the codec's clip"):
        codec.encode(5.0 * unit_vector(K, 1), key=1, sigma=SIGMA)  # ||u|| = 5 clip: a block's r* ~ e^400


# --- privacy of the index against the decoder --------------------------------------------------------------
def test_the_index_law_given_the_shared_randomness_is_the_papers_and_2_alpha_eps_private() -> None:
    """The paper's theorem on a case small enough to enumerate: a 3-output eps-DP mechanism (randomised response
    with e^eps odds), 12 candidates from a uniform proposal and fixed arrival times. The codec's race
    (``log_scores`` with V ~ Exp(1), argmin) over 40,000 private draws follows the exact law
    ``P(K = k | Z, T) = (r(Z_k) / T_k)^alpha / sum_i (r(Z_i) / T_i)^alpha`` (chi-square), and that law's privacy
    loss between the two inputs is at most 2 alpha eps at every k. With alpha = inf the index is a deterministic
    function of (Z, T): no finite bound."""
    eps, alpha = 0.5, 2.0
    odds = math.exp(eps)
    p = {x: np.array([odds if z == x else 1.0 for z in range(3)]) / (odds + 2) for x in (0, 1)}
    rng = np.random.default_rng(5)
    z = rng.integers(0, 3, size=12)
    log_t = np.log(np.cumsum(rng.exponential(size=12)))
    codec, draws = PPRCodec(alpha=alpha), 40_000
    laws = {}
    for x in (0, 1):
        log_r = np.log(p[x][z] * 3.0)  # dP/dQ against the uniform proposal
        w = alpha * (log_r - log_t)
        laws[x] = np.exp(w - w.max()) / np.exp(w - w.max()).sum()
        v = -np.log(open_unit(KeyStream(100 + x).words(12 * draws))).reshape(draws, 12)
        picks = np.argmin(codec.log_scores(log_t, log_r, np.log(v)), axis=1)
        counts = np.bincount(picks, minlength=12)
        ok = laws[x] * draws >= 5
        assert stats.chisquare(counts[ok], laws[x][ok] * counts[ok].sum() / laws[x][ok].sum()).pvalue > 1e-3
    loss = np.abs(np.log(laws[0] / laws[1]))
    assert loss.max() <= 2 * alpha * eps + 1e-12
    assert loss.max() > 0.5 * alpha * eps  # the bound is not vacuous here
    argmin = PPRCodec(alpha=math.inf)
    picks = {x: int(np.argmin(argmin.log_scores(log_t, np.log(p[x][z] * 3.0), None))) for x in (0, 1)}
    assert picks[0] != picks[1]  # alpha = inf: each input picks its index with probability 1


# --- shared randomness, rotation, determinism --------------------------------------------------------------
def test_fwht_and_the_shared_rotation_are_orthonormal() -> None:
    x = np.random.default_rng(0).standard_normal((3, 64))
    np.testing.assert_allclose(fwht(fwht(x)), x, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(fwht(x), axis=1), np.linalg.norm(x, axis=1), rtol=1e-12)
    for d in (1, 2, 5, 1000, 1024):
        rot = SharedRotation(7, d)
        u = np.random.default_rng(d).standard_normal(d)
        np.testing.assert_allclose(rot.inverse(rot.forward(u)), u, atol=1e-12)
        np.testing.assert_allclose(np.linalg.norm(rot.forward(u)), np.linalg.norm(u), rtol=1e-12)
    spike = SharedRotation(3, 1024).forward(np.eye(1, 1024).ravel())
    assert np.abs(spike).max() < 5 / 32 and np.count_nonzero(np.abs(spike) > 1e-9) > 900  # spread over coordinates


def test_shared_words_are_aes_of_each_candidates_own_counters() -> None:
    """Candidate i of block j: AES-256 of the inputs (j, (i - 1) w/2 + q); random access reads what a contiguous
    range of labels gives, and another block or key gives other words."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    codec = PPRCodec(block_size=3)  # 4 words = 2 AES blocks a candidate
    raw = codec.stream_key(11, "shared").to_bytes(32, "little")
    inputs = np.array([[5, q] for q in range(80)], dtype="<u8")
    stream = np.frombuffer(Cipher(algorithms.AES(raw), modes.ECB()).encryptor().update(inputs.tobytes()), "<u8")
    stream = stream.reshape(40, 4)
    labels = np.array([[1, 2, 3, 17, 40]])
    np.testing.assert_array_equal(codec.shared_words(11, np.array([5]), labels)[0], stream[labels[0] - 1])
    whole = codec.shared_words(11, np.array([5]), np.arange(1, 41)[None])[0]
    np.testing.assert_array_equal(whole, stream)
    assert not np.array_equal(codec.shared_words(11, np.array([6]), labels)[0], stream[labels[0] - 1])
    assert not np.array_equal(codec.shared_words(12, np.array([5]), labels)[0], stream[labels[0] - 1])


def test_simulation_is_reproducible_and_secure_mode_draws_the_private_randomness_apart() -> None:
    codec, u = PPRCodec(), unit_vector(512, 2)
    key = release_key(9, 1, 4)
    assert codec.encode(u, key=key, sigma=0.03) == codec.encode(u, key=key, sigma=0.03)
    a = codec.encode(u, key=key, sigma=0.03, noise_key=1)
    b = codec.encode(u, key=key, sigma=0.03, noise_key=2)
    assert a != b  # the index depends on the encoder's own randomness
    for msg in (a, b):  # the decoder needs only the release key
        assert codec.decode(msg, key=key, sigma=0.03, dim=512).shape == (512,)


def test_hostile_or_mismatched_messages_are_refused() -> None:
    codec, u, key = PPRCodec(), unit_vector(256, 3), release_key(1, 2, 3)
    msg = codec.encode(u, key=key, sigma=0.05)
    with pytest.raises(CodecError, match="mismatch"):
        PPRCodec(alpha=4.0).decode(msg, key=key, sigma=0.05, dim=256)  # other options
    with pytest.raises(CodecError, match="mismatch"):
        codec.decode(msg, key=key + 1, sigma=0.05, dim=256)
    with pytest.raises(CodecError, match="truncated"):
        codec.decode(msg[:-9], key=key, sigma=0.05, dim=256)
    with pytest.raises(CodecError, match="another codec"):
        get_codec("lrsuq").decode(msg, key=key, sigma=0.05, dim=256)
    corrupted = bytearray(msg)
    corrupted[24] ^= 0x40
    with pytest.raises(CodecError, match="CRC32"):
        codec.decode(bytes(corrupted), key=key, sigma=0.05, dim=256)


def test_options_are_checked() -> None:
    assert get_codec("ppr", block_size=8, alpha=math.inf).block_size == 8
    for bad in ({"block_size": 0}, {"alpha": 1.0}, {"clip": -1.0}, {"spread": math.nan}):
        with pytest.raises(ValueError):
            PPRCodec(**bad)
    with pytest.raises(ValueError, match="coder must be one of"):
        PPRCodec(coder="gamma")
    with pytest.raises(ValueError, match="unknown"):
        get_codec("ppr", lattice="D4")


def test_the_rate_at_eps_16() -> None:
    """k = 16,384, ||u|| = 1, sigma 0.01468 (eps 16): the defaults send about 0.67 bits a coefficient (b = 4,
    alpha 8, spread 2.5); b = 8 reaches 0.49 (docs/codecs.md, the rate-time table)."""
    bpc = [8 * len(PPRCodec().encode(unit_vector(K, s), key=release_key(0, 0, s), sigma=SIGMA)) / K for s in range(3)]
    assert 0.62 < np.mean(bpc) < 0.72


class _EarlyStop(PPRCodec):
    """One candidate scored per block before the stopping rule: the exact tail does most of the search."""

    def first_labels(self, sigma: float, dim: int) -> int:
        return 1


class _TailOffByOne(_EarlyStop):
    """Broken: a point won in the tail is sent with the next label (the decoder outputs another candidate)."""

    def tail(self, *args, **kwargs):
        label, value = super().tail(*args, **kwargs)
        return label + 1, value


def test_the_tail_is_exact_where_it_decides_most_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tail (the points beyond the scored ones that could still win, drawn exactly) rarely changes a block's
    choice at the defaults (its envelope uses the loose bound r*). Here it decides about 40% of the blocks: u = 0,
    a proposal only 1.5x the target's variance (b = 1, so r / r* = exp(-g^2 / 4) stays near 1), alpha 2, one
    scored candidate, and a stop once at most 50 points could still win. The output must still be N(0, sigma^2):
    6,000 draws, the variance within 4.5 of its standard errors (0.018) and KS; a tail that sends the wrong label
    releases draws from the proposal in those blocks (variance about 1.2) and fails."""
    import fedtailor.codecs.ppr as ppr

    monkeypatch.setattr(ppr, "STOP_MASS", 50.0)
    sigma, d = 0.05, 3000
    spread = 0.5 * d * sigma**2  # gamma = 0.5

    def release(codec: PPRCodec) -> np.ndarray:
        keys = [release_key(1, 0, r) for r in range(2)]
        return np.concatenate(
            [
                codec.decode(codec.encode(np.zeros(d), key=k, sigma=sigma), key=k, sigma=sigma, dim=d) / sigma
                for k in keys
            ]
        )

    wins = []
    original = _EarlyStop.tail

    def counted(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        wins.append(out[1] < args[2])
        return out

    monkeypatch.setattr(_EarlyStop, "tail", counted)
    e = release(_EarlyStop(block_size=1, alpha=2.0, spread=spread))
    assert sum(wins) > 0.25 * e.size  # the tail really decides
    se = math.sqrt(2 / e.size)
    assert abs(e.var() - 1) < 4.5 * se and stats.kstest(e, "norm").pvalue > 1e-3
    monkeypatch.setattr(_EarlyStop, "tail", original)
    broken = release(_TailOffByOne(block_size=1, alpha=2.0, spread=spread))
    assert broken.var() - 1 > 6 * se, broken.var()


def test_the_tails_poisson_quantile_and_mass_match_scipys_reference() -> None:
    """The tail's label counts: ``poisson_ppf`` equals ``scipy.stats.poisson.ppf`` and ``unable_mass`` adaptive
    quadrature (to 1e-10 relative) over the ranges a search meets, short intervals and long ones."""
    rng = np.random.default_rng(0)
    for _ in range(500):
        q, mean = rng.random(), 10 ** rng.uniform(-4, 4)
        assert poisson_ppf(q, mean) == int(stats.poisson.ppf(q, mean)), (q, mean)
    for _ in range(400):
        a, c, lo = 10 ** rng.uniform(0.1, 1.5), 10 ** rng.uniform(-3, 6), 10 ** rng.uniform(0, 5)
        hi = lo * (1 + 10 ** rng.uniform(-8, 1))
        ref = integrate.quad(lambda s, c=c, a=a: math.exp(-c * s**-a), lo, hi, epsabs=0, epsrel=1e-13, limit=200)[0]
        assert unable_mass(lo, hi, c, a) == pytest.approx(ref, rel=1e-10, abs=1e-300), (lo, hi, c, a)
