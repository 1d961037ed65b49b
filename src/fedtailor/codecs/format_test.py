"""Robustness of decoding: every bad message raises CodecError with a clear message; never a crash, hang or
silently wrong vector. Includes property-based fuzzing with hypothesis."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedtailor.codecs import CodecError, get_codec, release_key
from fedtailor.codecs.bits import BitWriter, zigzag
from fedtailor.codecs.format import FRAME_BYTES, HEADER_BYTES, MAGIC, seal

SIGMA = 0.01468
DIM = 37  # not a multiple of the block size
KEY = release_key(77, 1, 2)
SPECS = {
    "dg-fp32": ("dg-fp32", {}),
    "dg-q12": ("dg-q12", {}),
    "layered": ("layered", {}),
    "layered-ans": ("layered", {"coder": "ans"}),
    "lrsuq": ("lrsuq", {}),
    "lrsuq-ans": ("lrsuq", {"coder": "ans"}),
    "lrsuq-d4": ("lrsuq", {"lattice": "D4"}),
    "lrsuq-d4-ans": ("lrsuq", {"lattice": "D4", "coder": "ans"}),
}
CODECS = {name: get_codec(n, **o) for name, (n, o) in SPECS.items()}
U = np.random.default_rng(0).normal(0, 0.02, DIM)
MESSAGES = {name: c.encode(U, key=KEY, sigma=SIGMA) for name, c in CODECS.items()}
DECODED = {name: CODECS[name].decode(MESSAGES[name], key=KEY, sigma=SIGMA, dim=DIM) for name in CODECS}


def reseal(codec, payload: bytes, *, dim: int = DIM) -> bytes:
    """A message with a valid frame and checksum around an arbitrary payload (what a hostile sender can do)."""
    return seal(codec.frame, dim=dim, key=KEY, sigma=SIGMA, payload=payload)


def payload_of(message: bytes) -> bytes:
    return message[HEADER_BYTES:-4]


def check_decode(name: str, message: bytes) -> None:
    """The fuzz property: CodecError, or a finite float64 vector of the right shape (the original if unchanged)."""
    try:
        y = CODECS[name].decode(message, key=KEY, sigma=SIGMA, dim=DIM)
    except CodecError:
        return
    assert y.shape == (DIM,) and y.dtype == np.float64 and np.all(np.isfinite(y))
    if message == MESSAGES[name]:
        np.testing.assert_array_equal(y, DECODED[name])


@pytest.mark.parametrize("name", list(CODECS))
def test_every_truncation_is_rejected(name: str) -> None:
    msg = MESSAGES[name]
    for cut in range(len(msg)):
        with pytest.raises(CodecError, match="truncated|corrupted"):
            CODECS[name].decode(msg[:cut], key=KEY, sigma=SIGMA, dim=DIM)


@pytest.mark.parametrize("name", list(CODECS))
def test_every_single_bit_flip_is_rejected(name: str) -> None:
    msg = bytearray(MESSAGES[name])
    for bit in range(8 * len(msg)):
        msg[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CodecError):
            CODECS[name].decode(bytes(msg), key=KEY, sigma=SIGMA, dim=DIM)
        msg[bit // 8] ^= 1 << (bit % 8)


@pytest.mark.parametrize("name", list(CODECS))
def test_mismatched_parameters_are_rejected(name: str) -> None:
    codec, msg = CODECS[name], MESSAGES[name]
    with pytest.raises(CodecError, match="key, sigma or codec options"):
        codec.decode(msg, key=release_key(77, 1, 3), sigma=SIGMA, dim=DIM)
    with pytest.raises(CodecError, match="key, sigma or codec options"):
        codec.decode(msg, key=KEY, sigma=SIGMA * 1.0000001, dim=DIM)
    with pytest.raises(CodecError, match="dimension mismatch"):
        codec.decode(msg, key=KEY, sigma=SIGMA, dim=DIM + 1)
    with pytest.raises(CodecError, match="trailing"):
        codec.decode(msg + b"\x00", key=KEY, sigma=SIGMA, dim=DIM)
    with pytest.raises(CodecError, match="dim must"):
        codec.decode(msg, key=KEY, sigma=SIGMA, dim=0)
    with pytest.raises(CodecError, match="sigma must"):
        codec.decode(msg, key=KEY, sigma=-1.0, dim=DIM)
    with pytest.raises(CodecError, match="must be bytes"):
        codec.decode("not bytes", key=KEY, sigma=SIGMA, dim=DIM)  # type: ignore[arg-type]


def test_messages_of_another_codec_are_rejected_by_name() -> None:
    for a, b in [
        ("lrsuq", "layered"),
        ("lrsuq", "lrsuq-ans"),
        ("lrsuq", "lrsuq-d4"),
        ("dg-fp32", "dg-q12"),
        ("dg-q12", "lrsuq"),
        ("layered", "lrsuq-d4-ans"),
    ]:
        with pytest.raises(CodecError, match="another codec"):
            CODECS[b].decode(MESSAGES[a], key=KEY, sigma=SIGMA, dim=DIM)
    other_block = get_codec("lrsuq", block_size=3)
    with pytest.raises(CodecError, match="block size 4"):
        other_block.decode(MESSAGES["lrsuq"], key=KEY, sigma=SIGMA, dim=DIM)


def test_foreign_magic_version_and_flags_are_rejected() -> None:
    msg = MESSAGES["lrsuq"]

    def patched(offset: int, value: bytes) -> bytes:
        body = bytearray(msg[:-4])
        body[offset : offset + len(value)] = value
        return bytes(body) + struct.pack("<I", zlib.crc32(bytes(body)))

    codec = CODECS["lrsuq"]
    with pytest.raises(CodecError, match="not a fedtailor codec message"):
        codec.decode(patched(0, b"PK\x03\x04"), key=KEY, sigma=SIGMA, dim=DIM)
    with pytest.raises(CodecError, match="version 1"):
        codec.decode(patched(4, b"\x01"), key=KEY, sigma=SIGMA, dim=DIM)
    with pytest.raises(CodecError, match="flags"):
        codec.decode(patched(9, b"\x01"), key=KEY, sigma=SIGMA, dim=DIM)
    assert msg[:4] == MAGIC and len(msg) > FRAME_BYTES


def test_hostile_iteration_counts_are_capped() -> None:
    codec = CODECS["lrsuq"]
    n = -(-DIM // 4)
    k_max = codec.law.k_max

    def elias_payload(k: np.ndarray) -> bytes:
        w = BitWriter()
        w.gamma(k)
        w.gamma(np.array([1]))  # no non-zero M block
        return w.getvalue()

    with pytest.raises(CodecError, match=f"bound {k_max}"):
        codec.decode(reseal(codec, elias_payload(np.full(n, k_max + 1))), key=KEY, sigma=SIGMA, dim=DIM)
    # K = k_max everywhere is a valid (if absurdly unlikely) message: decoding is bounded and exact in shape.
    big = get_codec("lrsuq")
    dim = 4 * 4096
    w = BitWriter()
    w.gamma(np.full(4096, k_max))
    w.gamma(np.array([1]))
    y = big.decode(seal(big.frame, dim=dim, key=KEY, sigma=SIGMA, payload=w.getvalue()), key=KEY, sigma=SIGMA, dim=dim)
    assert y.shape == (dim,)  # completes: at most k_max dither arrays are drawn, whatever the message says
    assert np.all(np.abs(y) <= 0.5 * 2 * codec.radius(KEY, SIGMA, 4096).repeat(4) + 1e-12)


def test_hostile_lattice_indices_are_rejected() -> None:
    n = -(-DIM // 4)

    def elias_payload(codec, m_block: list[int], k_value: int = 1) -> bytes:
        w = BitWriter()
        w.gamma(np.full(n, k_value))
        w.gamma(np.array([2]))  # one non-zero block
        w.gamma(np.array([1]))  # ... the first
        w.gamma(zigzag(np.array(m_block)) + 1)
        return w.getvalue()

    d4 = CODECS["lrsuq-d4"]
    with pytest.raises(CodecError, match="D4 lattice"):
        d4.decode(reseal(d4, elias_payload(d4, [1, 0, 0, 0])), key=KEY, sigma=SIGMA, dim=DIM)
    assert d4.decode(reseal(d4, elias_payload(d4, [1, 1, 0, 0])), key=KEY, sigma=SIGMA, dim=DIM).shape == (DIM,)
    z4 = CODECS["lrsuq"]
    with pytest.raises(CodecError, match="canonical"):
        z4.decode(reseal(z4, elias_payload(z4, [0, 0, 0, 0])), key=KEY, sigma=SIGMA, dim=DIM)
    with pytest.raises(CodecError, match="exceeds"):
        z4.decode(reseal(z4, elias_payload(z4, [2**51, 0, 0, 0])), key=KEY, sigma=SIGMA, dim=DIM)


@pytest.mark.parametrize("name", ["lrsuq-ans", "layered-ans", "lrsuq-d4-ans"])
def test_ans_payload_tampering_is_rejected(name: str) -> None:
    codec, payload = CODECS[name], payload_of(MESSAGES[name])
    (nbits,) = struct.unpack_from("<I", payload)
    words = payload[4 + nbits :]
    bad = [
        payload[:4] + payload[4 : 4 + nbits] + words + b"\x01\x00\x00\x00",  # an extra ANS word
        payload[:4] + payload[4 : 4 + nbits] + words[:-4],  # a missing ANS word
        struct.pack("<I", nbits + 3) + payload[4:],  # bit section length off
        payload[:4] + payload[4 : 4 + nbits] + bytes([words[0] ^ 0x10]) + words[1:],
    ]
    for p in bad:
        with pytest.raises(CodecError):
            codec.decode(reseal(codec, p), key=KEY, sigma=SIGMA, dim=DIM)


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@FUZZ
@given(name=st.sampled_from(list(CODECS)), data=st.binary(max_size=400))
def test_fuzz_random_bytes(name: str, data: bytes) -> None:
    check_decode(name, data)
    check_decode(name, MESSAGES[name][:HEADER_BYTES] + data)


@FUZZ
@given(
    name=st.sampled_from(list(CODECS)),
    cut=st.integers(min_value=0, max_value=10_000),
    flips=st.lists(st.integers(min_value=0, max_value=80_000), max_size=4),
)
def test_fuzz_truncations_and_bit_flips(name: str, cut: int, flips: list[int]) -> None:
    msg = bytearray(MESSAGES[name][: len(MESSAGES[name]) - cut % (len(MESSAGES[name]) + 1)])
    for f in flips:
        if msg:
            msg[(f // 8) % len(msg)] ^= 1 << (f % 8)
    check_decode(name, bytes(msg))


@FUZZ
@given(
    name=st.sampled_from(list(CODECS)),
    cut=st.integers(min_value=0, max_value=10_000),
    flips=st.lists(st.integers(min_value=0, max_value=80_000), max_size=4),
    extra=st.binary(max_size=8),
)
def test_fuzz_payloads_behind_a_valid_frame(name: str, cut: int, flips: list[int], extra: bytes) -> None:
    """The frame and CRC are valid (a hostile or buggy sender): the payload parsers must still hold."""
    payload = bytearray(payload_of(MESSAGES[name]))
    payload = payload[: len(payload) - cut % (len(payload) + 1)]
    for f in flips:
        if payload:
            payload[(f // 8) % len(payload)] ^= 1 << (f % 8)
    check_decode(name, reseal(CODECS[name], bytes(payload) + extra))
