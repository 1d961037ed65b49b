"""Codec benchmark: bits per coefficient and encode/decode ms per release, all codecs side by side (one run).

    python benchmarks/bench_codecs.py                 # the table of docs/codecs.md (k = 16,384, eps = 16)
    python benchmarks/bench_codecs.py --battery       # also: the exactness battery's rejection rates (power)

The measuring function lives in the package (``fedtailor.codecs.bench``) and is shared with
``fedtailor codec bench``. Timings run in one thread (BLAS pools limited, torch threads = 1).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import report

from fedtailor.codecs import LRSUQCodec
from fedtailor.codecs._testing import BROKEN_VARIANTS, reused_release_key
from fedtailor.codecs.battery import exactness_battery
from fedtailor.codecs.bench import bench_codecs, bench_notes, single_thread


def battery_rows(*, sizes: list[int], seeds: int, alpha: float) -> list[dict]:
    """Rejection rate of the battery (Holm, alpha) for the real codecs and every negative control."""
    systems = [
        ("LRSUQ Z^4 (real)", LRSUQCodec, None),
        ("LRSUQ D4 (real)", lambda: LRSUQCodec(lattice="D4"), None),
        ("layered b=1 (real)", lambda: LRSUQCodec(block_size=1), None),
        *[(f"broken: {name}", cls, None) for name, cls in BROKEN_VARIANTS.items()],
        ("broken: key schedule reuses seeds", LRSUQCodec, reused_release_key),
    ]
    rows = []
    for label, make, key_fn in systems:
        row: dict[str, object] = {"system": label}
        for n in sizes:
            t0 = time.perf_counter()
            results = [
                exactness_battery(
                    make(), n_blocks=n, secret=1000 + s, alpha=alpha, **({"key_fn": key_fn} if key_fn else {})
                )
                for s in range(seeds)
            ]
            row[f"reject rate n={n}"] = sum(not r.passed for r in results) / seeds
            row[f"median Holm p n={n}"] = sorted(r.holm_p for r in results)[seeds // 2]
            row[f"s/battery n={n}"] = (time.perf_counter() - t0) / seeds
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=16384)
    parser.add_argument("--sigma", type=float, default=0.01468)
    parser.add_argument("--releases", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--battery", action="store_true", help="also measure the battery's rejection rates")
    parser.add_argument("--battery-seeds", type=int, default=5)
    parser.add_argument("--no-save", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with single_thread():
        rows = bench_codecs(k=args.k, sigma=args.sigma, releases=args.releases, seed=args.seed)
    notes = bench_notes(k=args.k, sigma=args.sigma) + (
        "\nTimes: median over releases of one encode / one decode, one thread. The machine is shared with other "
        "engineers' jobs while this runs, so absolute times are inflated and noisy; ratios are to DG FP32 "
        "measured in the same run."
    )
    report(f"Codecs at k = {args.k}, sigma = {args.sigma} (eps = 16)", rows, notes=notes, save=not args.no_save)
    if args.battery:
        sizes = [1024, 4096, 16384]
        rows = battery_rows(sizes=sizes, seeds=args.battery_seeds, alpha=0.01)
        report(
            "Exactness battery: rejection rate at alpha = 0.01 (Holm over the battery)",
            rows,
            notes=f"{args.battery_seeds} independent secrets per cell; n = blocks per input class (5 classes + 2 "
            "releases). A real codec should be rejected at rate <= 0.01, a broken one at rate 1.",
            save=not args.no_save,
        )


if __name__ == "__main__":
    main()
