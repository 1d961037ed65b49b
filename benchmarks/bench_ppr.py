"""PPR beside LRSUQ and DG in one run: bits per coefficient (unpadded, padded, the floor) and encode/decode time
per release, at eps 4, 16 and 32 and ||u|| in {0, 1}; then PPR's rate-time curve over the block size at eps 16.

    python benchmarks/bench_ppr.py                  # both tables (k = 16,384), appended to benchmarks/RESULTS.md
    python benchmarks/bench_ppr.py --quick --no-save

Setting: the compact-adaptation paper's release (k = 16,384 coefficients, clip 1), sigma calibrated for T_max = 40
(closed form, docs/privacy.md: 0.04984 / 0.01468 / 0.00849 at eps 4 / 16 / 32), a random direction per release and
a fresh release key. Times are the medians over releases of the CPU time of this process (``time.process_time``,
one thread), so that other jobs on the machine do not count; ratios are to DG FP32 in the same run. Padded sizes
come from the public probes a run uses (``public_codec_profile``). The floor is I(u; u + e) per coefficient for a
Gaussian input of the same power (``gaussian_floor_bpc``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import report

from fedtailor.codecs import CodecError, get_codec, release_key
from fedtailor.codecs.bench import PAPER_LRSUQ_MS, gaussian_floor_bpc, single_thread
from fedtailor.codecs.index_code import encode_indices
from fedtailor.codecs.profile import public_codec_profile
from fedtailor.rng import fresh_key

SIGMAS = {4: 0.04984, 16: 0.01468, 32: 0.00849}
CODECS: tuple[tuple[str, str, dict[str, object]], ...] = (
    ("DG FP32", "dg-fp32", {}),
    ("LRSUQ Z^4 (ans)", "lrsuq", {"coder": "ans"}),
    ("PPR b=4, alpha 8 (default)", "ppr", {}),
    ("PPR b=4, argmin", "ppr", {"alpha": math.inf}),
    ("PPR b=8, alpha 8", "ppr", {"block_size": 8}),
    ("PPR b=8, argmin", "ppr", {"block_size": 8, "alpha": math.inf}),
)


def measure(codec, *, k: int, sigma: float, norm: float, releases: int, seed: int) -> dict[str, float]:
    """Median CPU ms of one encode and one decode, the mean unpadded bits per coefficient, for PPR also what the
    same indices cost Elias-gamma coded, and the releases the codec refused (a search past its bound)."""
    rng = np.random.default_rng(seed)
    enc, dec, bits, gamma, refused = [], [], [], [], 0
    for r in range(releases):
        u = rng.standard_normal(k)
        u *= norm / np.linalg.norm(u) if norm > 0 else 0.0
        key = release_key(seed, 0, r)
        noise_key = fresh_key() if codec.name in ("dg-fp32", "ppr") else None  # a secure-mode client
        t0 = time.process_time()
        try:
            msg = codec.encode(u, key=key, sigma=sigma, noise_key=noise_key)
        except CodecError:
            refused += 1
            continue
        t1 = time.process_time()
        codec.decode(msg, key=key, sigma=sigma, dim=k)
        t2 = time.process_time()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
        bits.append(8 * len(msg))
        if codec.name == "ppr":
            indices = codec.decode_indices(msg, key=key, sigma=sigma, dim=k)
            gamma.append(
                bits[-1] + 8 * (len(encode_indices(indices, "elias")) - len(encode_indices(indices, codec.coder)))
            )
    nan = math.nan
    return {
        "bpc": statistics.fmean(bits) / k if bits else nan,
        "bpc sd": statistics.stdev(bits) / k if len(bits) > 1 else nan,
        "bpc elias": statistics.fmean(gamma) / k if gamma else nan,
        "encode ms": 1e3 * statistics.median(enc) if enc else nan,
        "decode ms": 1e3 * statistics.median(dec) if dec else nan,
        "refused": refused,
    }


def side_by_side(*, k: int, releases: int, seed: int, eps_list: list[int]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for eps in eps_list:
        sigma = SIGMAS[eps]
        for label, name, options in CODECS:
            codec = get_codec(name, **options)
            codec.decode(codec.encode(np.zeros(k), key=1, sigma=sigma), key=1, sigma=sigma, dim=k)  # warm-up
            pad = public_codec_profile(codec, k=k, sigma=sigma, clip=1.0, seed=seed)["pad_bytes"]
            for norm in (0.0, 1.0):
                m = measure(codec, k=k, sigma=sigma, norm=norm, releases=releases, seed=seed)
                variable = name in ("lrsuq", "ppr")
                rows.append(
                    {
                        "eps": eps,
                        "||u||": norm,
                        "codec": label,
                        "bpc unpadded": m["bpc"],
                        "bpc padded": 8 * (pad + 8) / k if variable else m["bpc"],
                        "floor bpc": gaussian_floor_bpc(norm=norm, k=k, sigma=sigma),
                        "encode ms": m["encode ms"],
                        "decode ms": m["decode ms"],
                        "enc+dec ms": m["encode ms"] + m["decode ms"],
                    }
                )
    base = {(r["eps"], r["||u||"]): r["enc+dec ms"] for r in rows if r["codec"] == "DG FP32"}
    for r in rows:
        r["time vs DG FP32"] = float(r["enc+dec ms"]) / float(base[(r["eps"], r["||u||"])])  # type: ignore[arg-type]
    return rows


#: The curve's points: (b, alpha, spread, releases or None for the run's count). b = 20 runs argmin only (alpha 8
#: takes about 4x its time) and also at spread 3, which refuses fewer releases at ||u|| = clip.
CURVE: tuple[tuple[int, float, float, int | None], ...] = (
    *((b, alpha, 2.5, None) for b in (2, 4, 6, 8) for alpha in (8.0, math.inf)),
    *((b, alpha, 2.5, 3) for b in (12, 16) for alpha in (8.0, math.inf)),
    (20, math.inf, 2.5, 10),
    (20, math.inf, 3.0, 3),
)


def rate_time(*, k: int, releases: int, seed: int, blocks: list[int]) -> list[dict[str, object]]:
    sigma = SIGMAS[16]
    rows: list[dict[str, object]] = []
    for b, alpha, spread, count in CURVE:
        if b not in blocks:
            continue
        codec = get_codec("ppr", block_size=b, alpha=alpha, spread=spread)
        n = count or releases
        m = measure(codec, k=k, sigma=sigma, norm=1.0, releases=n, seed=seed)
        rows.append(
            {
                "b": b,
                "alpha": alpha,
                "spread": spread,
                "bpc unpadded": m["bpc"],
                "bpc sd": m["bpc sd"],
                "bpc elias": m["bpc elias"],
                "floor bpc": gaussian_floor_bpc(norm=1.0, k=k, sigma=sigma),
                "encode ms": m["encode ms"],
                "decode ms": m["decode ms"],
                "enc+dec ms": m["encode ms"] + m["decode ms"],
                "releases": n - m["refused"],
                "refused": m["refused"],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=16384)
    parser.add_argument("--releases", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="eps 16 only, b in {4, 8}, 3 releases")
    parser.add_argument("--no-save", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    releases = 3 if args.quick else args.releases
    with single_thread():
        rows = side_by_side(k=args.k, releases=releases, seed=args.seed, eps_list=[16] if args.quick else [4, 16, 32])
        curve = rate_time(
            k=args.k, releases=releases, seed=args.seed, blocks=[4, 8] if args.quick else [2, 4, 6, 8, 12, 16, 20]
        )
    notes = (
        f"CPU ms per release (time.process_time, one thread); the paper's LRSUQ takes {PAPER_LRSUQ_MS} ms per event. "
        "Padded: the fixed message size a run sends (public probes, 8 bytes of padding header included)."
    )
    report(f"PPR beside LRSUQ and DG at k = {args.k}", rows, notes=notes, save=not args.no_save)
    report(
        f"PPR's rate-time curve at eps 16 (k = {args.k}, ||u|| = 1)",
        curve,
        notes="bits per coefficient unpadded (26-byte frame included; its standard deviation over releases) with the "
        "default index code (ans) and with the same indices Elias-gamma coded, against the encoder's and decoder's "
        "CPU time; refused: releases whose search would pass the codec's bound (never sent approximately).",
        save=not args.no_save,
    )


if __name__ == "__main__":
    main()
