"""The tuning stage of ``fedtailor reproduce NAME --tune``: each point of an experiment (every compared method and
variant, at each setting) gets its own values of the experiment's tuning grid (:class:`~fedtailor.fl.experiments.
Tuning`: the step size, and mu or lambda where a method has them), chosen on a validation split of the seen
clients' training records from the same grid and budget for all, so that no method is compared at a step size
tuned for another.

The tuning runs are ordinary run directories ``OUT/NAME/tuning/<block>/<point>_<tuning point>/seed<S>``. The
choices are written to ``OUT/NAME/tuning/choices.json`` (with every score) and ``tuning.csv``; committed as
``configs/tuned/NAME.json`` they are what a plain ``fedtailor reproduce NAME`` uses (:func:`.plan.load_choices`: the
output folder's own choices first, then the committed ones). A point without a choice runs at its config's values.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path

from fedtailor.fl.experiments import EXPERIMENTS, Experiment
from fedtailor.reproduce.plan import (
    CHOICES,
    Run,
    choices_record,
    resolve,
    specs,
    tuned_keys,
    tuning_dir,
    unit_key,
)
from fedtailor.rundir import point_dir, read_results, slug

log = logging.getLogger(__name__)


def plan_tuning(
    names: list[str], *, out: Path, quick: bool, registry: Mapping[str, Experiment] = EXPERIMENTS
) -> list[Run]:
    """Every tuning run of the named experiments that have a tuning stage (``NAME/BLOCK``: those blocks), each
    config validated now."""

    runs: list[Run] = []
    for spec in specs(names, registry):
        name, _, only = spec.partition("/")
        exp = registry[name]
        if exp.tuning is None:
            continue
        tuning = exp.tuning
        tuned = {k for k, _ in tuning.grid}
        for block in exp.blocks:
            if (only and block.name not in only.split(",")) or block.needs is not None:
                continue
            if tuning.on is not None and not only and block.name != tuning.on:
                continue  # the other blocks use the choices made on this one, unless named (NAME/BLOCK)
            fixed = tuned & {s.partition("=")[0] for s in block.sets} | tuned & {k for k, _ in block.grid}
            if fixed:
                raise ValueError(f"{name}/{block.name} sets {sorted(fixed)[0]}, which its tuning stage tunes.")
            for point in block.points():
                try:
                    keys = tuned_keys(exp, block, point, quick=quick)
                except ValueError as err:
                    raise ValueError(f"{name}/tuning/{block.name}/{slug(point)}: {err}") from None
                for values in tuning.points(keys):
                    for seed in tuning.seeds[:1] if quick else tuning.seeds:
                        sets = [
                            *block.sets,
                            *tuning.sets,
                            *(exp.quick if quick else ()),
                            *(f"{k}={v}" for k, v in (*point, *values)),
                            f"seed={seed}",
                        ]
                        label = f"{name}/tuning/{block.name}/{slug(point)} seed {seed}"
                        config, cfg = resolve(label, block.config, sets)
                        run_dir = point_dir(tuning_dir(out, name) / block.name, (*point, *values), seed)
                        block_name = f"tuning/{block.name}"
                        runs.append(Run(name, block_name, (*point, *values), seed, config, sets, run_dir, cfg))
    return runs


def _score(run: Run, metric: str) -> float:
    """The tuning metric of a finished run; NaN for one that failed, diverged or did not finish."""
    try:
        return float(read_results(run.out)["summary"][metric]) if run.done else math.nan
    except (FileNotFoundError, KeyError, ValueError):
        return math.nan


def choose(runs: list[Run], *, out: Path, quick: bool, registry: Mapping[str, Experiment] = EXPERIMENTS) -> list[Path]:
    """For each tuned point, the grid values with the highest mean of the tuning metric over the tuning seeds
    (ties: the first in grid order; a point's values with a failed or diverged run score nothing). Writes
    ``choices.json`` and ``tuning.csv`` in each experiment's tuning folder and returns their paths. ``quick``: the
    runs were at the reduced scale (their choices are used only at that scale). ``at_edge`` in ``choices.json``
    lists the points whose choice is the first or last value of a grid key (logged too): the best may lie beyond
    the grid, which should be widened there."""
    written: list[Path] = []
    for name in dict.fromkeys(r.experiment for r in runs):
        tuning = registry[name].tuning
        assert tuning is not None  # only experiments with a tuning stage have tuning runs
        keys = {k for k, _ in tuning.grid}
        rows = []
        for r in (r for r in runs if r.experiment == name):
            unit = unit_key(r.block.removeprefix("tuning/"), tuple(kv for kv in r.point if kv[0] not in keys))
            values = tuple(kv for kv in r.point if kv[0] in keys)
            rows.append({"point": unit, "tuning": slug(values), "values": dict(values), "seed": r.seed})
            rows[-1][tuning.metric] = _score(r, tuning.metric)
        scores: dict[str, dict[str, float]] = {}  # point -> tuning slug -> mean over seeds (NaN if any failed)
        for row in rows:
            seeds = [x[tuning.metric] for x in rows if x["point"] == row["point"] and x["tuning"] == row["tuning"]]
            scores.setdefault(row["point"], {})[row["tuning"]] = sum(seeds) / len(seeds)
        choices: dict[str, dict[str, str]] = {}
        for unit, by_values in scores.items():
            ranked = [v for v, score in by_values.items() if not math.isnan(score)]
            if not ranked:
                log.warning("tuning %s/%s: no tuning run finished; it keeps its config's values", name, unit)
                continue
            best = max(ranked, key=by_values.__getitem__)  # max keeps the first of equals
            choices[unit] = next(row["values"] for row in rows if row["point"] == unit and row["tuning"] == best)
        # points tuned before and not now (another block, an earlier session) keep their choices and scores
        earlier = choices_record(name, out=out, quick=quick)
        kept = [u for u in earlier.get("choices", {}) if u not in scores] if earlier.get("quick") == quick else []
        choices = {**{u: earlier["choices"][u] for u in kept}, **choices}
        scores = {**{u: earlier["scores"][u] for u in kept if u in earlier.get("scores", {})}, **scores}
        folder = tuning_dir(out, name)
        if (folder / "tuning.csv").exists():
            with (folder / "tuning.csv").open(newline="") as f:
                rows = [  # "values" only says whether the row was the chosen one (the writer compares them)
                    {**r, "seed": int(r["seed"]), "values": choices[r["point"]] if r["chosen"] == "True" else {}}
                    for r in csv.DictReader(f)
                    if r["point"] in kept
                ] + rows
        # a choice on the first or last value of a grid key may lie outside the grid's reach: widen the grid there
        edges = {k: (v[0], v[-1]) for k, v in tuning.grid}
        at_edge = sorted(u for u, c in choices.items() if any(c[k] in edges[k] for k in c if len(set(edges[k])) > 1))
        for unit in at_edge:
            log.warning("tuning %s/%s: the choice %s is at the edge of the grid", name, unit, choices[unit])
        folder.mkdir(parents=True, exist_ok=True)
        record = {
            "experiment": name,
            "quick": quick,
            "metric": tuning.metric,
            "sets": list(tuning.sets),
            "grid": {k: list(v) for k, v in tuning.grid},
            "seeds": sorted({row["seed"] for row in rows}),
            "choices": choices,
            "scores": scores,
            "at_edge": at_edge,
        }
        (folder / CHOICES).write_text(json.dumps(record, indent=1) + "\n")
        with (folder / "tuning.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["point", "tuning", "seed", tuning.metric, "chosen"])
            writer.writeheader()
            for row in rows:
                chosen = row["point"] in choices and choices[row["point"]] == row["values"]
                writer.writerow({k: row[k] for k in ("point", "tuning", "seed", tuning.metric)} | {"chosen": chosen})
        written += [folder / CHOICES, folder / "tuning.csv"]
    return written
