"""The versioned message frame shared by all codecs (docs/codecs.md, "Message format").

Layout, little-endian::

    offset size field
    0      4    magic  b"FTQ\\x00"
    4      1    version (1)
    5      1    codec id        (1 dg-fp32, 2 dg-q12, 3 lrsuq/layered, 4 ppr)
    6      1    lattice id      (0 none, 1 Z^b, 2 D4)
    7      1    coder id        (0 raw, 1 Elias-gamma, 2 ANS)
    8      1    block size b    (1..8 LRSUQ, 1..32 PPR; 0 for the dense codecs)
    9      1    flags           (0; reserved)
    10     4    dim d
    14     4    tag             (32 bits of derive_seed(key, "codec-tag", codec, sigma[, options]): detects a mismatch)
    18     4    payload length n
    22     n    payload
    22+n   4    CRC32 of bytes [0, 22+n)

The frame costs 26 bytes = 208 bits per release (0.0127 bits per coefficient at d = 16,384).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from fedtailor.codecs.base import CodecError
from fedtailor.rng import derive_seed

MAGIC = b"FTQ\x00"
VERSION = 2  # 2: LRSUQ's shared randomness from ChaCha20 keystreams (1: SHAKE-256)
_HEADER = struct.Struct("<4sBBBBBBIII")
HEADER_BYTES = _HEADER.size
FRAME_BYTES = HEADER_BYTES + 4

CODEC_NAMES = {1: "dg-fp32", 2: "dg-q12", 3: "lrsuq", 4: "ppr"}
LATTICE_NAMES = {0: "none", 1: "Z", 2: "D4"}
CODER_NAMES = {0: "raw", 1: "elias", 2: "ans"}


@dataclass(frozen=True)
class Frame:
    """The fields of a header that a codec fixes (everything but the payload)."""

    codec_id: int
    lattice_id: int
    coder_id: int
    block_size: int

    def describe(self) -> str:
        return (
            f"codec {CODEC_NAMES.get(self.codec_id, self.codec_id)}, lattice "
            f"{LATTICE_NAMES.get(self.lattice_id, self.lattice_id)}, "
            f"coder {CODER_NAMES.get(self.coder_id, self.coder_id)}, "
            f"block size {self.block_size}"
        )


def key_tag(key: int, sigma: float, codec_id: int, params: str = "") -> int:
    """32-bit check value binding a message to its key and sigma, and to the codec's ``params`` where it has any
    beyond the frame (PPR: alpha, clip, spread); a one-way hash: it does not reveal the key."""
    extra = (params,) if params else ()
    return derive_seed(key, "codec-tag", codec_id, float(sigma).hex(), *extra) & 0xFFFFFFFF


def seal(frame: Frame, *, dim: int, key: int, sigma: float, payload: bytes, params: str = "") -> bytes:
    """Header + payload + CRC32."""
    head = _HEADER.pack(
        MAGIC,
        VERSION,
        frame.codec_id,
        frame.lattice_id,
        frame.coder_id,
        frame.block_size,
        0,
        dim,
        key_tag(key, sigma, frame.codec_id, params),
        len(payload),
    )
    body = head + payload
    return body + struct.pack("<I", zlib.crc32(body))


def open_message(message: bytes, frame: Frame, *, dim: int, key: int, sigma: float, params: str = "") -> bytes:
    """Validate the frame of ``message`` against what the decoder expects; return the payload."""
    if not isinstance(message, (bytes, bytearray, memoryview)):
        raise CodecError(f"message must be bytes, got {type(message).__name__}")
    message = bytes(message)
    if len(message) < FRAME_BYTES:
        raise CodecError(f"message truncated: {len(message)} bytes, a frame alone needs {FRAME_BYTES}")
    magic, version, codec_id, lattice_id, coder_id, block_size, flags, mdim, tag, n = _HEADER.unpack_from(message)
    if magic != MAGIC:
        raise CodecError(f"not a fedtailor codec message (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise CodecError(f"unsupported message version {version}; this decoder reads version {VERSION}")
    expected_len = HEADER_BYTES + n + 4
    if len(message) < expected_len:
        raise CodecError(
            f"message truncated: header announces {n} payload bytes, only {len(message) - FRAME_BYTES} present"
        )
    if len(message) > expected_len:
        raise CodecError(f"message has {len(message) - expected_len} trailing bytes after the checksum")
    (crc,) = struct.unpack_from("<I", message, HEADER_BYTES + n)
    if zlib.crc32(message[: HEADER_BYTES + n]) != crc:
        raise CodecError("message corrupted: CRC32 checksum mismatch")
    got = Frame(codec_id, lattice_id, coder_id, block_size)
    if got != frame:
        raise CodecError(f"message was written by another codec ({got.describe()}); this decoder is {frame.describe()}")
    if flags != 0:
        raise CodecError(f"unknown header flags {flags:#x}; the message needs a newer decoder")
    if mdim != dim:
        raise CodecError(f"dimension mismatch: message holds {mdim} coefficients, decoder asked for dim={dim}")
    if tag != key_tag(key, sigma, codec_id, params):
        raise CodecError(
            "key, sigma or codec options mismatch: the message was encoded with another release key, sigma or "
            "options; decode with the same release_key(secret, client, round), sigma and codec options as the encoder"
        )
    return message[HEADER_BYTES : HEADER_BYTES + n]


_PAD_HEADER = struct.Struct("<4sI")
PAD_MAGIC = b"FTP\x00"


def pad(message: bytes, *, size: int) -> bytes:
    """``message`` padded with zero bytes to exactly ``size`` bytes (8 bytes of header: magic, true length).

    A variable-length release whose size would reveal something about its input is sent padded: every padded
    message of a run has the same size. A message that does not fit is refused (``ValueError``) rather than
    sent at another size."""
    if not fits(message, size=size):  # the true length is not in the text: it is a function of the input
        raise ValueError(
            f"a release does not fit the fixed message size of {size} bytes; set method.pad_bytes larger (the "
            "default comes from public probes and is exceeded with negligible probability)"
        )
    return _PAD_HEADER.pack(PAD_MAGIC, len(message)) + message + bytes(size - _PAD_HEADER.size - len(message))


def fits(message: bytes, *, size: int) -> bool:
    """Whether ``message`` pads to ``size`` bytes."""
    return len(message) + _PAD_HEADER.size <= size


def abstention(size: int) -> bytes:
    """The fixed-size message that stands in for a release too long for ``size``: a padded empty message, of the
    same size as every other (:func:`unpad` gives ``b""``, which no codec produces)."""
    return pad(b"", size=size)


def unpad(blob: bytes, *, size: int) -> bytes:
    """Inverse of :func:`pad`; :class:`CodecError` unless ``blob`` is exactly a padded message of ``size`` bytes."""
    if not isinstance(blob, (bytes, bytearray)) or len(blob) != size:
        got = len(blob) if isinstance(blob, (bytes, bytearray)) else type(blob).__name__
        raise CodecError(f"padded message must have exactly {size} bytes, got {got}")
    magic, length = _PAD_HEADER.unpack_from(blob)
    if magic != PAD_MAGIC or length > size - _PAD_HEADER.size:
        raise CodecError("not a padded message (bad magic or length)")
    end = _PAD_HEADER.size + length
    if any(blob[end:]):
        raise CodecError("padding bytes are not zero")
    return bytes(blob[_PAD_HEADER.size : end])
