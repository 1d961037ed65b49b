"""Run records: each finished run of an experiment as one JSON line (its resolved config, ``results.json`` and
per-round ``metrics.jsonl``; for a run that diverged, why, in ``diverged``, and no results), in one gzip file per
experiment, ``RECORDS_DIR/NAME/runs.jsonl.gz``.

A run directory holds checkpoints and logs and stays on the machine that ran it; a record holds what the tables,
the tuning choices and the verdicts are computed from, a few kilobytes a run. ``fedtailor reproduce NAME
--records DIR`` restores the records in ``DIR/NAME/runs.jsonl.gz`` as finished run directories before it plans
(so those runs are skipped, and a reproduction split over machines that do not keep their disks goes on where the
last one stopped) and rewrites that file each time one of its runs finishes. The committed records are
``docs/results/NAME/runs.jsonl.gz``: with them, ``fedtailor reproduce NAME --records docs/results`` rebuilds the
committed tables without running anything.

A record is restored only where its run directory holds nothing yet (an unfinished run there keeps its
checkpoint), and counts as finished only when its config is the planned one (:func:`fedtailor.rundir.finished`),
as a run directory's would. A record whose path leaves the output folder, or that is not a record, is refused with
the file and line named; nothing is written then.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path, PurePosixPath
from typing import Any

from fedtailor.rundir import (
    CONFIG,
    DIVERGED,
    REQUIRED,
    completed,
    diverged,
    read_config,
    read_diverged,
    read_metrics,
    read_results,
    write_json,
    write_metrics,
    write_results,
)

RECORDS = "runs.jsonl.gz"
_FIELDS = {"run": str, "config": dict, "results": dict, "metrics": list}


def records_path(records: Path, name: str) -> Path:
    """The records file of experiment ``name`` in the records folder: ``records/NAME/runs.jsonl.gz``."""
    return Path(records) / name / RECORDS


def finished_runs(out: Path, name: str) -> list[Path]:
    """The run directories of experiment ``name`` under ``out`` (tuning runs included) that ran every round or
    diverged; links to another point's run (an identical config planned twice) are that run's, not recorded
    twice."""
    found = []
    for folder, dirs, _files in os.walk(Path(out) / name):
        dirs[:] = sorted(d for d in dirs if not (Path(folder) / d).is_symlink())
        if completed(folder) or diverged(folder):
            found.append(Path(folder))
    return sorted(found)


def read_records(path: Path) -> dict[str, dict[str, Any]]:
    """The records of a file by run path (relative to the output folder); ValueError naming the file and line for
    one that is not a record or whose path is absolute or climbs out (``..``)."""
    records: dict[str, dict[str, Any]] = {}
    try:
        lines = gzip.decompress(Path(path).read_bytes()).decode().splitlines()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a gzip file of run records ({e}); restore it from git.") from None
    for i, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            raise ValueError(f"{path}, line {i}: not JSON; restore the file from git.") from None
        bad = [k for k, kind in _FIELDS.items() if not isinstance(record, dict) or not isinstance(record.get(k), kind)]
        if not bad and "diverged" in record:  # a run that diverged: why, and no results
            bad = [] if isinstance(record["diverged"], str) and not record["results"] else ["diverged"]
        elif not bad and any(k not in record["results"] for k in REQUIRED):
            bad = ["results"]
        run = PurePosixPath(record["run"] if not bad else "")
        if bad or run.is_absolute() or ".." in run.parts or not run.parts:
            raise ValueError(
                f"{path}, line {i}: not a run record (its {', '.join(bad) or 'path'} is wrong); restore the file "
                "from git."
            )
        records[str(run)] = record
    return records


def restore(path: Path, out: Path) -> tuple[int, int]:
    """Write each record of ``path`` whose run directory under ``out`` holds nothing yet as a finished run
    directory (config, results, metrics; a run that diverged: its mark instead of results); returns how many were
    written and how many records ``path`` holds. Every record is checked before any is written."""
    records = read_records(path)
    written = 0
    for run, record in records.items():
        folder = Path(out) / run
        if folder.exists() and any(folder.iterdir()):
            continue
        folder.mkdir(parents=True, exist_ok=True)
        write_json(folder / CONFIG, record["config"])
        write_metrics(folder, record["metrics"])
        if "diverged" in record:
            write_json(folder / DIVERGED, {"reason": record["diverged"]})
        else:  # last: a folder is finished once it has results (and clients.csv)
            write_results(folder, record["results"])
        written += 1
    return written, len(records)


def save(path: Path, out: Path, name: str) -> int:
    """Rewrite ``path`` with the records it holds and every finished run of ``name`` under ``out`` (a run
    directory replaces its own earlier record); returns how many records it holds. The bytes depend on the
    records alone (in run order, keys as the run wrote them, no time stamp), so an unchanged set of runs leaves the
    file unchanged."""
    records = read_records(path) if Path(path).exists() else {}
    for folder in finished_runs(out, name):
        run = folder.relative_to(out).as_posix()
        outcome = {"results": read_results(folder)} if completed(folder) else {"diverged": read_diverged(folder)}
        records[run] = {"run": run, "config": read_config(folder), "results": {}, "metrics": read_metrics(folder)}
        records[run].update(outcome)
    text = "".join(json.dumps(records[k], allow_nan=False) + "\n" for k in sorted(records))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path).with_suffix(".tmp")
    # a header without file name, time or OS: the same records give the same bytes on any machine
    with tmp.open("wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as fh:
        fh.write(text.encode())
    os.replace(tmp, path)
    return len(records)
