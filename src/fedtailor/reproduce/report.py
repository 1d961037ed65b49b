"""The report of ``fedtailor reproduce``, from the finished runs of a plan: per experiment ``table.md`` and
``table.csv`` (mean +- std over seeds of the per-client means, per point, with each run's 10th percentile over
clients and its best and validation-chosen round's mean where the runs have them), ``accuracy.png`` (a bar per
point with the seed spread) and ``trend.png`` where the experiment has a numeric axis (each metric against eps,
alpha or k, as the papers' figures); and ``OUT/report.html`` linking every experiment with its tables and images
inline (one file, no external resources)."""

from __future__ import annotations

import base64
import csv
import html
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedtailor.fl.experiments import EXPERIMENTS, Experiment
from fedtailor.report import aggregate_seeds, is_accuracy, metric_variants, seed_cells
from fedtailor.reproduce.plan import Run
from fedtailor.rundir import slug


def tables(runs: list[Run], *, out: Path, registry: Mapping[str, Experiment] = EXPERIMENTS) -> list[Path]:
    """table.md, table.csv and accuracy.png per experiment (finished runs only); returns the written folders."""
    folders = []
    for name in dict.fromkeys(r.experiment for r in runs):
        exp = registry[name]
        groups: dict[tuple[str, str], list[Path]] = {}
        values: dict[tuple[str, str], dict[str, str]] = {}  # each point's grid values by short key (for trend.png)
        for r in runs:
            if r.experiment == name and r.done:
                groups.setdefault((r.block, slug(r.point)), []).append(r.out)
                values[(r.block, slug(r.point))] = {k.split(".")[-1]: v.strip('"') for k, v in r.point}
        rows = []
        for (block, point), dirs in groups.items():
            stats = aggregate_seeds(dirs)
            row = {"block": block, "point": point, "seeds": len(dirs)}
            row.update(seed_cells(stats, exp.metrics))
            for m in exp.metrics:  # the numbers the plots draw, accuracies in percent
                if m in stats:
                    scale = 100.0 if is_accuracy(m) else 1.0
                    row[m + " (mean)"], row[m + " (std)"] = scale * stats[m][0], scale * stats[m][1]
            rows.append(row)
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        cols = table_columns(exp, rows)
        md = [f"# {name}", "", exp.description, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        md += ["| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |" for r in rows]
        (folder / "table.md").write_text("\n".join(md) + "\n")
        with (folder / "table.csv").open("w", newline="") as fh:
            fields = sorted({k for r in rows for k in r}, key=lambda k: (k not in ("block", "point", "seeds"), k))
            writer = csv.DictWriter(fh, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
        _bar_plot(rows, exp.metrics, folder / "accuracy.png", title=name)
        if exp.x_axis and rows:
            _trend_plot(rows, [values[(r["block"], r["point"])] for r in rows], exp, folder / "trend.png")
        folders.append(folder)
    return folders


def table_columns(exp: Experiment, rows: list[dict[str, Any]]) -> list[str]:
    """The columns of an experiment's table: the point, then each metric with its variants
    (:func:`fedtailor.report.metric_variants`) that some row has."""
    variants = [k for m in exp.metrics for k in metric_variants(m)]
    return ["block", "point", "seeds", *[k for k in variants if any(k in r for r in rows)]]


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
        ax.set_xlabel("eps" if exp.x_axis == "block" else exp.x_axis)
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
