"""The index codes of PPR: bit-exact round trips, the adaptive model's length against the empirical entropy, and
hostile payloads rejected."""

from __future__ import annotations

import numpy as np
import pytest

from fedtailor.codecs.base import CodecError
from fedtailor.codecs.bits import BitWriter, bit_lengths, gamma_bits
from fedtailor.codecs.index_code import _ans_words, decode_indices, encode_indices, heads

LIMIT = 2**24


def ppr_like(n: int, seed: int, spread: float = 3.0) -> np.ndarray:
    """Indices shaped like PPR's at large blocks: the exponent floor(log2 K) roughly Poisson with mean ``spread``
    (flat over the first few octaves, then falling), K uniform on its octave."""
    rng = np.random.default_rng(seed)
    m = np.minimum(rng.poisson(spread, n), 23)
    return (np.int64(1) << m) + (rng.random(n) * (np.int64(1) << m)).astype(np.int64)


@pytest.mark.parametrize("coder", ["ans", "elias"])
@pytest.mark.parametrize(
    "k",
    [
        np.ones(1000, dtype=np.int64),
        np.array([1], dtype=np.int64),
        np.array([LIMIT], dtype=np.int64),
        np.array([1, 2, 3, LIMIT - 1, 7], dtype=np.int64),
        ppr_like(1024, 0),
        ppr_like(4097, 1, spread=0.5),
    ],
    ids=["ones", "single", "limit", "mixed", "ppr-like", "odd-count"],
)
def test_round_trip_is_bit_exact(coder: str, k: np.ndarray) -> None:
    payload = encode_indices(k, coder)
    assert np.array_equal(decode_indices(payload, k.size, coder, limit=LIMIT), k)
    if coder == "elias":
        assert len(payload) == -(-gamma_bits(k) // 8)


def test_ans_comes_within_a_learning_cost_of_the_exponents_empirical_entropy() -> None:
    """The heads (exponent and first low bit) cost at most n H(head) + A (log2 n + 2) / 2 bits (A = 2M + 1 symbols:
    the adaptive model's learning cost), the rest exactly sum max(m_j - 1, 0) raw bits; with spread exponents
    that is well under gamma's unary prefixes. A model that did not adapt (flat over the A symbols) would pay
    n log2 A and fail the bound."""
    k = ppr_like(2048, 3)
    symbols, below = heads(k)
    p = np.bincount(symbols) / symbols.size
    entropy = -np.sum(p[p > 0] * np.log2(p[p > 0]))
    bits = 8 * len(encode_indices(k, "ans"))
    alphabet = 2 * bit_lengths(k).max() + 1
    learning = alphabet * (np.log2(k.size) + 2) / 2
    assert bits <= k.size * entropy + below.sum() + learning + 64
    assert bits < 0.9 * gamma_bits(k)
    assert k.size * np.log2(alphabet) > k.size * entropy + learning  # the bound separates a flat model


def test_hostile_payloads_are_rejected() -> None:
    k = ppr_like(512, 5)
    payload = encode_indices(k, "ans")
    bad = {
        "truncated": payload[:-3],
        "extra word": payload + bytes(4),
        "flipped word": payload[:-1] + bytes([payload[-1] ^ 0x10]),
        "flipped low bit": bytes([payload[0], payload[1] ^ 0x01]) + payload[2:],
        "empty": b"",
    }
    for name, data in bad.items():
        with pytest.raises(CodecError):
            decode_indices(data, k.size, "ans", limit=LIMIT)
            pytest.fail(f"{name} accepted")
    with pytest.raises(CodecError):
        decode_indices(encode_indices(np.array([LIMIT]), "ans"), 1, "ans", limit=LIMIT - 1)
    # the same heads announced with a larger exponent than any index has: decodable, but not the canonical form
    symbols, below = heads(k)
    top = int(bit_lengths(k).max()) + 1
    words = _ans_words(symbols, 2 * top + 1)
    writer = BitWriter()
    writer.gamma(np.array([top + 1, words.size + 1]))
    writer.low_bits(k & ((np.int64(1) << below) - 1), below)
    with pytest.raises(CodecError, match="canonical"):
        decode_indices(writer.getvalue() + words.astype("<u4").tobytes(), k.size, "ans", limit=LIMIT)
