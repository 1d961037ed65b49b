"""``fedtailor privacy``: noise calibration for the fixed uniform schedule (``docs/privacy.md``).

The closed form is Eq. 7 of *Privacy-Aligned Personalized Federated Learning with Compact Adaptation and
Variable-Length Gaussian Communication*.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from fedtailor.cli.checks import open_unit, positive_float, positive_int
from fedtailor.data.context import context_sensitivity
from fedtailor.fl.schedule import schedule_counts
from fedtailor.privacy.accountant import CONVERSIONS, epsilon_from_rho
from fedtailor.privacy.calibrate import calibrate_sigma, gradient_sensitivity, worst_client_rho


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
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Sample the schedule, calibrate sigma under every conversion and cross-evaluate eps at each sigma. The
    schedule's participation counts are those of the run's schedule, counted without holding it in memory
    (:func:`fedtailor.fl.schedule.schedule_counts`; ``progress(n)`` after every ``n`` rounds)."""
    counts = schedule_counts(num_clients=clients, rounds=rounds, per_round=per_round, seed=seed, progress=progress)
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


class _Progress:
    """Says how long sampling a long schedule will take (one line, from the rate of its first chunk) and shows
    a progress bar on a terminal; a schedule sampled in a few seconds says nothing."""

    def __init__(self, rounds: int) -> None:
        self.rounds, self.done, self.start, self.bar = rounds, 0, time.perf_counter(), None

    def __call__(self, n: int) -> None:
        self.done += n
        if self.bar is None and self.done < self.rounds:
            left = (time.perf_counter() - self.start) / self.done * (self.rounds - self.done)
            self.bar = False
            if left > 3.0:
                from tqdm.auto import tqdm

                print(
                    f"fedtailor privacy calibrate: sampling the {self.rounds:,}-round schedule for T_max "
                    f"takes about {_duration(left)} here (Ctrl-C stops).",
                    file=sys.stderr,
                )
                self.bar = tqdm(
                    total=self.rounds,
                    initial=self.done,
                    unit="round",
                    desc="schedule",
                    file=sys.stderr,
                    leave=False,
                    disable=None,
                    mininterval=1.0,
                )
        elif self.bar:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar:
            self.bar.close()


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _cmd_calibrate(args: argparse.Namespace) -> int:
    if args.per_round > args.clients:
        raise ValueError(
            f"--per-round {args.per_round} exceeds --clients {args.clients}: a round selects "
            "distinct clients; lower --per-round or raise --clients."
        )
    progress = _Progress(args.rounds)
    try:
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
            progress=progress,
        )
    finally:
        progress.close()
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
    cal.add_argument("--eps", type=positive_float, required=True, help="target epsilon")
    cal.add_argument("--delta", type=open_unit, default=1e-5, help="target delta, in (0, 1) (default 1e-5)")
    cal.add_argument("--rounds", type=positive_int, default=500, help="communication rounds (default 500)")
    cal.add_argument("--clients", type=positive_int, default=40, help="participating (seen) clients (default 40)")
    cal.add_argument(
        "--per-round", type=positive_int, default=2, help="clients selected per round, at most --clients (default 2)"
    )
    cal.add_argument("--seed", type=int, required=True, help="seed of the schedule, numpy_rng(seed, 'schedule')")
    cal.add_argument("--context-size", type=positive_int, default=333, help="m_c, records in the context set (333)")
    cal.add_argument("--batch-size", type=positive_int, default=333, help="m_g, records per coefficient release (333)")
    cal.add_argument("--clip", type=positive_float, default=1.0, help="C_g, per-record clip norm (1.0)")
    cal.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    cal.set_defaults(func=_cmd_calibrate)
