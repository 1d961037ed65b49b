"""The report of ``fedtailor reproduce``, from the finished runs of a plan: per experiment ``table.md`` and
``table.csv`` (mean +- std over seeds of the per-client means, per point, with each run's 10th percentile over
clients and its best and validation-chosen round's mean where the runs have them, and how many seeds diverged
where some did), ``accuracy.png`` (a bar per
point with the seed spread) and ``trend.png`` where the experiment has a numeric axis (each metric against eps,
alpha or k, as the papers' figures); and ``OUT/report.html`` linking every experiment with its tables and images
inline (one file, no external resources). An experiment with a ``reference`` point also gets ``paired.md`` and
``paired.csv``: each point's difference from its reference, paired by seed (mean, a Student-t 95% interval over
seeds, the per-seed differences) and by (seed, client) (a percentile-bootstrap 95% interval over those pairs). An
experiment with ``round_metrics`` also gets ``rounds.md`` and ``rounds.csv``: those per-round metrics at every
round logged, over seeds. A metric ``late/NAME`` is the per-round metric NAME averaged over the second half of each
run's rounds (:func:`late_mean`: where a paper compares the end of its curves)."""

from __future__ import annotations

import base64
import csv
import html
import math
import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from scipy.special import stdtrit

from fedtailor.fl.experiments import EXPERIMENTS, Claim, Experiment
from fedtailor.report import aggregate_seeds, is_accuracy, metric_variants, seed_cells
from fedtailor.reproduce.plan import Run
from fedtailor.rundir import Point, read_metrics, read_results, slug


def tables(runs: list[Run], *, out: Path, registry: Mapping[str, Experiment] = EXPERIMENTS) -> list[Path]:
    """table.md, table.csv and accuracy.png per experiment (finished runs only); returns the written folders."""
    folders = []
    for name in dict.fromkeys(r.experiment for r in runs):
        exp = registry[name]
        groups: dict[tuple[str, str], list[Path]] = {}
        diverged: Counter[tuple[str, str]] = Counter()  # runs that diverged, per point: an outcome the table shows
        values: dict[tuple[str, str], dict[str, str]] = {}  # each point's grid values by short key (for trend.png)
        for r in runs:
            if r.experiment == name and (r.done or r.diverged):
                key = (r.block, slug(r.point))
                groups.setdefault(key, [])
                if r.done:
                    groups[key].append(r.out)
                else:
                    diverged[key] += 1
                values[key] = _short_values(r.point)
        rows = []
        for (block, point), dirs in groups.items():
            stats = {**aggregate_seeds(dirs), **_late_stats(dirs, exp.metrics)} if dirs else {}
            row = {"block": block, "point": point, "seeds": len(dirs)}
            if diverged[(block, point)]:
                row["diverged"] = diverged[(block, point)]
            row.update(seed_cells(stats, exp.metrics))
            row.update(_listed_cells(dirs, exp.metrics))
            for m in exp.metrics:  # the numbers the plots draw, accuracies in percent
                if m in stats:
                    scale = 100.0 if is_accuracy(m) else 1.0
                    row[m + " (mean)"], row[m + " (std)"] = scale * stats[m][0], scale * stats[m][1]
            rows.append(row)
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        now = {r.block for r in runs if r.experiment == name}
        rows = _in_block_order(exp, _earlier_rows(folder / "table.csv", exp, now) + rows)
        for row in rows:
            if (row["block"], row["point"]) not in values:  # a row kept from an earlier reproduction
                values[(row["block"], row["point"])] = _grid_values(exp, row["block"], row["point"])
        cols = table_columns(exp, rows)
        md = [f"# {name}", "", exp.description, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        md += ["| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |" for r in rows]
        (folder / "table.md").write_text("\n".join(md) + "\n")
        with (folder / "table.csv").open("w", newline="") as fh:
            fields = sorted({k for r in rows for k in r}, key=lambda k: (k not in ("block", "point", "seeds"), k))
            writer = csv.DictWriter(fh, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
        if exp.reference:
            _paired_tables([r for r in runs if r.experiment == name and r.done], exp, folder, keep_except=now)
        if exp.round_metrics:
            _round_tables([r for r in runs if r.experiment == name and r.done], exp, folder, keep_except=now)
        _bar_plot(rows, exp.metrics, folder / "accuracy.png", title=name)
        if exp.x_axis and rows:
            _trend_plot(rows, [values[(r["block"], r["point"])] for r in rows], exp, folder / "trend.png")
        folders.append(folder)
    return folders


LATE = "late/"


def late_mean(run_dir: Path, name: str) -> float | None:
    """The per-round metric ``name`` of a run averaged over the second half of its rounds (rounds after R/2 of the R
    it completed), over the rounds that logged a finite value; None when none did."""
    half = int(read_results(run_dir)["rounds_completed"]) // 2
    values = [r.get(name) for r in read_metrics(run_dir) if int(r["round"]) > half]
    finite = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return float(np.mean(finite)) if finite else None


def run_value(run_dir: Path, metric: str) -> float | None:
    """A run's figure ``metric``: a key of its summary, or ``late/NAME`` (:func:`late_mean`); None when missing."""
    if metric.startswith(LATE):
        return late_mean(run_dir, metric.removeprefix(LATE))
    value = read_results(run_dir)["summary"].get(metric)
    return None if value is None else float(value)


def _late_stats(dirs: list[Path], metrics: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """Mean and standard deviation over runs (seeds) of each ``late/NAME`` metric every run has."""
    stats = {}
    for metric in (m for m in metrics if m.startswith(LATE)):
        values = [run_value(d, metric) for d in dirs]
        if values and all(v is not None for v in values):
            std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
            stats[metric] = (float(np.mean(values)), std)
    return stats


def _listed_cells(dirs: list[Path], metrics: tuple[str, ...]) -> dict[str, str]:
    """The cells of the metrics each run reports as a list of names (FedLAG's personal layers,
    ``fedlag_personal``): how many of the seeds chose each name, e.g. ``fc.bias 3/3, fc1.bias 2/3``."""
    cells = {}
    for metric in metrics:
        lists = [read_results(d).get("method_summary", {}).get(metric) for d in dirs]
        if lists and all(isinstance(v, list) for v in lists):
            counts = Counter(str(name) for v in lists for name in v)
            cells[metric] = ", ".join(f"{n} {c}/{len(lists)}" for n, c in sorted(counts.items())) or "none"
    return cells


def _earlier_rows(path: Path, exp: Experiment, blocks: set[str]) -> list[dict[str, Any]]:
    """The rows of an earlier ``table.csv`` or ``paired.csv`` in the output folder for the experiment's blocks other
    than ``blocks`` (a reproduction of ``NAME/BLOCK`` adds its rows to the table of the blocks run before; a block
    the experiment no longer has is dropped), the plotted numbers as floats."""
    if not path.exists():
        return []
    keep = {b.name for b in exp.blocks} - blocks
    with path.open(newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("block") in keep]
    for row in rows:
        for k, v in row.items():
            if k.endswith((" (mean)", " (std)")) and v:
                row[k] = float(v)
    return [{k: v for k, v in r.items() if v != ""} for r in rows]


def _in_block_order(exp: Experiment, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` in the order of the experiment's blocks (stable within a block)."""
    order = {b.name: i for i, b in enumerate(exp.blocks)}
    return sorted(rows, key=lambda r: order[r["block"]])


def _short_values(point: Point) -> dict[str, str]:
    """A point's grid values by short key (``method.coef_dim`` -> ``coef_dim``), unquoted, as the plots name them."""
    return {k.split(".")[-1]: v.strip('"') for k, v in point}


def _grid_values(exp: Experiment, block: str, point: str) -> dict[str, str]:
    """The grid values of the point named ``point`` in ``block`` (a row kept from an earlier reproduction)."""
    for b in exp.blocks:
        for p in b.points() if b.name == block else ():
            if slug(p) == point:
                return _short_values(p)
    return {}


def paired_difference(
    ours: Mapping[int, Path], ref: Mapping[int, Path], metric: str, *, resamples: int = 10_000
) -> dict[str, Any] | None:
    """``metric`` (``GROUP/NAME`` of a run's summary, or ``late/NAME``: :func:`run_value`) of the runs ``ours`` minus
    that of ``ref`` (both by seed), on the seeds they share: the mean difference over seeds with a Student-t 95%
    interval (two seeds at least), the per-seed differences, and for a summary metric a percentile-bootstrap 95%
    interval of the mean difference over the (seed, client) pairs of the group's clients present in both
    (``resamples`` draws from a generator seeded with 0: the same files give the same interval). None when they share
    no seed or the metric is missing."""
    seeds = sorted(set(ours) & set(ref))
    group, _, name = metric.partition("/")
    diffs, pairs = [], []
    for seed in seeds:
        mine, theirs = run_value(ours[seed], metric), run_value(ref[seed], metric)
        if mine is None or theirs is None:
            return None
        diffs.append(mine - theirs)
        if metric.startswith(LATE):  # a per-round metric of the whole run: no per-client values
            continue
        a, b = read_results(ours[seed]), read_results(ref[seed])
        per_b = {c["client"]: c for c in b["per_client"] if _in_group(c, group) and name in c}
        pairs += [
            float(c[name]) - float(per_b[c["client"]][name])
            for c in a["per_client"]
            if c["client"] in per_b and _in_group(c, group) and name in c
        ]
    if not diffs:
        return None
    scale = 100.0 if name.endswith("accuracy") else 1.0
    out: dict[str, Any] = {"seeds": len(diffs), "mean": scale * float(np.mean(diffs))}
    out["per seed"] = " ".join(f"{scale * d:+.2f}" for d in diffs)
    if len(diffs) > 1:
        half = float(stdtrit(len(diffs) - 1, 0.975)) * float(np.std(diffs, ddof=1)) / math.sqrt(len(diffs))
        out["seeds ci95"] = f"[{out['mean'] - scale * half:+.2f}, {out['mean'] + scale * half:+.2f}]"
    if len(pairs) > 1:
        v = np.asarray(pairs)
        means = v[np.random.default_rng(0).integers(0, v.size, size=(resamples, v.size))].mean(axis=1)
        lo, hi = np.percentile(means, [2.5, 97.5])
        out["client pairs"] = v.size
        out["clients ci95"] = f"[{scale * lo:+.2f}, {scale * hi:+.2f}]"
    out["mean"] = f"{out['mean']:+.2f}"
    return out


def _in_group(client: Mapping[str, Any], group: str) -> bool:
    """Whether a per-client row belongs to a summary group (seen, future or all)."""
    return group == "all" or bool(client["seen"]) == (group == "seen")


def _reference_of(block: str, point: Point, points: list[tuple[str, Point]], refs: tuple[tuple[str, str], ...]) -> Any:
    """The (block, point) ``point`` is compared with: its other grid values and those of the first of ``refs``
    whose key it has (else the first), in the same block, else the one such point in another block; None for the
    reference itself or when there is none."""
    ref = next((r for r in refs if r[0] in dict(point)), refs[0])
    if dict(point).get(ref[0]) == ref[1]:
        return None
    want = {**{k: v for k, v in point if k != ref[0]}, ref[0]: ref[1]}
    matches = [(b, p) for b, p in points if dict(p) == want]
    for pick in ([m for m in matches if m[0] == block], [m for m in matches if block.startswith(m[0])], matches):
        if len(pick) == 1:
            return pick[0]
    return None


def verdict(claim: Claim, diff: Mapping[str, Any]) -> str:
    """A claim's verdict from a paired difference: *reproduced* when the 95% interval over seeds lies on the claimed
    side of zero (or, for ``within``, inside +-bound), *not reproduced* when it lies entirely on the other side (or
    outside the bound), *not settled* when it straddles; with one seed there is no interval: *not settled*."""
    if "seeds ci95" not in diff:
        return "not settled (one seed)"
    lo, hi = (float(x) for x in str(diff["seeds ci95"]).strip("[]").split(","))
    if claim.expect == "within":
        inside, outside = -claim.bound <= lo and hi <= claim.bound, hi < -claim.bound or lo > claim.bound
    else:
        sign = 1.0 if claim.expect == "above" else -1.0
        inside, outside = min(sign * lo, sign * hi) > 0, max(sign * lo, sign * hi) < 0
    return "reproduced" if inside else "not reproduced" if outside else "not settled (interval spans the claim)"


def _paired_tables(runs: list[Run], exp: Experiment, folder: Path, *, keep_except: set[str]) -> None:
    """paired.md and paired.csv: every point against its reference point, for each of the experiment's metrics;
    the rows of an earlier ``paired.csv`` for blocks other than ``keep_except`` are kept."""
    assert exp.reference
    by_point: dict[tuple[str, Point], dict[int, Path]] = {}
    for r in runs:
        by_point.setdefault((r.block, r.point), {})[r.seed] = r.out
    rows = []
    for (block, point), dirs in by_point.items():
        ref = _reference_of(block, point, list(by_point), exp.reference)
        if ref is None:
            continue
        for metric in exp.metrics:
            diff = paired_difference(dirs, by_point[ref], metric)
            claim = next(
                (
                    c
                    for c in exp.claims
                    if c.metric == metric and set(c.point) <= set(point) and c.block in (None, block)
                ),
                None,
            )
            if diff is not None and claim is not None:
                diff = {**diff, "paper": claim.paper, "verdict": verdict(claim, diff)}
            if diff is not None:
                rows.append(
                    {
                        "block": block,
                        "point": slug(point),
                        "reference": f"{ref[0]}/{slug(ref[1])}",
                        "metric": metric,
                        **diff,
                    }
                )
    rows = _in_block_order(exp, _earlier_rows(folder / "paired.csv", exp, keep_except) + rows)
    cols = [
        "block",
        "point",
        "reference",
        "metric",
        "seeds",
        "mean",
        "seeds ci95",
        "per seed",
        "client pairs",
        "clients ci95",
        "paper",
        "verdict",
    ]
    note = (
        "Each point minus its reference (accuracies in points), paired by seed (Student-t 95% interval over seeds) "
        "and by (seed, client) (percentile bootstrap)."
    )
    _write_table(folder / "paired", f"{exp.name}: paired differences", note, cols, rows)


def _round_tables(runs: list[Run], exp: Experiment, folder: Path, *, keep_except: set[str]) -> None:
    """rounds.md and rounds.csv: each of the experiment's ``round_metrics`` per point at every round the runs logged
    it (mean +- std over the seeds that logged a finite value, and how many did); the rows of an earlier
    ``rounds.csv`` for blocks other than ``keep_except`` are kept."""
    by_point: dict[tuple[str, str], list[Path]] = {}
    for r in runs:
        by_point.setdefault((r.block, slug(r.point)), []).append(r.out)
    rows = []
    for (block, point), dirs in by_point.items():
        logged: dict[int, dict[str, list[float]]] = {}  # round -> metric -> one value per seed
        for d in dirs:
            for record in read_metrics(d):
                for m in exp.round_metrics:
                    v = record.get(m)
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                        logged.setdefault(int(record["round"]), {}).setdefault(m, []).append(float(v))
        for rnd in sorted(logged):
            row: dict[str, Any] = {"block": block, "point": point, "round": rnd}
            for m, vals in logged[rnd].items():
                std = float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0
                row[m] = f"{np.mean(vals):.3g} +- {std:.2g} ({len(vals)})"
            rows.append(row)
    rows = _in_block_order(exp, _earlier_rows(folder / "rounds.csv", exp, keep_except) + rows)
    cols = ["block", "point", "round", *exp.round_metrics]
    note = "Mean +- std over seeds at each round the runs logged them (in brackets: how many seeds did)."
    _write_table(folder / "rounds", f"{exp.name}: per-round metrics", note, cols, rows)


def _write_table(stem: Path, title: str, note: str, cols: list[str], rows: list[dict[str, Any]]) -> None:
    """``stem``.md (a title, a note and the rows, "-" where a row has no value) and ``stem``.csv (the same columns)."""
    md = [f"# {title}", "", note, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |" for r in rows]
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")
    with stem.with_suffix(".csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=cols)
        writer.writeheader()
        writer.writerows(rows)


def table_columns(exp: Experiment, rows: list[dict[str, Any]]) -> list[str]:
    """The columns of an experiment's table: the point, then each metric with its variants
    (:func:`fedtailor.report.metric_variants`) that some row has."""
    variants = [k for m in exp.metrics for k in metric_variants(m)]
    shown = ["diverged"] if any("diverged" in r for r in rows) else []  # seeds whose run diverged (no results)
    return ["block", "point", "seeds", *shown, *[k for k in variants if any(k in r for r in rows)]]


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (imported on first use: planning needs no plotting)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bar_plot(rows: list[dict], metrics: tuple[str, ...], path: Path, *, title: str) -> None:
    plt = _pyplot()

    metrics = tuple(m for m in metrics if m.endswith("accuracy"))  # the plot shows accuracies; the table the rest
    labels = [f"{r['block']}\n{r['point']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(rows) * len(metrics)), 3.6))
    width = 0.8 / max(1, len(metrics))
    for j, m in enumerate(metrics):
        means = [r.get(m + " (mean)", 0) for r in rows]
        stds = [r.get(m + " (std)", 0) for r in rows]
        ax.bar([i + j * width for i in range(len(rows))], means, width, yerr=stds, label=m, capsize=2)
    ax.set_xticks([i + width * (len(metrics) - 1) / 2 for i in range(len(rows))], labels, fontsize=6, rotation=90)
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _trend_plot(rows: list[dict], points: list[dict[str, str]], exp: Experiment, path: Path) -> None:
    """Each metric against ``exp.x_axis``, one line (with the seed spread) per value of the other grid keys;
    ``points[i]`` holds the grid values of ``rows[i]`` by short key (slugs cannot be split back: keys such as
    ``coef_dim`` contain the slug's separator)."""
    plt = _pyplot()

    def split(row: dict, point: dict[str, str]) -> tuple[float, str]:
        point = dict(point)
        if exp.x_axis == "block":
            return float(re.sub(r"[^0-9.]", "", row["block"]) or "nan"), row["point"]
        if exp.x_axis not in point:
            raise ValueError(f"{exp.name}: the point {row['point']!r} has no {exp.x_axis!r} to plot against.")
        x = float(point.pop(exp.x_axis))
        return x, "_".join(f"{k}={v}" for k, v in point.items()) or row["block"]

    metrics = [m for m in exp.metrics if any(m + " (mean)" in r for r in rows)]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.3), squeeze=False)
    lines: dict[str, list[tuple[float, dict]]] = {}
    for row, point in zip(rows, points):
        x, label = split(row, point)
        lines.setdefault(label, []).append((x, row))
    for ax, m in zip(axes[0], metrics):
        for label, pts in lines.items():
            pts = sorted(((x, r) for x, r in pts if m + " (mean)" in r), key=lambda t: t[0])
            ax.errorbar(
                [x for x, _ in pts],
                [r[m + " (mean)"] for _, r in pts],
                yerr=[r[m + " (std)"] for _, r in pts],
                marker="o",
                capsize=2,
                label=label,
            )
        ax.set_xlabel(re.sub(r"[0-9.]+$", "", exp.blocks[0].name) if exp.x_axis == "block" else exp.x_axis)
        ax.set_ylabel(m + (" (%)" if m.endswith("accuracy") else ""))
        if exp.log_x:
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(exp.name, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def html_report(folders: list[Path], *, out: Path, registry: Mapping[str, Experiment] = EXPERIMENTS) -> Path:
    """One self-contained HTML page: each experiment's description, table and plot (images inlined)."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>fedtailor reproduction</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #999;padding:3px 8px;text-align:right}img{max-width:100%}</style></head><body>",
        "<h1>fedtailor reproduction</h1>",
    ]
    for folder in folders:
        exp = registry[folder.name]
        parts.append(
            f"<h2 id='{html.escape(exp.name)}'>{html.escape(exp.name)}</h2><p>{html.escape(exp.description)}</p>"
        )
        with (folder / "table.csv").open() as fh:
            rows = list(csv.DictReader(fh))
        cols = table_columns(exp, rows)
        parts.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in cols) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in cols) + "</tr>" for r in rows]
        parts.append("</table>")
        for table, title in (
            ("paired.csv", "Paired differences from the reference point"),
            ("rounds.csv", "Per round"),
        ):
            if (folder / table).exists():
                with (folder / table).open() as fh:
                    extra = list(csv.DictReader(fh))
                if extra:
                    parts.append(f"<h3>{title}</h3><table><tr>")
                    parts[-1] += "".join(f"<th>{html.escape(c)}</th>" for c in extra[0]) + "</tr>"
                    parts += [
                        "<tr>" + "".join(f"<td>{html.escape(v or '')}</td>" for v in r.values()) + "</tr>"
                        for r in extra
                    ]
                    parts.append("</table>")
        for png in (folder / "accuracy.png", folder / "trend.png"):
            if png.exists():
                data = base64.b64encode(png.read_bytes()).decode()
                parts.append(
                    f"<p><img alt='{html.escape(exp.name)} {png.stem}' src='data:image/png;base64,{data}'></p>"
                )
    # a rendering check for browsers and tests: how many images decoded
    parts.append(
        "<script>window.addEventListener('load',()=>{document.body.setAttribute('data-images-loaded',"
        "[...document.images].filter(i=>i.naturalWidth>0).length)});</script>"
    )
    parts.append("</body></html>")
    path = out / "report.html"
    path.write_text("\n".join(parts))
    return path
