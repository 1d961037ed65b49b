"""LRSUQ: exactness (statistical battery + negative controls), shared randomness, lattices, rates.

Sample sizes and power (see also docs/codecs.md): the battery releases 5 extreme inputs of 16,384 blocks each
(65,536 coordinates for b = 4) plus two releases for the cross-release correlation, and combines its ~70 tests
with Holm's correction at alpha = 0.01. A correct codec fails with probability <= 0.01 under any seed (the
seeds are fixed, so the outcome here is deterministic). For the broken variants the effect sizes are large at
this size: chi_b radius shifts E||E||^2 from 4 sigma^2 to 2.67 sigma^2; the 1.9 rho cell empties the tail
|E_i| > 0.95 rho, which holds 68.5 coordinates on average per class (P(0 | H0) = e^-68.5 = 2e-30, so the tail
test alone rejects at any n_blocks > 2,100); off-by-one dithers and split radii put E outside the ball; a
reused seed gives correlation 1 between releases. Every control is rejected with p far below 1e-20.
"""

from __future__ import annotations

import itertools
import math
import pickle

import numpy as np
import pytest
from scipy import stats

from fedtailor.codecs import CodecError, LRSUQCodec, get_codec, release_key
from fedtailor.codecs._testing import BROKEN_VARIANTS, SmallCell, reused_release_key
from fedtailor.codecs.battery import exactness_battery
from fedtailor.codecs.bench import gaussian_floor_bpc
from fedtailor.codecs.entropy import N_BUCKETS, boundary_buckets
from fedtailor.codecs.lattices import D4Lattice, IntegerLattice, unit_ball_volume
from fedtailor.codecs.lrsuq import KeyStream
from fedtailor.rng import derive_key, derive_seed

SIGMA = 0.01468  # the calibrated sigma at eps = 16 (docs/privacy.md)
ALPHA = 0.01


def unit_vector(k: int, seed: int) -> np.ndarray:
    u = np.random.default_rng(seed).standard_normal(k)
    return u / np.linalg.norm(u)


# --- acceptance probability, radius law, lattices ------------------------------------------------------------
def test_acceptance_probability_closed_forms() -> None:
    assert LRSUQCodec().law.p == pytest.approx(math.pi**2 / 32, rel=1e-15)
    assert LRSUQCodec(lattice="D4").law.p == pytest.approx(math.pi**2 / 16, rel=1e-15)
    assert LRSUQCodec(block_size=1).law.p == 1.0
    for b in range(1, 9):
        assert unit_ball_volume(b) == pytest.approx(math.pi ** (b / 2) / math.gamma(b / 2 + 1), rel=1e-14)


def test_k_max_bounds_the_geometric_tail() -> None:
    law = LRSUQCodec().law
    assert (1 - law.p) ** law.k_max < 1e-30 <= (1 - law.p) ** (law.k_max - 1)
    assert law.k_max == 188
    np.testing.assert_allclose(law.probabilities[:3], [law.p, law.p * (1 - law.p), law.p * (1 - law.p) ** 2])


@pytest.mark.parametrize("b", [1, 2, 3, 4, 5, 8])
def test_acceptance_probability_matches_monte_carlo(b: int) -> None:
    # Fraction of the cube [-1/2, 1/2)^b inside the ball of radius 1/2: n = 2e5, 6-sigma band.
    x = np.random.default_rng(b).uniform(-0.5, 0.5, size=(200_000, b))
    frac = np.mean(np.sum(x * x, axis=1) <= 0.25)
    p = LRSUQCodec(block_size=b).law.p if b > 1 else 1.0
    assert abs(frac - p) < 6 * math.sqrt(p * (1 - p) / 2e5) + 1e-12


@pytest.mark.parametrize("b", [1, 2, 3, 4, 5])
def test_radius_is_sigma_chi_b_plus_2(b: int) -> None:
    codec = LRSUQCodec(block_size=b)
    rho = codec.radius(derive_seed(5, b), 2.0, 40_000)
    assert stats.kstest(rho / 2.0, stats.chi(b + 2).cdf).pvalue > 1e-3
    assert np.all(rho > 0)
    if b % 2:  # blocks 2i and 2i + 1 share a Box-Muller pair: their radii must still be independent
        assert abs(np.corrcoef(rho[0::2] ** 2, rho[1::2] ** 2)[0, 1]) < 0.03  # 20,000 pairs: 4 standard errors


def test_d4_quantizer_is_the_nearest_point() -> None:
    lat = D4Lattice()
    x = np.random.default_rng(1).uniform(-3, 3, size=(3000, 4))
    q = lat.quantize(x.copy())
    assert np.all(lat.contains(q.astype(np.int64)))
    # Brute force over all D4 points within one step of floor(x) in every coordinate.
    base = np.floor(x)
    best = np.full(x.shape[0], np.inf)
    for off in itertools.product(range(-1, 3), repeat=4):
        cand = base + np.array(off)
        ok = np.remainder(cand.sum(axis=1), 2) == 0
        d = np.where(ok, np.sum((x - cand) ** 2, axis=1), np.inf)
        best = np.minimum(best, d)
    np.testing.assert_allclose(np.sum((x - q) ** 2, axis=1), best, rtol=0, atol=1e-12)


def test_d4_dither_is_uniform_on_the_voronoi_cell() -> None:
    lat = D4Lattice()
    words = np.random.default_rng(2).integers(0, 2**64, size=(100_000, 4), dtype=np.uint64)
    v = lat.dither(words)
    a = np.sort(np.abs(v), axis=1)
    assert np.all(a[:, -1] + a[:, -2] <= 1.0)  # the 24-cell: |v_i| + |v_j| <= 1
    np.testing.assert_array_equal(lat.quantize(v.copy()), 0.0)
    # vol(ball of radius 1/sqrt 2) / vol(cell) = pi^2 / 16; also E v = 0.
    inside = int(np.sum(np.sum(v * v, axis=1) <= 0.5))
    assert stats.binomtest(inside, v.shape[0], math.pi**2 / 16).pvalue > 1e-3
    assert np.all(np.abs(v.mean(axis=0)) < 6 * 0.41 / math.sqrt(v.shape[0]))


def test_boundary_buckets_follow_the_frexp_definition() -> None:
    """The buckets read off the float bits equal ``2 (-1 - exp) + [mant < sqrt(1/2)]`` of frexp, clipped, 0 last."""
    rng = np.random.default_rng(6)
    edges = 2.0 ** -(np.arange(120) / 2)
    delta = np.concatenate([edges, rng.uniform(0, 0.5, 100_000), [0.0, 5e-324, 7 * 5e-324, 2.0**-1022]])
    delta = np.concatenate([delta, np.nextafter(delta, 0), np.nextafter(delta, 1)])
    delta = delta[(delta >= 0) & (delta <= 0.5)]
    mant, exp = np.frexp(delta)
    expected = np.clip(2 * (-1 - exp.astype(np.int64)) + (mant < math.sqrt(0.5)), 0, N_BUCKETS - 1)
    expected[delta == 0] = N_BUCKETS - 1
    np.testing.assert_array_equal(boundary_buckets(delta), expected)


def test_integer_dither_is_exact_dyadic_in_half_open_cube() -> None:
    words = np.array([[0, 2**64 - 1, 2**63, 2**11]], dtype=np.uint64)
    v = IntegerLattice(4).dither(words)
    np.testing.assert_array_equal(v, [[-0.5, 0.5 - 2**-53, 0.0, -0.5 + 2**-53]])


# --- shared randomness and the mechanism ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "codec",
    [LRSUQCodec(), LRSUQCodec(lattice="D4"), LRSUQCodec(block_size=1), LRSUQCodec(block_size=3)],
    ids=["Z4", "D4", "Z1", "Z3"],
)
def test_decoder_regenerates_the_encoders_dithers_and_error_lies_in_the_ball(codec: LRSUQCodec) -> None:
    b, n = codec.block_size, 3000
    key = release_key(11, 3, 7)
    u = unit_vector(n * b, 0).reshape(n, b)
    k, m, v = codec.encode_blocks(u, key=key, sigma=SIGMA)
    np.testing.assert_array_equal(codec.dithers_at(key, k, k), v)  # bit for bit
    y = codec.decode_blocks(k, m, key=key, sigma=SIGMA)
    rho = codec.radius(key, SIGMA, n)
    assert np.all(np.linalg.norm(y - u, axis=1) <= rho * (1 + 1e-12))
    assert np.all(codec.lattice.contains(m))


def test_key_stream_is_rfc8439_chacha20_read_front_to_back() -> None:
    # RFC 8439, appendix A.1, test vector 1: all-zero key and nonce, block counter 0.
    expected = (
        "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
        "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586"
    )
    assert KeyStream(0).words(8).tobytes().hex() == expected
    stream, whole = KeyStream(derive_key(3, "x")), KeyStream(derive_key(3, "x")).words(1000)
    pieces = [stream.words(c) for c in (1, 0, 7, 300, 692)]  # reads continue where the last one stopped
    np.testing.assert_array_equal(np.concatenate(pieces), whole)
    assert not np.array_equal(KeyStream(derive_key(3, "y")).words(1000), whole)


@pytest.mark.parametrize("b", [1, 3, 4])
def test_radius_follows_the_documented_stream_layout(b: int) -> None:
    """Reference from the raw words (docs/codecs.md): (b + 2) // 2 uniforms per block, block-major, then for odd b
    one Box-Muller pair per two blocks (cosine to the first, sine to the second; the last block of an odd count
    takes the cosine of a pair of its own)."""
    n, key = 7, release_key(2, 3, 4)
    half = (b + 2) // 2
    u = [(int(w >> 12) + 0.5) * 2.0**-52 for w in KeyStream(derive_key(key, "lrsuq", "radius")).words(8 * half + 8)]
    chi2 = [-2.0 * math.log(math.prod(u[i * half : (i + 1) * half])) for i in range(n)]
    if b % 2:
        for i in range(n):
            r2, angle = -2.0 * math.log(u[n * half + 2 * (i // 2)]), 0.5 * math.pi * u[n * half + 2 * (i // 2) + 1]
            chi2[i] += r2 * (math.cos(angle) if i % 2 == 0 else math.sin(angle)) ** 2
    np.testing.assert_allclose(LRSUQCodec(block_size=b).radius(key, 1.0, n), np.sqrt(chi2), rtol=1e-12)


@pytest.mark.parametrize(
    "codec", [LRSUQCodec(), LRSUQCodec(lattice="D4"), LRSUQCodec(block_size=3)], ids=["Z4", "D4", "Z3"]
)
def test_encoder_follows_the_documented_stream_layout(codec: LRSUQCodec) -> None:
    """A per-block reference encoder on the raw dither words (docs/codecs.md): iteration j's rows of b words follow
    those of iterations 1..j-1, one per block still unaccepted before iteration j, in block order."""
    b, n, key = codec.block_size, 300, release_key(8, 1, 2)
    u = unit_vector(n * b, 5).reshape(n, b)
    k, m, v = codec.encode_blocks(u, key=key, sigma=SIGMA)
    x = u / (codec.radius(key, SIGMA, n) * codec.cell_scale())[:, None]
    words = KeyStream(derive_key(key, "lrsuq", "dither")).words(b * int(k.sum())).reshape(-1, b)
    row, j, active, ref_k = 0, 0, list(range(n)), np.zeros(n, dtype=np.int64)
    while active:
        j, still = j + 1, []
        for i in active:
            vi = codec.lattice.dither(words[row : row + 1])[0]
            mi = codec.lattice.quantize((x[i] - vi)[None])[0]
            row += 1
            if np.sum((mi + vi - x[i]) ** 2) <= codec.cell_scale() ** -2:
                ref_k[i] = j
                np.testing.assert_array_equal(m[i], mi)
                np.testing.assert_array_equal(v[i], vi)
            else:
                still.append(i)
        active = still
    np.testing.assert_array_equal(ref_k, k)
    assert row == k.sum()  # every row of the stream up to the last accepted one was used, once


def test_drawing_fewer_dithers_ahead_changes_nothing() -> None:
    """The encoder's draw-ahead is only a read size: a release that outruns it reads on in the same stream."""

    class Short(LRSUQCodec):
        def rows_ahead(self, n_active: int) -> int:
            return 1 + n_active // 5

    u, key = unit_vector(4096, 6), release_key(6, 0, 1)
    assert Short(coder="ans").encode(u, key=key, sigma=SIGMA) == LRSUQCodec(coder="ans").encode(u, key=key, sigma=SIGMA)


def test_release_keys_are_distinct_and_deterministic() -> None:
    keys = {release_key(9, c, r) for c in range(20) for r in range(50)}
    assert len(keys) == 1000
    assert release_key(9, 1, 2) == derive_key(9, "release", 1, 2)
    assert max(keys) >= 2**128  # 256-bit keys, not 63-bit seeds (all 1,000 below 2^128: probability 2^-128000)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"coder": "ans"},
        {"lattice": "D4"},
        {"lattice": "D4", "coder": "ans"},
        {"block_size": 3},
        {"block_size": 8},
    ],
)
def test_bitstream_roundtrip_is_exact_and_deterministic(options: dict) -> None:
    codec = get_codec("lrsuq", **options)
    u = unit_vector(1001, 1)  # not a multiple of the block size
    key = release_key(1, 2, 3)
    msg = codec.encode(u, key=key, sigma=SIGMA)
    assert codec.encode(u, key=key, sigma=SIGMA) == msg
    y = codec.decode(msg, key=key, sigma=SIGMA, dim=u.size)
    assert y.shape == (1001,) and y.dtype == np.float64
    np.testing.assert_array_equal(codec.decode(msg, key=key, sigma=SIGMA, dim=u.size), y)
    # Re-encoding the decoded indices gives the same payload: the format is canonical.
    k, m, v = codec.decode_indices(msg, key=key, sigma=SIGMA, dim=u.size)
    if v is None:
        v = codec.decoder_dithers(key, k)
    assert codec.coder.encode(k, m, v) == msg[22:-4]
    assert codec.encode(u, key=release_key(1, 2, 4), sigma=SIGMA) != msg


INPUTS = {
    "unit": unit_vector(4096, 2),
    "huge": np.random.default_rng(3).choice([-1e3, 1e3], 4096) * SIGMA,  # |M| ~ 200: escapes
    "mixed": np.concatenate([np.zeros(1000), np.full(1000, 3 * SIGMA), unit_vector(2096, 4) * 40]),
}


@pytest.mark.parametrize("lattice,block_size", [("Z", 4), ("D4", 4), ("Z", 1), ("Z", 3)])
@pytest.mark.parametrize("inputs", list(INPUTS))
def test_ans_and_elias_decode_to_the_same_vector(lattice: str, block_size: int, inputs: str) -> None:
    u = INPUTS[inputs]
    key = release_key(3, 0, 0)
    ys = []
    for coder in ("elias", "ans"):
        codec = get_codec("lrsuq", lattice=lattice, block_size=block_size, coder=coder)
        ys.append(codec.decode(codec.encode(u, key=key, sigma=SIGMA), key=key, sigma=SIGMA, dim=u.size))
    np.testing.assert_array_equal(ys[0], ys[1])
    assert np.max(np.abs(ys[0] - u)) < 10 * SIGMA  # |E_i| <= rho = sigma chi_{b+2}; P(chi_6 > 10) ~ 1e-19


def test_layered_is_lrsuq_with_one_coordinate_blocks() -> None:
    codec = get_codec("layered", coder="ans")
    assert codec.name == "layered" and codec.block_size == 1 and codec.law.k_max == 1
    u = unit_vector(777, 3)
    key = release_key(4, 0, 0)
    y = codec.decode(codec.encode(u, key=key, sigma=SIGMA), key=key, sigma=SIGMA, dim=u.size)
    ref = LRSUQCodec(block_size=1)
    y_ref = ref.decode(ref.encode(u, key=key, sigma=SIGMA), key=key, sigma=SIGMA, dim=u.size)
    np.testing.assert_array_equal(y, y_ref)


def test_encoder_rejects_bad_input_with_clear_errors() -> None:
    codec = LRSUQCodec()
    with pytest.raises(ValueError, match="shape"):
        codec.encode(np.zeros((2, 3)), key=1, sigma=1.0)
    with pytest.raises(ValueError, match="NaN"):
        codec.encode(np.array([1.0, np.nan]), key=1, sigma=1.0)
    with pytest.raises(ValueError, match="2\\^32 sigma"):
        codec.encode(np.array([1e12]), key=1, sigma=1.0)
    with pytest.raises(ValueError, match="sigma"):
        codec.encode(np.zeros(3), key=1, sigma=0.0)
    with pytest.raises(ValueError, match="key"):
        codec.encode(np.zeros(3), key=-1, sigma=1.0)
    with pytest.raises(TypeError, match="key"):
        codec.encode(np.zeros(3), key=1.5, sigma=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty|between"):
        codec.encode(np.zeros(0), key=1, sigma=1.0)


def test_registry_options_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("lrsuq2")
    with pytest.raises(ValueError, match="block_size"):
        get_codec("lrsuq", block_size=9)
    with pytest.raises(ValueError, match="D4"):
        get_codec("lrsuq", block_size=3, lattice="D4")
    with pytest.raises(ValueError, match="coder"):
        get_codec("lrsuq", coder="huffman")
    with pytest.raises(ValueError, match="no options"):
        get_codec("dg-fp32", coder="ans")
    with pytest.raises(ValueError, match="only the option"):
        get_codec("layered", block_size=4)
    assert get_codec("lrsuq").block_size == 4


# --- exactness: the battery and its negative controls --------------------------------------------------------
@pytest.mark.parametrize(
    "codec", [LRSUQCodec(), LRSUQCodec(lattice="D4"), LRSUQCodec(block_size=1)], ids=["Z4", "D4", "layered"]
)
def test_battery_accepts_the_real_codec(codec: LRSUQCodec) -> None:
    result = exactness_battery(codec, sigma=SIGMA, n_blocks=16384, secret=2024, alpha=ALPHA)
    assert result.passed, result.worst()
    assert result.holm_p > ALPHA
    assert len(result.pvalues) >= 39


@pytest.mark.parametrize("variant", list(BROKEN_VARIANTS), ids=lambda s: s.replace(" ", "-"))
def test_battery_rejects_every_broken_variant(variant: str) -> None:
    result = exactness_battery(BROKEN_VARIANTS[variant](), sigma=SIGMA, n_blocks=16384, secret=2024, alpha=ALPHA)
    assert result.holm_p < ALPHA, result.worst()
    assert result.rejected()


def test_battery_rejects_a_key_schedule_that_reuses_seeds() -> None:
    result = exactness_battery(LRSUQCodec(), sigma=SIGMA, n_blocks=4096, key_fn=reused_release_key, alpha=ALPHA)
    assert result.holm_p < ALPHA
    assert result.rejected() == ["releases/corr"]


def test_small_cell_passes_the_marginal_tests_and_fails_the_tail_test() -> None:
    """A 1.9 rho cell keeps plausible marginals; the tail test (and the law of K) must catch it."""
    result = exactness_battery(SmallCell(), sigma=SIGMA, n_blocks=16384, secret=2024, alpha=ALPHA)
    rejected = result.rejected()
    assert not [name for name in rejected if "/coord" in name or name.endswith("norm2")]
    assert {f"{c}/tail" for c in ("zero", "tiny", "huge", "boundary", "gaussian")} <= set(rejected)
    assert result.notes["zero/tail_count"] == 0 and result.notes["zero/tail_expected"] > 60


# --- rates (eps = 16, k = 16,384, ||u|| = 1) ----------------------------------------------------------------
def test_rates_at_eps16_beat_the_targets_and_respect_the_floor() -> None:
    k = 16384
    floor = gaussian_floor_bpc(norm=1.0, k=k, sigma=SIGMA)
    assert floor == pytest.approx(0.18, abs=0.005)
    u = unit_vector(k, 4)
    rates = {}
    for coder in ("elias", "ans"):
        codec = get_codec("lrsuq", coder=coder)
        rates[coder] = np.mean([8 * len(codec.encode(u, key=release_key(5, 0, r), sigma=SIGMA)) / k for r in range(3)])
    assert floor < rates["ans"] <= 1.1
    assert rates["ans"] < rates["elias"] <= 2.0
    # K alone costs H(K)/4 = 0.7225 bpc: the ANS coder cannot go below it (minus nothing: K is incompressible).
    assert rates["ans"] > LRSUQCodec().law.entropy_bits() / 4


def test_k_max_guard_fails_loudly_instead_of_looping() -> None:
    class NeverAccept(LRSUQCodec):
        def cell_scale(self) -> float:  # a cell far larger than the ball: acceptance probability ~ 1e-12
            return 1000.0

    with pytest.raises(CodecError, match="k_max"):
        NeverAccept().encode(np.ones(8), key=1, sigma=1.0)


# (message sha256[:32], decoded (y_0, y_1, y_2, y_9999, y . y)) since LRSUQ's streams became ChaCha20 (issue 22,
# item 5). Z^4 and D4 give the same vector with either coder (the same K and M).
_Z4 = (0.3887530279732045, -0.3253864378164673, 0.17947304245030668, 0.012217390326605047, 4.8717381233382975)
_D4 = (0.42472557225415625, -0.3141564362915722, 0.1975918334131069, 0.011962341024597466, 4.925537518896812)
_Z1 = (0.35788959461405845, -0.28624381204399, 0.1853437383905445, -0.013353063152773901, 4.719186402689692)
_Z3 = (0.4030714313252349, -0.30200146626202135, 0.225035359768642, -0.016143403298394896, 4.877416836939847)
_PINNED = {
    ("lrsuq", "elias", "Z", 4): ("cae23eadd45b974e4abbb21b3b2855b0", _Z4),
    ("lrsuq", "ans", "Z", 4): ("ecb761d4f92e75a762ad70ff97461304", _Z4),
    ("lrsuq", "elias", "D4", 4): ("b9f79243cb90804c356f796693245c71", _D4),
    ("lrsuq", "ans", "D4", 4): ("593f3f6443ca907da741fcc6dc774f6d", _D4),
    ("layered", "ans", "Z", 1): ("33c753510ba7f42b700f3307ac8e9296", _Z1),
    ("layered", "elias", "Z", 1): ("0958aaa38f58fa128607a041a6d2283e", _Z1),
    ("lrsuq", "elias", "Z", 3): ("e186c2bdeea894fd4c460caffa549cce", _Z3),
}


@pytest.mark.parametrize(("name", "coder", "lattice", "b"), list(_PINNED))
def test_messages_and_releases_are_pinned(name: str, coder: str, lattice: str, b: int) -> None:
    """For a given key and input (k = 16,384 with three coordinates far beyond sigma, so escapes are coded too), the
    message bytes are pinned exactly and the decoded vector to 1e-12.

    Decoding is exact IEEE arithmetic on the stream's integers except the radius, whose log (and cos, odd b) come
    from the machine's math library, which may differ by an ulp between machines; ``y = beta (M + V_K)`` then moves
    by about 1e-16 relative, hence the tolerance. The message depends on the radius only through ``u / beta`` in
    the acceptance tests and the quantiser, which an ulp flips with probability about 1e-11 per release: it is
    pinned bit for bit."""
    import hashlib

    u = np.random.default_rng(3).standard_normal(16384)
    u /= np.linalg.norm(u)
    u[:3] = [0.4, -0.3, 0.2]
    options = (
        {"coder": coder} | ({"lattice": lattice} if lattice != "Z" else {}) | ({"block_size": 3} if b == 3 else {})
    )
    codec = get_codec(name, **options)
    key = release_key(11, 5, 9)
    msg = codec.encode(u, key=key, sigma=0.01468)
    y = codec.decode(msg, key=key, sigma=0.01468, dim=16384)
    digest, decoded = _PINNED[(name, coder, lattice, b)]
    assert hashlib.sha256(msg).hexdigest()[:32] == digest
    np.testing.assert_allclose([y[0], y[1], y[2], y[9999], y @ y], decoded, rtol=1e-12, atol=0)


@pytest.mark.parametrize("coder", ["ans", "elias"])
def test_a_codec_sent_to_a_worker_process_writes_and_reads_the_same_bytes(coder: str) -> None:
    codec = LRSUQCodec(coder=coder)
    copy = pickle.loads(pickle.dumps(codec))  # how the worker processes (fl/workers.py) receive a method's codec
    u = np.random.default_rng(3).normal(size=1000) / math.sqrt(1000)
    key = release_key(7, 1, 2)
    msg = codec.encode(u, key=key, sigma=SIGMA)
    assert copy.encode(u, key=key, sigma=SIGMA) == msg
    np.testing.assert_array_equal(
        copy.decode(msg, key=key, sigma=SIGMA, dim=u.size), codec.decode(msg, key=key, sigma=SIGMA, dim=u.size)
    )
