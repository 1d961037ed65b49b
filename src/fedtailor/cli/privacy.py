"""``fedtailor privacy``: noise calibration for the fixed uniform schedule (``docs/privacy.md``).

The closed form is Eq. 7 of *Privacy-Aligned Personalized Federated Learning with Compact Adaptation and
Variable-Length Gaussian Communication*.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from fedtailor.data.context import context_sensitivity
from fedtailor.privacy.accountant import CONVERSIONS, epsilon_from_rho
from fedtailor.privacy.calibrate import (
    calibrate_sigma,
    gradient_sensitivity,
    participation_counts,
    uniform_schedule,
    worst_client_rho,
)


def calibration_report(
    *,
    eps: float,
    delta: float,
    rounds: int,
    clients: int,
    per_round: int,
    seed: int,
    context_size: int,
    batch_size: int,
    clip: float,
) -> dict[str, Any]:
    """Sample the schedule, calibrate sigma under every conversion and cross-evaluate eps at each sigma."""
    schedule = uniform_schedule(num_clients=clients, rounds=rounds, per_round=per_round, seed=seed)
    counts = participation_counts(schedule, clients)
    t_max = int(counts.max())
    d_c = context_sensitivity(context_size)
    d_g = gradient_sensitivity(batch_size=batch_size, clip=clip)
    rows = []
    for conversion in CONVERSIONS:
        sigma = calibrate_sigma(
            eps=eps,
            delta=delta,
            t_max=t_max,
            context_sensitivity=d_c,
            gradient_sensitivity=d_g,
            conversion=conversion,
        )
        rho = worst_client_rho(sigma=sigma, t_max=t_max, context_sensitivity=d_c, gradient_sensitivity=d_g)
        rows.append(
            {
                "calibrated_with": conversion,
                "sigma": sigma,
                "eps": {c: epsilon_from_rho(rho, delta=delta, conversion=c) for c in CONVERSIONS},
            }
        )
    return {
        "eps": eps,
        "delta": delta,
        "rounds": rounds,
        "clients": clients,
        "per_round": per_round,
        "seed": seed,
        "context_sensitivity": d_c,
        "gradient_sensitivity": d_g,
        "t_max": t_max,
        "t_min": int(counts.min()),
        "t_mean": float(counts.mean()),
        "calibrations": rows,
    }


def format_report(report: dict[str, Any]) -> str:
    """Markdown table of a :func:`calibration_report`."""
    r = report
    lines = [
        (
            f"schedule: {r['rounds']} rounds, {r['per_round']} of {r['clients']} clients per round, "
            f"seed {r['seed']}: T_max = {r['t_max']} (min {r['t_min']}, mean {r['t_mean']:.2f})"
        ),
        (
            f"target eps = {r['eps']:g}, delta = {r['delta']:g}, Delta_c = {r['context_sensitivity']:.6g}, "
            f"Delta_g = {r['gradient_sensitivity']:.6g}; eps is the worst client's (context + T_max releases)"
        ),
        "",
        "| calibrated with | sigma | " + " | ".join(f"eps ({c})" for c in CONVERSIONS) + " |",
        "|---|---:|" + "---:|" * len(CONVERSIONS),
    ]
    for row in r["calibrations"]:
        eps_cells = " | ".join(f"{row['eps'][c]:.4f}" for c in CONVERSIONS)
        lines.append(f"| {row['calibrated_with']} | {row['sigma']:.6f} | {eps_cells} |")
    return "\n".join(lines)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0.0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _cmd_calibrate(args: argparse.Namespace) -> int:
    report = calibration_report(
        eps=args.eps,
        delta=args.delta,
        rounds=args.rounds,
        clients=args.clients,
        per_round=args.per_round,
        seed=args.seed,
        context_size=args.context_size,
        batch_size=args.batch_size,
        clip=args.clip,
    )
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``fedtailor privacy calibrate``."""
    privacy = subparsers.add_parser("privacy", help="privacy accounting and noise calibration")
    sub = privacy.add_subparsers(dest="privacy_command", required=True, metavar="SUBCOMMAND")
    cal = sub.add_parser(
        "calibrate",
        help="sample the fixed uniform schedule and calibrate sigma for a target (eps, delta)",
        description="Samples the fixed schedule (per_round distinct clients per round, uniformly), reports "
        "T_max, and calibrates the common sigma under each conversion (closed-form = the compact-adaptation "
        "paper's, balle, exact), with the eps every conversion gives at each sigma.",
    )
    cal.add_argument("--eps", type=_positive_float, required=True, help="target epsilon")
    cal.add_argument("--delta", type=_positive_float, default=1e-5, help="target delta (default 1e-5)")
    cal.add_argument("--rounds", type=int, default=500, help="communication rounds (default 500)")
    cal.add_argument("--clients", type=int, default=40, help="participating (seen) clients (default 40)")
    cal.add_argument("--per-round", type=int, default=2, help="clients selected per round (default 2)")
    cal.add_argument(
        "--seed", type=int, required=True, help="seed of the schedule, numpy_rng(seed, 'schedule')"
    )
    cal.add_argument("--context-size", type=int, default=333, help="m_c, records in the context set (333)")
    cal.add_argument("--batch-size", type=int, default=333, help="m_g, records per coefficient release (333)")
    cal.add_argument("--clip", type=_positive_float, default=1.0, help="C_g, per-record clip norm (1.0)")
    cal.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    cal.set_defaults(func=_cmd_calibrate)
