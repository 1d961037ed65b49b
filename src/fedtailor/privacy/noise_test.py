"""The two Gaussian samplers: the secure one's law, independence, keying and floating-point defence; the
simulation one pinned bit for bit."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from scipy import stats

from fedtailor.codecs import get_codec, release_key
from fedtailor.privacy.noise import (
    DRAWS_PER_SAMPLE,
    gaussian_noise,
    open_unit,
    secure_gaussian_components,
    secure_gaussian_noise,
    secure_stream_words,
    stream_words,
)
from fedtailor.rng import fresh_key

N = 1_000_000
SIGMA = 0.37


def _law_pvalues(x: np.ndarray, sigma: float) -> dict[str, float]:
    """Two-sided p-values of N(0, sigma^2) for ``x``: KS, Cramer-von Mises, mean, variance, skewness, kurtosis and
    the two-sided tail frequencies beyond 3 and 4 sigma (normal approximations of the binomial)."""
    n = x.size
    z = x / sigma
    out = {
        "ks": stats.kstest(z, "norm").pvalue,
        "cvm": stats.cramervonmises(z, "norm").pvalue,
        "mean": 2 * stats.norm.sf(abs(z.mean()) * math.sqrt(n)),
    }
    chi = (n - 1) * z.var(ddof=1)
    out["variance"] = 2 * min(stats.chi2.cdf(chi, n - 1), stats.chi2.sf(chi, n - 1))
    out["skewness"] = 2 * stats.norm.sf(abs(stats.skew(z)) / math.sqrt(6 / n))
    out["kurtosis"] = 2 * stats.norm.sf(abs(stats.kurtosis(z)) / math.sqrt(24 / n))
    for t in (3.0, 4.0):
        p = 2 * stats.norm.sf(t)
        count = np.count_nonzero(np.abs(z) > t)
        out[f"tail {t:g}"] = 2 * stats.norm.sf(abs(count - n * p) / math.sqrt(n * p * (1 - p)))
    return out


def test_secure_gaussian_is_n_0_sigma2_on_a_million_draws() -> None:
    """Every test at level 1e-4 (eight tests: a correct sampler fails with probability < 1e-3).

    Power on n = 10^6 (each checked below on a wrong sampler of the same size): a std 1% off moves the variance
    statistic by 0.02 sqrt(n / 2) = 14 standard deviations; a mean shift of 0.01 sigma gives the KS statistic
    0.004, 1.8x its 1e-4 critical value 0.0022; the Irwin-Hall sum of four uniforms (excess kurtosis -0.3)
    moves the kurtosis statistic by 0.3 / sqrt(24 / n) = 61 standard deviations; a 1% contamination by
    N(0, 4 sigma^2) raises the frequency beyond 4 sigma from 63 to 518 per million."""
    x = secure_gaussian_noise(fresh_key(), "law", sigma=SIGMA, size=N)
    assert x.shape == (N,) and x.dtype == np.float64
    p = _law_pvalues(x, SIGMA)
    assert min(p.values()) > 1e-4, p
    assert abs(x.mean()) < 5 * SIGMA / math.sqrt(N) and abs(x.std() / SIGMA - 1) < 5 / math.sqrt(2 * N)

    rng = np.random.default_rng(0)  # the wrong samplers the stated power is about: each is rejected
    wrong = {
        "variance": 1.01 * x,
        "ks": x + 0.01 * SIGMA,
        "kurtosis": SIGMA * (rng.random((4, N)).sum(0) - 2.0) * math.sqrt(3.0),
        "tail 4": np.where(rng.random(N) < 0.01, 2.0 * x, x),
    }
    for test, y in wrong.items():
        assert _law_pvalues(y, SIGMA)[test] < 1e-4, test


def test_two_fresh_keys_give_independent_draws() -> None:
    """Under independence each correlation is about N(0, 1/n): |r| < 5/sqrt(n) fails with probability 6e-7.
    Checked: between two fresh keys, between two labels of one key, between neighbours of one draw (they share
    Box-Muller pairs: the cosine of pair i+1 is in output i+1, its sine in output i) and between their squares
    (dependent but uncorrelated normals would pass the first and fail this one)."""
    n = 200_000
    bound = 5 / math.sqrt(n)
    a = secure_gaussian_noise(fresh_key(), "dg", sigma=1.0, size=n)
    b = secure_gaussian_noise(fresh_key(), "dg", sigma=1.0, size=n)
    key = fresh_key()
    c, d = (secure_gaussian_noise(key, label, sigma=1.0, size=n) for label in ("dg", "context"))
    for x, y in ((a, b), (c, d), (a[:-1], a[1:]), (a[:-1] ** 2, a[1:] ** 2), (a[:-2] ** 2, a[2:] ** 2)):
        assert abs(np.corrcoef(x, y)[0, 1]) < bound
    assert not np.array_equal(a, b)


def test_a_key_reproduces_its_stream_and_only_its_own() -> None:
    key = fresh_key()
    a = secure_gaussian_noise(key, "dg", sigma=0.5, size=1000)
    np.testing.assert_array_equal(a, secure_gaussian_noise(key, "dg", sigma=0.5, size=1000))
    np.testing.assert_array_equal(2 * a, secure_gaussian_noise(key, "dg", sigma=1.0, size=1000))
    assert not np.any(a == secure_gaussian_noise(key, "dg2", sigma=0.5, size=1000))
    assert not np.any(a == secure_gaussian_noise(key ^ 1, "dg", sigma=0.5, size=1000))
    # The stream is ChaCha20's keystream: a prefix of a longer draw, never SHAKE-256's stream of the same key.
    words = secure_stream_words(key, "gaussian", "dg", count=4000)
    np.testing.assert_array_equal(words[:100], secure_stream_words(key, "gaussian", "dg", count=100))
    assert not np.any(words == stream_words(key, "gaussian", "dg", count=4000))
    assert secure_gaussian_noise(key, sigma=1.0, size=0).shape == (0,)
    assert secure_gaussian_noise(key, sigma=0.0, size=3).tolist() == [0.0, 0.0, 0.0]
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="sigma"):
            secure_gaussian_noise(key, sigma=bad, size=3)
    with pytest.raises(ValueError, match="key"):
        secure_gaussian_noise(2**256, sigma=1.0, size=3)


@pytest.mark.parametrize("size", [1, 2, 3, 1000])
def test_the_floating_point_defence_sums_four_draws_of_four_distinct_pairs(size: int) -> None:
    """Opacus's secure_mode defence (Holohan and Braghin's n = 2): each output is the float64 sum of four
    independent Gaussian draws over two. Recomputed here from the raw ChaCha20 words with numpy's own libm
    (52-bit uniforms, Box-Muller in float64): every component is a Box-Muller normal of the stream, the four of
    one output belong to four different pairs (the cosine and the sine of one pair are never summed together:
    r cos a + r sin a = sqrt(2) r sin(a + pi/4) would be a single draw), and the output is their sum over two
    before any rounding."""
    key = fresh_key()
    n = max(size, 2)
    u = open_unit(secure_stream_words(key, "gaussian", "fp", count=4 * n))
    assert np.all((u > 0) & (u < 1))
    r, a = np.sqrt(-2.0 * np.log(u[: 2 * n])), 2.0 * math.pi * u[2 * n :]
    cos, sin = r * np.cos(a), r * np.sin(a)
    z = secure_gaussian_components(key, "fp", size=size)
    assert z.shape == (DRAWS_PER_SAMPLE, size)
    pair_of = np.empty((4, size), dtype=np.int64)  # which pair each component comes from
    i = np.arange(size)
    pair_of[0], pair_of[1] = i, n + i
    pair_of[2], pair_of[3] = (i + 1) % n, n + (i + 1) % n
    np.testing.assert_allclose(z[:2], cos[pair_of[:2]], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(z[2:], sin[pair_of[2:]], rtol=1e-13, atol=1e-15)
    assert all(len(set(pair_of[:, j])) == 4 for j in range(size))
    y = secure_gaussian_noise(key, "fp", sigma=SIGMA, size=size)
    np.testing.assert_array_equal(y, (((z[0] + z[1]) + z[2]) + z[3]) * (SIGMA / 2))
    if size >= 1000:  # float64 throughout: the draws are not float32 values (Opacus's default dtype)
        assert np.mean(y.astype(np.float32).astype(np.float64) != y) > 0.99


def test_dg_fp32_with_a_noise_key_releases_u_plus_secure_noise_rounded_once() -> None:
    codec = get_codec("dg-fp32")
    d = 4096
    u = np.linspace(-1, 1, d)
    key, noise_key = release_key(1, 2, 3), fresh_key()
    y = codec.decode(codec.encode(u, key=key, sigma=SIGMA, noise_key=noise_key), key=key, sigma=SIGMA, dim=d)
    np.testing.assert_array_equal(y, (u + secure_gaussian_noise(noise_key, "dg", sigma=SIGMA, size=d)).astype("<f4"))
    simulation = codec.decode(codec.encode(u, key=key, sigma=SIGMA), key=key, sigma=SIGMA, dim=d)
    np.testing.assert_array_equal(simulation, (u + gaussian_noise(key, "dg", sigma=SIGMA, size=d)).astype("<f4"))
    q12 = get_codec("dg-q12")
    y12 = q12.decode(q12.encode(u, key=key, sigma=SIGMA, noise_key=noise_key), key=key, sigma=SIGMA, dim=d)
    assert abs(np.corrcoef(y12 - u, y - u)[0, 1]) > 0.99  # the same secure noise, quantised


def test_the_simulation_sampler_is_unchanged() -> None:
    """Simulation runs must not move: the SHAKE-256 words of a fixed key are pinned bit for bit, and the sampler's
    output from them to 1e-12 relative (its log, cos and sin come from the platform's libm, whose last bit differs
    between machines; any change of the transform moves the values by far more), from the code before the
    secure sampler existed (and open_unit's faster form gives its old values exactly)."""
    key = release_key(7, 1, 2)
    words = stream_words(key, "gaussian", "dg", count=8198)
    assert hashlib.sha256(words.tobytes()).hexdigest() == (
        "1a9e7ef6af9767e544b6cf8f43cd7506f8a21093fc478704e3ca2e8819496602"
    )
    x = gaussian_noise(key, "dg", sigma=0.5, size=4099)
    got = [*x[:3].tolist(), float(x.sum()), float((x * x).sum())]
    want = [-0.46414794952013594, -0.4171685713446188, 0.12176287075400938, -11.611329893685184, 1036.1828375737673]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    w = np.random.default_rng(1).integers(0, 2**64, size=100_000, dtype=np.uint64)
    w[:4] = [0, 4095, 2**64 - 1, (2**52 - 1) << 12]
    ref = ((w >> np.uint64(12)).astype(np.float64) + 0.5) * 2.0**-52
    np.testing.assert_array_equal(open_unit(w).view(np.uint64), ref.view(np.uint64))
    inplace = w.copy()
    np.testing.assert_array_equal(open_unit(inplace, inplace=True).view(np.uint64), ref.view(np.uint64))
    np.testing.assert_array_equal(inplace.view(np.uint64), ref.view(np.uint64))  # the uniforms in the words' memory


def test_the_secure_stream_is_the_chacha20_keystream_of_its_derived_key() -> None:
    """The words are ChaCha20's keystream (RFC 8439 test vector: all-zero key and nonce, block 0) of the key that
    ``stream_words(key, "chacha20", *label)`` derives, read as little-endian uint64, and writable (so the
    uniforms can be formed in place); a stream of 0 words is empty."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    block0 = bytes.fromhex(
        "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
        "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586"
    )  # RFC 8439, section 2.3.2's first test vector
    assert Cipher(algorithms.ChaCha20(bytes(32), bytes(16)), mode=None).encryptor().update(bytes(64)) == block0
    key = fresh_key()
    raw = stream_words(key, "chacha20", "gaussian", 3, count=4).tobytes()
    want = Cipher(algorithms.ChaCha20(raw, bytes(16)), mode=None).encryptor().update(bytes(8 * 1001))
    got = secure_stream_words(key, "gaussian", 3, count=1001)
    assert got.tobytes() == want and got.flags.writeable
    assert secure_stream_words(key, "gaussian", 3, count=0).size == 0
