"""``fedtailor reproduce NAME``: the papers' experiments from one command, resumable, with tables, plots and one
self-contained HTML report.

An *experiment* is a list of *blocks*; a block is a config file, a grid of overrides (every combination is a
point) and fixed overrides (:mod:`fedtailor.fl.experiments`; each method family registers its own in its
``catalogue`` module). Every (point, seed) is an ordinary run directory ``OUT/NAME/<block>/<point>/seed<S>``, so
an interrupted reproduction resumes: finished runs of the same resolved config are skipped, unfinished ones
continue from their checkpoints. ``--quick`` adds the experiment's reduced-scale overrides and runs its first seed
only (``--seeds`` gives more). ``all`` names every experiment; ``NAME/BLOCK[,BLOCK]`` runs only those blocks of an
experiment (``compact-table1-mnist/eps16``) in the same folders, so the rest can be added later. A point whose
resolved config (less its name) equals one planned before runs once: its folder is a link to the first (Table 2's
alpha 0.5 is Table 1 at eps 16). ``--jobs N`` runs N processes of ``cores // N`` threads each
(``OMP_NUM_THREADS``), never more than the cores.

Three steps, one module each: :mod:`.plan` (the runs, validated before any starts), :mod:`.execute` (the
processes) and :mod:`.report` (tables, plots, ``report.html``); :func:`reproduce` chains them. ``--tune`` first
runs an experiment's tuning stage (:mod:`.tune`: each point's own step size, chosen on a validation split) and
then the experiment with those choices. ``--records DIR`` (:mod:`.records`) carries the finished runs between
machines as small committed files: restored before planning, rewritten as runs finish; ``--report-only`` runs
nothing and writes the tables of what has finished (an experiment part-way through its seeds).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fedtailor.fl.experiments import EXPERIMENTS, Block, Claim, Experiment, Tuning
from fedtailor.reproduce.execute import execute
from fedtailor.reproduce.plan import Run, listing, load_choices, plan, specs
from fedtailor.reproduce.records import records_path, restore, save
from fedtailor.reproduce.report import html_report, tables
from fedtailor.reproduce.tune import choose, plan_tuning

__all__ = [
    "EXPERIMENTS",
    "Block",
    "Claim",
    "Experiment",
    "Outcome",
    "Run",
    "Tuning",
    "choose",
    "execute",
    "html_report",
    "listing",
    "load_choices",
    "plan",
    "plan_tuning",
    "reproduce",
    "tables",
]

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """What a reproduction did: every planned run, those that failed, and the HTML report."""

    runs: list[Run]
    failed: list[Run] = field(default_factory=list)
    report: Path | None = None


def reproduce(
    names: list[str],
    *,
    out: Path,
    seeds: list[int] | None = None,
    quick: bool = False,
    jobs: int = 1,
    tune: bool = False,
    records: Path | None = None,
    report_only: bool = False,
    progress: Callable[[str], None] = log.info,
) -> Outcome:
    """Plan the named experiments, run what is not finished, and write their tables, plots and ``report.html``.
    ``tune``: first run the tuning stages and write their choices, which the runs then use (a failed tuning run
    scores nothing; its point is chosen from the others; one that diverged is an outcome, not a failure).
    ``records``: a folder of run records (:mod:`.records`): those of the named experiments are restored as finished
    runs (or runs that diverged) first, and each experiment's file is rewritten whenever one of its runs finishes
    or diverges. ``report_only``: run nothing (no tuning stage either); the tables and the report cover the runs
    already finished, restored records included, and say how many seeds each point has."""
    if report_only and tune:
        raise ValueError("report_only runs nothing, so it cannot tune; leave out one of the two.")
    failed: list[Run] = []
    on_finish = None
    if records is not None:
        for name in sorted({spec.partition("/")[0] for spec in specs(names, EXPERIMENTS)}):
            if (path := records_path(records, name)).exists():
                written, held = restore(path, out)
                kept = f" ({held - written} already in {out})" if written < held else ""
                progress(f"reproduce: {written} of {held} finished run(s) of {name} restored from {path}{kept}")

        def on_finish(run: Run) -> None:
            save(records_path(records, run.experiment), out, run.experiment)

    if tune:
        tuning = plan_tuning(names, out=out, quick=quick)
        if not tuning:
            progress(f"reproduce: nothing to tune: {', '.join(names)} has no tuning stage; its runs use their configs")
        else:  # a tuning run that diverges is an outcome, not a failure: its values score nothing (a grid's top step)
            failed += [r for r in execute(tuning, jobs=jobs, progress=progress, on_finish=on_finish) if not r.diverged]
            for path in choose(tuning, out=out, quick=quick):
                progress(f"reproduce: tuning choices in {path}")
    runs = plan(names, out=out, seeds=seeds, quick=quick)
    if report_only:
        progress(f"reproduce: report only: {sum(r.done for r in runs)} of {len(runs)} run(s) finished, none run")
    else:
        failed += execute(runs, jobs=jobs, progress=progress, on_finish=on_finish)
    folders = tables(runs, out=out)
    return Outcome(runs=runs, failed=failed, report=html_report(folders, out=out))
