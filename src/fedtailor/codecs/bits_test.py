"""Bit packing and Elias-gamma groups: exact round trips, exact lengths, strict reading."""

from __future__ import annotations

import numpy as np
import pytest

from fedtailor.codecs.base import CodecError
from fedtailor.codecs.bits import MAX_GAMMA, BitReader, BitWriter, bit_lengths, gamma_bits, unzigzag, zigzag


def classic_gamma(x: int) -> str:
    """Elias's gamma code of one integer as a bit string (independent reference)."""
    binary = bin(x)[2:]
    return "0" * (len(binary) - 1) + binary


def test_single_value_groups_equal_the_classic_gamma_code() -> None:
    for x in [1, 2, 3, 4, 5, 7, 8, 255, 256, 1000, 2**40 + 3, MAX_GAMMA]:
        w = BitWriter()
        w.gamma(np.array([x]))
        bits = np.unpackbits(np.frombuffer(w.getvalue(), dtype=np.uint8))
        code = classic_gamma(x)
        assert "".join(map(str, bits[: len(code)])) == code
        assert not bits[len(code) :].any()


def test_group_roundtrip_and_length_match_gamma() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.geometric(0.3, 5000), rng.integers(1, 2**52, 300), [1, MAX_GAMMA]])
    w = BitWriter()
    w.gamma(x)
    w.bits(np.array([1, 0, 1]))
    w.gamma(x[::-1])
    data = w.getvalue()
    assert len(data) == (2 * gamma_bits(x) + 3 + 7) // 8
    assert gamma_bits(x) == sum(len(classic_gamma(int(v))) for v in x)
    r = BitReader(data)
    np.testing.assert_array_equal(r.gamma(x.size), x)
    np.testing.assert_array_equal(r.bits(3), [1, 0, 1])
    np.testing.assert_array_equal(r.gamma(x.size), x[::-1])
    r.finish()


def test_bit_lengths_exact_at_powers_of_two() -> None:
    p = np.array([2**i for i in range(53)] + [2**i - 1 for i in range(1, 53)], dtype=np.int64)
    expected = np.array(list(range(53)) + [i - 1 for i in range(1, 53)])
    np.testing.assert_array_equal(bit_lengths(p), expected)


def test_zigzag_is_a_bijection() -> None:
    m = np.arange(-1000, 1001)
    z = zigzag(m)
    assert sorted(z.tolist()) == list(range(2001))
    np.testing.assert_array_equal(unzigzag(z), m)
    np.testing.assert_array_equal(zigzag(np.array([0, -1, 1, -2, 2])), [0, 1, 2, 3, 4])


def test_writer_rejects_values_outside_the_code() -> None:
    with pytest.raises(ValueError, match="gamma codes need integers"):
        BitWriter().gamma(np.array([0]))
    with pytest.raises(ValueError, match="gamma codes need integers"):
        BitWriter().gamma(np.array([MAX_GAMMA + 1]))


def test_reader_errors_are_codec_errors() -> None:
    w = BitWriter()
    w.gamma(np.array([5, 9, 1000]))
    data = w.getvalue()
    with pytest.raises(CodecError, match="truncated"):
        BitReader(data).gamma(4)
    with pytest.raises(CodecError, match="truncated"):
        BitReader(data[:1]).gamma(3)
    with pytest.raises(CodecError, match="exceeds"):
        BitReader(data).gamma(3, limit=999)
    with pytest.raises(CodecError, match="too long"):
        BitReader(bytes(8) + b"\xff").gamma(1, limit=2**20)
    r = BitReader(data + b"\x00")
    r.gamma(3)
    with pytest.raises(CodecError, match="trailing"):
        r.finish()
    r = BitReader(bytes([0b10000001]))
    r.bits(1)
    with pytest.raises(CodecError, match="padding"):
        r.finish()
