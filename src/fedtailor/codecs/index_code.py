"""Codes for the indices ``K_1, ..., K_n >= 1`` of one PPR release (one per block), chosen by the codec's ``coder``.

* ``elias``: an Elias-gamma group (:mod:`fedtailor.codecs.bits`): ``2 m_j + 1`` bits a block, where
  ``m_j = floor(log2 K_j)``; universal, no model.
* ``ans`` (the default): with ``K_j = 2^m_j + l_j``, ``m_j = floor(log2 K_j)``, each index's *head* (``0`` for
  ``K_j = 1``, else ``2 m_j - 1 + t_j`` with ``t_j`` the bit below the leading one: the exponent and the first bit
  of ``l_j``) is coded by ANS (``constriction``) with an adaptive model: the blocks are cut into chunks (16, 16,
  32, 64, ... blocks, doubling) and chunk ``c``'s heads are coded with the law ``P(s) ∝ 1/2 + #{j in chunks before
  c : s_j = s}`` over ``{0, ..., 2M}`` (Krichevsky-Trofimov counts; ``M = max_j m_j`` is sent), so the model is
  learnt from the release itself, costs no header and is formed from exact half-integer counts on both sides
  (bit-identical on any IEEE-754 machine). The remaining ``m_j - 1`` bits of ``l_j`` follow raw: below its first
  bit a PPR index is close to uniform on its octave.

Why: gamma spends ``m_j + 1`` bits on the exponent, a unary code, whose excess over the exponent's entropy grows
with the block size (``docs/codecs.md``, "The index code"; ``benchmarks/bench_ppr.py`` measures both codes on the
same indices). The
message is a deterministic function of ``K`` in both codes, so the index's privacy against the decoder (alpha) is
unchanged (post-processing).

Layout of ``ans``: a bit section (gamma codes of ``M + 1`` and of ``W + 1``, ``W`` the number of 32-bit ANS words;
then every index's raw bits; zero-padded to a byte) followed by the ``W`` words, little-endian. A decoder accepts
only the canonical form (the announced ``M`` occurring, the words a fresh encoding of the decoded heads gives, no
ANS state or bits left over).
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


def heads(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ANS symbol of each index (its head: ``0`` for ``K = 1``, else ``2 m - 1 + t``, ``t`` the bit below the
    leading one) and the number of raw bits that follow it (``max(m - 1, 0)``)."""
    m = bit_lengths(k)
    below = np.maximum(m - 1, 0)
    t = (k >> below) & 1  # for m >= 1 the bit below the leading one
    return np.where(m == 0, 0, 2 * m - 1 + t).astype(np.int32), below


def encode_indices(k: np.ndarray, coder: str) -> bytes:
    """The payload coding ``k`` (integers >= 1) with ``coder`` (``"ans"`` or ``"elias"``)."""
    writer = BitWriter()
    if coder == "elias":
        writer.gamma(k)
        return writer.getvalue()
    symbols, below = heads(k)
    top = int(bit_lengths(k).max()) if k.size else 0
    words = _ans_words(symbols, 2 * top + 1) if top > 0 else np.zeros(0, dtype=np.uint32)
    writer.gamma(np.array([top + 1, words.size + 1]))
    writer.low_bits(k & ((np.int64(1) << below) - 1), below)
    return writer.getvalue() + words.astype("<u4").tobytes()


def decode_indices(payload: bytes, count: int, coder: str, *, limit: int) -> np.ndarray:
    """``count`` indices in ``[1, limit]`` from ``payload``; :class:`CodecError` on anything malformed."""
    if coder == "elias":
        reader = BitReader(payload)
        k = reader.gamma(count, limit=limit)
        reader.finish()
        return k
    top_limit = int(limit).bit_length() - 1
    header_limit = max(top_limit + 1, len(payload) // 4 + 1)
    top, n_words = BitReader(payload).gamma(2, limit=header_limit) - 1
    if top > top_limit:
        raise CodecError(f"index exponent {top} exceeds the bound {top_limit}")
    if 4 * n_words > len(payload):
        raise CodecError("payload truncated: fewer bytes than its ANS words")
    split = len(payload) - 4 * int(n_words)
    words = np.frombuffer(payload[split:], dtype="<u4").astype(np.uint32)
    if top == 0:
        if n_words:
            raise CodecError("payload malformed: ANS words without exponents to code")
        symbols = np.zeros(count, dtype=np.int64)
    else:
        symbols = _decode_heads(words, count, 2 * int(top) + 1)
    m, t = np.divmod(symbols + 1, 2)
    below = np.maximum(m - 1, 0)
    reader = BitReader(payload[:split])
    reader.gamma(2, limit=header_limit)
    k = np.where(m == 0, 1, (np.int64(1) << m) + (t << below)) + reader.low_bits(below)
    reader.finish()
    if k.size and k.max() > limit:
        raise CodecError(f"index {k.max()} exceeds its bound {limit}")
    return k


def _decode_heads(words: np.ndarray, count: int, alphabet: int) -> np.ndarray:
    try:
        coder = stream.stack.AnsCoder(words)
        symbols = np.empty(count, dtype=np.int32)
        counts = np.full(alphabet, 0.5)
        for start, stop in _chunks(count):
            symbols[start:stop] = coder.decode(stream.model.Categorical(counts.copy(), perfect=False), stop - start)
            counts += np.bincount(symbols[start:stop], minlength=alphabet)
        empty = coder.is_empty()
    except ValueError as err:
        raise CodecError(f"ANS section invalid: {err}") from err
    if not empty:
        raise CodecError("payload corrupted: ANS data left over after the last index")
    if symbols.max() < alphabet - 2:
        raise CodecError("payload is not in canonical form (the announced largest exponent does not occur)")
    if not np.array_equal(_ans_words(symbols, alphabet), words):
        raise CodecError("payload is not in canonical form (ANS words differ from a fresh encoding)")
    return symbols.astype(np.int64)
