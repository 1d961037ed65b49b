"""Flower's DP and fedtailor's accounting side by side: the same noise and clipping, the eps each reports.

    python benchmarks/bench_flower_accounting.py            # appended to benchmarks/RESULTS.md
    python benchmarks/bench_flower_accounting.py --no-save

Flower 1.42 has no accountant. ``LocalDpMod(clipping_norm, sensitivity, epsilon, delta)`` (client-side noise)
draws ``N(0, s^2)`` with ``s = sensitivity sqrt(2 ln(1.25 / delta)) / epsilon`` (the classical Gaussian mechanism,
Dwork & Roth's Theorem A.1, valid for epsilon < 1) and reports that epsilon for every release, however many a client
makes. ``DifferentialPrivacyServerSideFixedClipping(strategy, noise_multiplier z, clipping_norm C, m)`` adds
``N(0, (z C / m)^2)`` to the average of the clipped updates and reports no epsilon. Here each noise is measured by
running Flower's own function on a million zeros, then given to fedtailor's ledger: the client-side noise as a
replace-one Gaussian of sensitivity ``2 C`` (``[method.client_dp]``) composed over T releases of a client, the
server-side one as ``[method.server_dp]``'s fixed-size subsampled Gaussian (``z_ours = z / 2``: replace-one moves
the sum by ``2 C``) over T rounds of m out of N clients, and without the sampling credit.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import report

from fedtailor.privacy.ledger import PrivacyLedger

DELTA = 1e-5


def flower_std(fn, *args: float) -> float:
    """The std Flower's own noise function adds to a million zeros."""
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays

    noisy = parameters_to_ndarrays(fn(ndarrays_to_parameters([np.zeros(1_000_000)]), *args))
    return float(np.std(noisy[0]))


def ours(events: list[tuple[float, ...]], *, conversion: str = "exact") -> float:
    return PrivacyLedger(delta=DELTA, conversion=conversion).epsilon_with(0, events)


def client_side(rounds: list[int]) -> list[dict[str, object]]:
    from flwr.supercore.differential_privacy import add_localdp_gaussian_noise_to_params

    rows = []
    for eps_flower in (0.5, 1.0, 4.0, 8.0):
        clip = 1.0
        sigma = flower_std(add_localdp_gaussian_noise_to_params, 2 * clip, eps_flower, DELTA)
        formula = 2 * clip * math.sqrt(2 * math.log(1.25 / DELTA)) / eps_flower
        row: dict[str, object] = {
            "LocalDpMod epsilon": eps_flower,
            "sigma (Flower's draw / formula)": f"{sigma:.4f} / {formula:.4f}",
            "Flower reports": f"{eps_flower:g} per release, any T",
        }
        for t in rounds:
            row[f"ours, T = {t}"] = ours([(2 * clip, sigma)] * t)
        rows.append(row)
    return rows


def server_side(*, population: int, per_round: int, rounds: list[int]) -> list[dict[str, object]]:
    from flwr.supercore.differential_privacy import add_gaussian_noise_to_params

    rows = []
    q = per_round / population
    for z in (0.5, 1.0, 2.0):
        clip = 1.0
        sigma_mean = flower_std(add_gaussian_noise_to_params, z, clip, per_round)
        sigma_sum = sigma_mean * per_round  # Flower adds to the average: the same noise on the sum is m times
        row: dict[str, object] = {
            "noise multiplier z": z,
            "sigma on the mean (Flower's draw)": sigma_mean,
            "Flower reports": "no epsilon",
        }
        for t in rounds:
            row[f"ours, T = {t}, sampled"] = ours([(2 * clip, sigma_sum, q, t, population)])
            row[f"ours, T = {t}, no credit"] = ours([(2 * clip, sigma_sum)] * t)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-save", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    report(
        f"Flower's LocalDpMod against fedtailor's ledger (delta = {DELTA:g}, clip 1, replace-one sensitivity 2)",
        client_side([1, 10, 100]),
        notes="ours: eps of T releases of one client at Flower's sigma ('exact' conversion of the composed RDP). "
        "Flower's formula is the classical one (Dwork & Roth, valid for eps < 1) and is never composed.",
        save=not args.no_save,
    )
    report(
        "Flower's DifferentialPrivacyServerSideFixedClipping against [method.server_dp] (20 clients, 5 a round)",
        server_side(population=20, per_round=5, rounds=[10, 100]),
        notes="ours, sampled: dp-accounting's SampledWithoutReplacement(20, 5) of the Gaussian, T rounds, "
        "replace-one; no credit: every round a plain Gaussian for every client.",
        save=not args.no_save,
    )


if __name__ == "__main__":
    main()
