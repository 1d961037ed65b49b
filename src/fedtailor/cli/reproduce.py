"""``fedtailor reproduce NAME [...] [--tune | --report-only] [--quick] [--seeds 41-43] [--jobs N] [--out DIR]
[--records DIR]`` and ``--list``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedtailor.cli.checks import positive_int


def _reproduce(args: argparse.Namespace) -> int:
    from fedtailor.reproduce import listing, reproduce
    from fedtailor.sweep import parse_seeds

    if args.list or not args.names:
        print(listing())
        return 0
    outcome = reproduce(
        args.names,
        out=args.out,
        seeds=parse_seeds(args.seeds) if args.seeds else None,
        quick=args.quick,
        jobs=args.jobs,
        tune=args.tune,
        records=args.records,
        report_only=args.report_only,
        progress=lambda line: print(line, file=sys.stderr),
    )
    print(f"report: {outcome.report}")
    diverged = sum(r.diverged for r in outcome.failed)
    if diverged:
        print(
            f"{diverged} run(s) diverged (a step too large for the model, or noise far above the signal); the same "
            "command runs them again only once their run directories are deleted.",
            file=sys.stderr,
        )
    if len(outcome.failed) > diverged:
        print(
            f"{len(outcome.failed) - diverged} run(s) failed; their logs are beside their run directories. Run the "
            "same command again to retry them (finished runs are skipped).",
            file=sys.stderr,
        )
    return 1 if outcome.failed else 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "reproduce",
        help="run the papers' experiments: tables, plots, an HTML report",
        description="Run named experiments (see --list). Finished runs are skipped and unfinished "
        "ones resumed, so an interrupted reproduction continues where it stopped.",
    )
    p.add_argument(
        "names", nargs="*", help="experiments to run (see --list; 'all' for every one, NAME/BLOCK for one block)"
    )
    p.add_argument("--list", action="store_true", help="list the experiments and their sizes")
    p.add_argument("--quick", action="store_true", help="the reduced scale of each experiment")
    stage = p.add_mutually_exclusive_group()
    stage.add_argument(
        "--tune",
        action="store_true",
        help="first choose each point's step size on a validation split (the experiment's tuning stage)",
    )
    stage.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: the tables and report of the runs already finished (and of the restored --records)",
    )
    p.add_argument("--seeds", help="override the experiments' seeds, e.g. 41-43")
    p.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="processes at once (>= 1), cores // N threads each (at most the cores)",
    )
    p.add_argument("--out", type=Path, default=Path("runs/reproduce"), help="output folder")
    p.add_argument(
        "--records",
        type=Path,
        help="a folder of run records (RECORDS/NAME/runs.jsonl.gz, e.g. docs/results): restored as finished runs "
        "first, rewritten as runs finish",
    )
    p.set_defaults(func=_reproduce)
