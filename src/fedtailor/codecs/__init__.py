"""Communication codecs for one Gaussian release: DG FP32, DG+Q12, the layered quantiser, LRSUQ and PPR.

``get_codec(name, **options)`` returns a :class:`Codec`; ``encode(u, key=..., sigma=...)`` gives the message
bytes and ``decode(message, key=..., sigma=..., dim=...)`` the released float64 vector. The key of each release
is ``release_key(secret, client, round)``. See docs/codecs.md.
"""

from __future__ import annotations

from fedtailor.codecs.base import Codec, CodecError, release_key
from fedtailor.codecs.dg import DGQ12Codec, DirectGaussianCodec
from fedtailor.codecs.lrsuq import LRSUQCodec
from fedtailor.codecs.ppr import PPRCodec

CODEC_NAMES = ("dg-fp32", "dg-q12", "layered", "lrsuq", "ppr")


def get_codec(name: str, **options: object) -> Codec:
    """A codec by name.

    * ``"dg-fp32"``, ``"dg-q12"``: no options.
    * ``"layered"``: the scalar layered quantiser (LRSUQ with b = 1); option ``coder`` ("elias" | "ans").
    * ``"lrsuq"``: options ``block_size`` (default 4), ``lattice`` ("Z", or "D4" for b = 4) and
      ``coder`` ("elias", the default, needs nothing; "ans" needs the optional ``constriction`` package).
    * ``"ppr"``: the Poisson private representation on rotated blocks; options ``block_size`` (default 4),
      ``alpha`` (default 8.0; ``float("inf")`` for the plain argmin), ``clip`` (the public bound on ``||u||``, default
      1.0), ``spread`` (the proposal's extra variance in units of ``clip^2 / k``, default 2.5) and ``coder`` (the
      index code: "ans", the default, or "elias").
    """
    if name in ("dg-fp32", "dg-q12"):
        if options:
            raise ValueError(f"codec {name!r} takes no options, got {sorted(options)}")
        return DirectGaussianCodec() if name == "dg-fp32" else DGQ12Codec()
    if name == "layered":
        unknown = set(options) - {"coder"}
        if unknown:
            raise ValueError(f"codec 'layered' takes only the option 'coder', got {sorted(unknown)}")
        return LRSUQCodec(block_size=1, coder=str(options.get("coder", "elias")), name="layered")
    if name == "lrsuq":
        unknown = set(options) - {"block_size", "lattice", "coder"}
        if unknown:
            raise ValueError(f"codec 'lrsuq' options are block_size, lattice, coder; got unknown {sorted(unknown)}")
        return LRSUQCodec(**options)  # type: ignore[arg-type]
    if name == "ppr":
        unknown = set(options) - {"block_size", "alpha", "clip", "spread", "coder"}
        if unknown:
            raise ValueError(
                f"codec 'ppr' options are block_size, alpha, clip, spread, coder; got unknown {sorted(unknown)}"
            )
        return PPRCodec(**options)  # type: ignore[arg-type]
    raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}")


__all__ = [
    "CODEC_NAMES",
    "Codec",
    "CodecError",
    "DGQ12Codec",
    "DirectGaussianCodec",
    "LRSUQCodec",
    "PPRCodec",
    "get_codec",
    "release_key",
]
