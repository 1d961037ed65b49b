"""The ``fedtailor`` command line. Each area registers its own subcommands from one small module.

This package imports nothing heavy at import time (torch and numpy come with the subcommands, inside
:func:`main`), so that Ctrl-C while the command is still starting up ends as every Ctrl-C does: one line and
exit code 130, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Modules under fedtailor.cli that define ``register(subparsers)``; each adds its subcommands.
_COMMAND_MODULES = ("run", "datasets", "privacy", "codec", "reproduce")


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (the flag, the problem, where the usage is), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (usage: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fedtailor",
        description="Private and personalized federated learning (compact adaptation, LRSUQ, pFedDPO, FedLAG).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(f"fedtailor.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The console entry point. Ctrl-C at any moment, the imports of the subcommands included, exits with 130
    and one line."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("fedtailor: interrupted.", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    from fedtailor.allocator import keep_freed_memory

    keep_freed_memory()  # before the first tensor: training steps reuse freed memory instead of page-faulting
    parser = build_parser()
    from fedtailor.blas import single_thread_numpy_blas

    single_thread_numpy_blas()  # numpy's idle BLAS threads would otherwise steal torch's cores
    args = parser.parse_args(argv)
    from fedtailor.fl.loop import RunInterrupted
    from fedtailor.fl.records import TrainingDiverged
    from fedtailor.privacy.ledger import PrivacyBudgetExceeded

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        return int(args.func(args) or 0)
    except RunInterrupted as err:
        if args.command == "sweep":
            where = (
                f"the last checkpoint of that run is at round {err.checkpoint_round}; run the same sweep command "
                "again to continue (finished runs are skipped, unfinished ones resumed)"
            )
        elif err.run_dir is not None:
            where = (
                f"the last checkpoint is at round {err.checkpoint_round}; continue with the same command plus "
                f"--resume --out {err.run_dir}"
            )
        else:
            where = "no checkpoint had been written yet, so nothing was kept; run it again to start over"
        print(f"fedtailor {args.command}: interrupted during round {err.round}; {where}.", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print(f"fedtailor {args.command}: interrupted.", file=sys.stderr)
        return 130
    except TrainingDiverged as err:  # an outcome of the run's settings, not a usage error: its own exit status
        if args.verbose:
            raise
        print(f"fedtailor {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return TrainingDiverged.EXIT_STATUS
    except (ValueError, OSError, KeyError, PrivacyBudgetExceeded) as err:
        # user errors (and a release the privacy budget refuses): one clear line, no traceback
        if args.verbose:
            raise
        print(f"fedtailor {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2


def _one_line(err: BaseException) -> str:
    if isinstance(err, OSError) and err.filename is not None and not str(err).startswith(str(err.filename)):
        text = f"{err.strerror or err}: {err.filename}"
    else:
        text = str(err)
    return " ".join(text.split())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
