"""Experiment sweeps: a config over a grid of overrides and several seeds, with a mean +- std table.

Each (grid point, seed) is an ordinary run directory under the sweep folder (``OUT/<slug>/seed<S>``,
:func:`fedtailor.rundir.point_dir`), so an interrupted sweep resumes by skipping finished runs (of the same
resolved config: :func:`fedtailor.rundir.finished`) and continuing unfinished ones from their checkpoints.
Aggregation follows the papers: accuracy is averaged within a client, then over clients (inside each run), then
mean and standard deviation over seeds; the table also shows, as mean +- std over seeds, each run's 10th
percentile over clients and the best and validation-chosen round's accuracy where the runs have them
(:func:`fedtailor.report.metric_variants`).
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from pathlib import Path

from fedtailor.config import load_config, parse_override
from fedtailor.experiment import check_data_name
from fedtailor.report import aggregate_seeds, format_table, seed_cells
from fedtailor.rundir import finished, point_dir, slug
from fedtailor.runner import run_experiment

log = logging.getLogger(__name__)


def parse_seeds(text: str) -> list[int]:
    """``"41-45"`` or ``"41,43,47"`` -> list of seeds."""
    out: list[int] = []
    for part in text.split(","):
        if re.fullmatch(r"\s*\d+\s*-\s*\d+\s*", part):
            lo, hi = (int(v) for v in part.split("-"))
            if hi < lo:
                raise ValueError(f"--seeds: the range {part!r} is empty; write LOW-HIGH, e.g. 41-45.")
            out.extend(range(lo, hi + 1))
        elif part.strip().isdigit():
            out.append(int(part))
        else:
            raise ValueError(f"cannot read --seeds {text!r}; use e.g. 41-45 or 41,42,43.")
    twice = sorted({s for s in out if out.count(s) > 1})
    if twice:  # a seed run twice would count twice in the mean and shrink the std over seeds
        raise ValueError(f"--seeds {text!r} gives seed {twice[0]} more than once; give each seed once.")
    return out


def parse_grid(items: list[str]) -> list[tuple[str, list[str]]]:
    """``["method.privacy.epsilon=4,8"]`` -> [("method.privacy.epsilon", ["4", "8"])]."""
    grid = []
    for item in items:
        key, _ = parse_override(item)
        values = [v.strip() for v in item.split("=", 1)[1].split(",") if v.strip()]
        if not values:
            raise ValueError(f"--grid {item!r} has no values; write KEY=V1,V2 (e.g. --grid method.lr=0.05,0.1).")
        twice = [v for i, v in enumerate(values) if v in values[:i]]
        if twice:
            raise ValueError(f"--grid {item!r} lists {twice[0]} more than once; give each value once.")
        if ".".join(key) in (k for k, _ in grid):
            raise ValueError(
                f"--grid {'.'.join(key)} is given twice; give all its values in one --grid {'.'.join(key)}=V1,V2."
            )
        grid.append((".".join(key), values))
    return grid


def run_sweep(
    config: str | Path | None,
    *,
    out: str | Path,
    seeds: list[int],
    grid: list[tuple[str, list[str]]],
    overrides: list[str] = (),
    progress: bool = True,
) -> str:
    """Run every grid point for every seed (skipping finished runs); returns the aggregated table."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; a sweep writes a directory of runs, choose another path.")
    if not seeds:
        raise ValueError("no seeds to run; give --seeds, e.g. 41-43.")
    keys = [("--grid", k) for k, _ in grid] + [("--set", ".".join(parse_override(o)[0])) for o in overrides]
    for flag, key in keys:
        if key.strip() == "seed":  # the run's seed=S from --seeds comes last and would silently win
            raise ValueError(
                f"{flag} seed=...: a sweep takes its seeds from --seeds (e.g. --seeds 41-43); drop {flag} seed."
            )
    points = list(itertools.product(*[[(k, v) for v in vals] for k, vals in grid])) if grid else [()]
    # every point and seed is validated before anything runs: a bad value fails now, not after hours
    configs = {}
    for point in points:
        for seed in seeds:
            sets = [*overrides, *(f"{k}={v}" for k, v in point), f"seed={seed}"]
            try:
                configs[point, seed] = load_config(config, sets)
            except ValueError as err:
                raise ValueError(f"sweep point {slug(point)}, seed {seed}: {err}") from None
            check_data_name(configs[point, seed])
    rows = []
    for point in points:
        run_dirs = []
        for seed in seeds:
            run_dir = point_dir(out, point, seed)
            if not finished(run_dir, configs[point, seed]):  # a run of another config there is refused
                log.info("sweep: %s seed %d -> %s", slug(point), seed, run_dir)
                started = run_dir.is_dir() and any(run_dir.iterdir())
                run_experiment(configs[point, seed], run_dir, resume=started, progress=progress)
            run_dirs.append(run_dir)
        stats = aggregate_seeds(run_dirs)
        row = dict(point)
        row.update(seed_cells(stats, ("seen/accuracy", "future/accuracy")))
        for key in (
            "epsilon_max",
            "sigma",
            "T_max",
            "bits_per_coefficient_mean",
            "uplink_payload_MB",
            "perturbation_norm_mean",
            "encode_ms_mean",
        ):
            if key in stats:
                row[key] = f"{stats[key][0]:.4g}"
        rows.append(row)
    table = f"{len(seeds)} seeds ({', '.join(map(str, seeds))}), mean +- std over seeds\n" + format_table(rows)
    (out / "sweep.md").write_text(table + "\n")
    (out / "sweep.json").write_text(json.dumps(rows, indent=2))
    return table
