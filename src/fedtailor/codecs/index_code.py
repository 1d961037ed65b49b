"""Codes for the indices ``K_1, ..., K_n >= 1`` of one PPR release (one per block), chosen by the codec's ``coder``.

* ``elias``: an Elias-gamma group (:mod:`fedtailor.codecs.bits`): ``2 m_j + 1`` bits a block, where
  ``m_j = floor(log2 K_j)``; universal, no model.
* ``ans`` (the default): ``K_j = 2^m_j + l_j`` with ``0 <= l_j < 2^m_j``. The exponents ``m_j`` are coded by ANS
  (``constriction``) with an adaptive model: the blocks are cut into chunks (16, 16, 32, 64, ... blocks, doubling)
  and chunk ``c``'s exponents are coded with the law ``P(m) ∝ 1/2 + #{j in chunks before c : m_j = m}`` over
  ``{0, ..., M}`` (Krichevsky-Trofimov counts; ``M = max_j m_j`` is sent), so the model is learnt from the release
  itself, costs no header and is formed from integers on both sides (bit-identical on any IEEE-754 machine). The
  low parts ``l_j`` follow as raw ``m_j``-bit fields: given ``m_j`` a PPR index is close to uniform on its octave.

Why: gamma spends ``m_j + 1`` bits on the exponent, a unary code; at b = 16 the exponent's entropy is about
2.9 bits against gamma's 3.8 (``docs/codecs.md``, "The index code"), and the gap grows with the block size. The
message is a deterministic function of ``K`` in both codes, so the index's privacy against the decoder (alpha) is
unchanged (post-processing).

Layout of ``ans``: a bit section (gamma codes of ``M + 1`` and of ``W + 1``, ``W`` the number of 32-bit ANS words;
then every ``l_j``; zero-padded to a byte) followed by the ``W`` words, little-endian. A decoder accepts only the
canonical form (the words a fresh encoding of the decoded exponents gives, no bits left over).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
from constriction import stream

from fedtailor.codecs.base import CodecError
from fedtailor.codecs.bits import BitReader, BitWriter, bit_lengths

CODERS = ("ans", "elias")
#: The first chunk of blocks coded with the flat model; each later chunk doubles (at least this size).
FIRST_CHUNK = 16


def _chunks(n: int) -> list[tuple[int, int]]:
    """(start, stop) of each chunk of ``n`` blocks: 16, 16, 32, 64, ... (the last cut at ``n``)."""
    bounds, stop = [0], FIRST_CHUNK
    while bounds[-1] < n:
        bounds.append(min(stop, n))
        stop = 2 * bounds[-1]
    return list(itertools.pairwise(bounds))


def _models(symbols: np.ndarray, alphabet: int) -> Iterator[tuple[int, int, object]]:
    """The categorical model of each chunk from the counts of the chunks before it (encoder side)."""
    counts = np.full(alphabet, 0.5)
    for start, stop in _chunks(symbols.size):
        yield start, stop, stream.model.Categorical(counts.copy(), perfect=False)
        counts += np.bincount(symbols[start:stop], minlength=alphabet)


def _ans_words(m: np.ndarray, alphabet: int) -> np.ndarray:
    coder = stream.stack.AnsCoder()
    for start, stop, model in reversed(list(_models(m, alphabet))):  # ANS is a stack: the last chunk goes first
        coder.encode_reverse(m[start:stop], model)
    return coder.get_compressed()


def encode_indices(k: np.ndarray, coder: str) -> bytes:
    """The payload coding ``k`` (integers >= 1) with ``coder`` (``"ans"`` or ``"elias"``)."""
    writer = BitWriter()
    if coder == "elias":
        writer.gamma(k)
        return writer.getvalue()
    m = bit_lengths(k)
    top = int(m.max()) if m.size else 0
    words = _ans_words(m.astype(np.int32), top + 1) if top > 0 else np.zeros(0, dtype=np.uint32)
    writer.gamma(np.array([top + 1, words.size + 1]))
    writer.low_bits(k - (np.int64(1) << m), m)
    return writer.getvalue() + words.astype("<u4").tobytes()


def decode_indices(payload: bytes, count: int, coder: str, *, limit: int) -> np.ndarray:
    """``count`` indices in ``[1, limit]`` from ``payload``; :class:`CodecError` on anything malformed."""
    if coder == "elias":
        reader = BitReader(payload)
        k = reader.gamma(count, limit=limit)
        reader.finish()
        return k
    top_limit = int(limit).bit_length() - 1
    top, n_words = BitReader(payload).gamma(2, limit=max(top_limit + 1, len(payload) // 4 + 1)) - 1
    if top > top_limit:
        raise CodecError(f"index exponent {top} exceeds the bound {top_limit}")
    if 4 * n_words > len(payload):
        raise CodecError("payload truncated: fewer bytes than its ANS words")
    split = len(payload) - 4 * int(n_words)
    words = np.frombuffer(payload[split:], dtype="<u4").astype(np.uint32)
    if top == 0:
        if n_words:
            raise CodecError("payload malformed: ANS words without exponents to code")
        m = np.zeros(count, dtype=np.int64)
    else:
        m = _decode_exponents(words, count, int(top) + 1)
    reader = BitReader(payload[:split])
    reader.gamma(2, limit=max(top_limit + 1, len(payload) // 4 + 1))
    k = (np.int64(1) << m) + reader.low_bits(m)
    reader.finish()
    if k.size and k.max() > limit:
        raise CodecError(f"index {k.max()} exceeds its bound {limit}")
    return k


def _decode_exponents(words: np.ndarray, count: int, alphabet: int) -> np.ndarray:
    try:
        coder = stream.stack.AnsCoder(words)
        m = np.empty(count, dtype=np.int32)
        counts = np.full(alphabet, 0.5)
        for start, stop in _chunks(count):
            m[start:stop] = coder.decode(stream.model.Categorical(counts.copy(), perfect=False), stop - start)
            counts += np.bincount(m[start:stop], minlength=alphabet)
        empty = coder.is_empty()
    except ValueError as err:
        raise CodecError(f"ANS section invalid: {err}") from err
    if not empty:
        raise CodecError("payload corrupted: ANS data left over after the last index")
    if alphabet - 1 not in m:
        raise CodecError("payload is not in canonical form (the announced largest exponent does not occur)")
    if not np.array_equal(_ans_words(m, alphabet), words):
        raise CodecError("payload is not in canonical form (ANS words differ from a fresh encoding)")
    return m.astype(np.int64)
