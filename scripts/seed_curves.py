"""Learning curves over seeds for the grid points of one or more sweeps: a PNG and a Markdown table.

Each grid point is a folder of ``seedNN`` run directories (what ``fedtailor sweep`` writes). For every point the
script plots the mean and the min-max band over seeds of an evaluation metric against the round, and tabulates
the final value (mean +- std over seeds), the best over rounds (labelled so) and the late-training swing (max -
min over the last ``--last`` evaluations, averaged over seeds).

    python scripts/seed_curves.py runs/val-const runs/val-cos --metric seen/accuracy \\
        --png docs/figures/step_selection.png --table docs/figures/step_selection.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from fedtailor.rundir import completed, read_metrics, seed_dirs


def curves(point: Path, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """(rounds, values of shape (seeds, rounds)) of the finished runs under ``point``."""
    series = []
    for run in seed_dirs(point):
        if not completed(run):
            continue
        history = read_metrics(run)
        series.append([(r["round"], r[metric]) for r in history if metric in r])
    if not series:
        return np.empty(0), np.empty((0, 0))
    rounds = np.array([r for r, _ in series[0]])
    return rounds, np.array([[v for _, v in s] for s in series if len(s) == len(rounds)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweeps", nargs="+", type=Path)
    ap.add_argument("--metric", default="seen/accuracy")
    ap.add_argument("--last", type=int, default=5, help="evaluations that count as late training")
    ap.add_argument("--png", type=Path, required=True)
    ap.add_argument("--table", type=Path, required=True)
    ap.add_argument("--title", default="")
    ap.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="POINT=TEXT",
        help="legend text for a grid point (text without '='), e.g. 'val-cos/lr=0.1=cosine, lr 0.1'",
    )
    args = ap.parse_args()
    names = dict(item.rsplit("=", 1) for item in args.label)  # grid points contain "=", the text must not
    points = [
        (names.get(f"{s.name}/{p.name}", f"{s.name}/{p.name}"), p)
        for s in args.sweeps
        for p in sorted(s.iterdir())
        if p.is_dir()
    ]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    rows = [
        "| setting | seeds | final (mean +- std) | best over rounds (mean) | late swing (max - min, last "
        f"{args.last} evaluations) |",
        "|---|---|---|---|---|",
    ]
    for label, point in points:
        rounds, values = curves(point, args.metric)
        if values.size == 0:
            continue
        mean = values.mean(0)
        ax.plot(rounds, 100 * mean, label=f"{label} ({len(values)} seeds)")
        ax.fill_between(rounds, 100 * values.min(0), 100 * values.max(0), alpha=0.15)
        late = values[:, -args.last :]
        swing = float((late.max(1) - late.min(1)).mean())
        final = values[:, -1]
        rows.append(
            f"| {label} | {len(values)} | {100 * final.mean():.2f} "
            f"+- {100 * final.std(ddof=1) if len(final) > 1 else 0:.2f}"
            f" | {100 * values.max(1).mean():.2f} | {100 * swing:.2f} |"
        )
    ax.set_xlabel("round")
    ax.set_ylabel(f"{args.metric} (%)")
    ax.set_title(args.title or f"{args.metric}: mean over seeds, band = min..max")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=120)
    args.table.write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
