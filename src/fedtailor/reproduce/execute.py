"""The executor of ``fedtailor reproduce``: the planned runs that are not finished, each a ``fedtailor run``
process writing its run directory (its log beside it), ``jobs`` at a time with ``cores // jobs`` threads each
(``OMP_NUM_THREADS``), never more than the cores. A run waits for the run it needs; a link to an identical run is
made once that run has finished."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from fedtailor.fl.records import TrainingDiverged
from fedtailor.reproduce.plan import Run
from fedtailor.rundir import completed, config_differences_from, write_diverged

log = logging.getLogger(__name__)


def _log_path(run: Run) -> Path:
    """The log of a run's process, beside its run directory."""
    return run.out.parent / f"{run.out.name}.log"


def _other_config(run: Run) -> list[str]:
    """How the config of the run its folder holds (finished or not) differs from the planned one (empty: the same,
    or nothing run there yet)."""
    try:
        return config_differences_from(run.out, run.cfg)
    except (OSError, ValueError):  # no saved config
        return []


def _last_line(log_file: Path) -> str:
    """The last line a run's process wrote (its one-line error), empty if none."""
    lines = log_file.read_text(errors="replace").strip().splitlines() if log_file.exists() else []
    return lines[-1] if lines else ""


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the platform has one (``taskset``, a batch
    scheduler's allocation), else every core."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def execute(
    runs: list[Run],
    *,
    jobs: int = 1,
    progress: Callable[[str], None] = log.info,
    command: Callable[[Run], list[str]] | None = None,
    on_finish: Callable[[Run], None] | None = None,
) -> list[Run]:
    """Run what is not finished, ``jobs`` processes at a time (``cores // jobs`` threads each), with a progress
    line after each start and finish: done / running / left and an estimate of the time left. ``command``: the
    process of a run (default: ``fedtailor run`` with the run's overrides); ``on_finish``: called with each run
    that finishes here or diverges (saving its record). Returns the runs that failed or diverged: a run that
    diverges is marked so (:func:`fedtailor.rundir.write_diverged`, with the error from its log) and is not run
    again by a later call, since the same config diverges again; delete its folder to run it anyway.

    Runs start seed by seed within each experiment (every point of the first seed, then the second, ...), so a
    reproduction stopped part-way leaves whole comparisons over fewer seeds rather than some points without any."""
    cores = usable_cores()
    jobs = max(1, min(jobs, cores))
    experiments = {name: i for i, name in enumerate(dict.fromkeys(r.experiment for r in runs))}
    pending = [(r, r.diverged) for r in runs if not r.done]
    failed = [r for r, before in pending if before]
    if failed:
        progress(f"reproduce: {len(failed)} run(s) diverged before and are not run again (diverged.json in each)")
    todo = sorted((r for r, before in pending if not before), key=lambda r: (experiments[r.experiment], r.seed))
    done = len(runs) - len(pending)
    for run in [r for r in todo if r.same_as is None]:
        if other := _other_config(run):  # e.g. run before a new tuning choice
            todo.remove(run)
            failed.append(run)
            progress(
                f"reproduce: {run.label} not run: {run.out} holds a run of another config ({'; '.join(other[:3])}); "
                "move it aside or delete it to run this one"
            )
    running: dict[subprocess.Popen[bytes], tuple[Run, float, IO[str]]] = {}
    durations: list[float] = []
    threads = str(cores // jobs)  # jobs x threads never exceeds the cores
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    build = command or _run_command

    def line() -> None:
        left = len(todo) + len(running)
        work = left - sum(r.same_as is not None for r in todo)  # links take no time
        eta = (sum(durations) / len(durations)) * work / jobs if durations else float("nan")
        progress(
            f"reproduce: {done} done, {len(running)} running, {left - len(running)} waiting"
            + (f", about {eta / 60:.1f} min left" if durations else "")
        )

    def ready() -> Run | None:  # the first waiting run whose prerequisite has finished
        return next((r for r in todo if r.after is None or completed(r.after)), None)

    line()
    while todo or running:
        while len(running) < jobs and (run := ready()) is not None:
            todo.remove(run)
            run.out.parent.mkdir(parents=True, exist_ok=True)
            if run.same_as is not None:  # finished under its first name: link it (relative, so out can move)
                if not run.out.is_symlink():
                    run.out.symlink_to(os.path.relpath(run.same_as, run.out.parent), target_is_directory=True)
                done += 1
                line()
                continue
            logf = _log_path(run).open("w")  # closed when the run ends
            proc = subprocess.Popen(build(run), env=env, stdout=logf, stderr=subprocess.STDOUT)
            running[proc] = (run, time.time(), logf)
            line()
        time.sleep(0.2)
        for proc in [p for p in running if p.poll() is not None]:
            run, started, logf = running.pop(proc)
            logf.close()
            if proc.returncode == 0:
                done += 1
                durations.append(time.time() - started)
                if on_finish is not None:
                    on_finish(run)
            elif proc.returncode == TrainingDiverged.EXIT_STATUS:
                failed.append(run)
                write_diverged(run.out, run.cfg, _last_line(_log_path(run)))
                if on_finish is not None:
                    on_finish(run)
                progress(f"reproduce: {run.label} diverged; see {_log_path(run)}")
            else:
                failed.append(run)
                progress(f"reproduce: {run.label} failed (exit {proc.returncode}); see {_log_path(run)}")
            line()
        if todo and not running and ready() is None:  # what is left waits for runs that failed
            for run in todo:
                failed.append(run)
                progress(f"reproduce: {run.label} not run: {run.after} did not finish")
            todo.clear()
    return failed


def _run_command(run: Run) -> list[str]:
    """``python -m fedtailor run`` of the run's config and overrides into its run directory (resumed if begun)."""
    cmd = [sys.executable, "-m", "fedtailor", "run", run.config, "--out", str(run.out), "--no-progress", "--no-plots"]
    if run.out.exists() and any(run.out.iterdir()):
        cmd.append("--resume")
    for s in run.sets:
        cmd += ["--set", s]
    return cmd
