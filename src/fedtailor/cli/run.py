"""``fedtailor run CONFIG`` and ``fedtailor report RUN_DIR``."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedtailor.cli.checks import positive_int


def default_config() -> Path:
    """The embedded default config (the quick-start job): :func:`fedtailor.config.default_config`."""
    from fedtailor.config import default_config

    return default_config()


def _run(args: argparse.Namespace) -> int:
    from fedtailor.config import load_config
    from fedtailor.report import report
    from fedtailor.runner import run_experiment

    cfg = load_config(args.config or default_config(), args.set or [])
    out = run_experiment(cfg, args.out, resume=args.resume, progress=not args.no_progress, stop_after=args.stop_after)
    print(report(out, plots=not args.no_plots))
    print(f"\nrun directory: {out}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from fedtailor.report import report

    print(report(args.run_dir, plots=not args.no_plots))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run an experiment from a TOML/YAML config",
        description="Run a federated experiment. Without CONFIG, runs the embedded quick-start config.",
    )
    p.add_argument("config", nargs="?", help="config file (TOML or YAML); default: the embedded quick start")
    p.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a field, e.g. --set federation.rounds=20"
    )
    p.add_argument("--out", type=Path, help="run directory (default: OUT_DIR/NAME-seedSEED)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from its checkpoint")
    p.add_argument(
        "--stop-after", type=positive_int, metavar="N", help="stop after N >= 1 rounds (resume later with --resume)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    p.set_defaults(func=_run)

    r = sub.add_parser("report", help="print tables and write plots of a run directory")
    r.add_argument("run_dir", type=Path)
    r.add_argument("--no-plots", action="store_true")
    r.set_defaults(func=_report)
    register_sweep(sub)


def _sweep(args: argparse.Namespace) -> int:
    from fedtailor.sweep import parse_grid, parse_seeds, run_sweep

    print(
        run_sweep(
            args.config,
            out=args.out,
            seeds=parse_seeds(args.seeds),
            grid=parse_grid(args.grid or []),
            overrides=args.set or [],
            progress=not args.no_progress,
        )
    )
    print(f"\nsweep directory: {args.out}")
    return 0


def register_sweep(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "sweep",
        help="run a config over seeds and a grid of overrides; mean +- std table",
        description="Reproduce an experiment over several seeds (and a grid of settings). Finished "
        "runs are skipped and unfinished ones resumed, so a sweep can be interrupted.",
    )
    s.add_argument("config", nargs="?", help="config file; default: the embedded quick start")
    s.add_argument("--seeds", default="41-45", help="e.g. 41-45 or 41,42 (default 41-45, the papers' seeds)")
    s.add_argument("--grid", action="append", metavar="KEY=V1,V2", help="e.g. --grid method.privacy.epsilon=4,8,16,32")
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="a fixed override for every run")
    s.add_argument("--out", type=Path, required=True, help="sweep directory")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(func=_sweep)
