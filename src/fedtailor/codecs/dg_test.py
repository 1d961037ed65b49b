"""Direct Gaussian baselines: the noise law, the message sizes, the 12-bit quantiser's error bound."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from fedtailor.codecs import CodecError, get_codec, release_key
from fedtailor.codecs.dg import gaussian_noise, pack12, unpack12
from fedtailor.codecs.format import FRAME_BYTES, seal

SIGMA = 0.01468


def test_dg_fp32_releases_u_plus_gaussian_noise_in_float32() -> None:
    codec = get_codec("dg-fp32")
    d = 50_000
    u = np.linspace(-1, 1, d)
    key = release_key(1, 2, 3)
    msg = codec.encode(u, key=key, sigma=SIGMA)
    assert len(msg) == 4 * d + FRAME_BYTES
    y = codec.decode(msg, key=key, sigma=SIGMA, dim=d)
    np.testing.assert_array_equal(y, (u + gaussian_noise(key, SIGMA, d)).astype(np.float32))
    # KS against N(0, sigma^2) with n = 50,000 (float32 rounding, <= 6e-8 here, is far below its resolution).
    assert stats.kstest(y - u, stats.norm(0, SIGMA).cdf).pvalue > 1e-3
    assert codec.encode(u, key=release_key(1, 2, 4), sigma=SIGMA) != msg


def test_dg_q12_size_and_error_bound() -> None:
    codec = get_codec("dg-q12")
    for d in (1, 2, 3, 1001, 16384):
        u = np.random.default_rng(d).normal(0, 0.01, d)
        key = release_key(5, 0, d)
        msg = codec.encode(u, key=key, sigma=SIGMA)
        assert len(msg) == FRAME_BYTES + 16 + (12 * d + 7) // 8
        y = codec.decode(msg, key=key, sigma=SIGMA, dim=d)
        noisy = u + gaussian_noise(key, SIGMA, d)
        step = (noisy.max() - noisy.min()) / 4095
        assert np.all(np.abs(y - noisy) <= step / 2 * (1 + 1e-9) + 1e-15)
        assert y.min() == pytest.approx(noisy.min()) and y.max() == pytest.approx(noisy.max())
    assert 8 * len(msg) / 16384 == pytest.approx(12.0 + 8 * (FRAME_BYTES + 16) / 16384)


@pytest.mark.parametrize("n", [1, 2, 5, 64, 999])
def test_pack12_roundtrip(n: int) -> None:
    q = np.random.default_rng(n).integers(0, 4096, n).astype(np.uint16)
    data = pack12(q)
    assert len(data) == (12 * n + 7) // 8
    np.testing.assert_array_equal(unpack12(data, n), q)
    if n % 2:
        with pytest.raises(CodecError, match="padding"):
            unpack12(data[:-1] + bytes([data[-1] | 1]), n)


def test_dg_q12_rejects_a_reversed_range() -> None:
    codec = get_codec("dg-q12")
    key = release_key(5, 1, 1)
    msg = codec.encode(np.zeros(4), key=key, sigma=SIGMA)
    payload = bytearray(msg[22:-4])
    payload[:16] = np.array([1.0, -1.0]).tobytes()
    bad = seal(codec.frame, dim=4, key=key, sigma=SIGMA, payload=bytes(payload))
    with pytest.raises(CodecError, match="finite interval"):
        codec.decode(bad, key=key, sigma=SIGMA, dim=4)
