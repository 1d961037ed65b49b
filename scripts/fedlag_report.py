"""FedLAG results from sweep folders: the table of every base with and without FedLAG (mean +- std over seeds,
paired differences), the First/Middle/Last-K comparison, and a heat map of the conflict counts per layer over the
warm-up.

    python scripts/fedlag_report.py runs/fedlag-mnist-a01 [runs/fedlag-mnist-a10 ...] \
        --table docs/results/fedlag-mnist/fedlag.md --png docs/figures/fedlag_gc_mnist.png

Each folder holds ``main/`` (grid method.name x method.fedlag.top_k=0,2) and optionally ``fixed/`` (grid
method.fedlag.choice=first,middle,last with FedAvg), as written by the sweep commands of docs/fedlag.md, or is an
experiment folder of ``fedtailor reproduce`` with ``main-<tag>/`` and ``fixed-<tag>/`` pairs (one section per tag:
``fedlag-mnist`` has ``alpha01`` and ``alpha10``). Bases and fixed choices that were not run are left out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from fedtailor.rundir import RESULTS, Results, completed, read_results, seed_dirs

# what this report reads of a run's results.json
NEEDS = ("rounds", "rounds_completed", "summary")


def bases() -> tuple[str, ...]:
    """Every registered base FedLAG wraps (:func:`fedtailor.fl.registry.fedlag_bases`)."""
    from fedtailor.fl.registry import fedlag_bases

    return fedlag_bases()


def _finished(run: Path) -> Results | None:
    """The results of a run that ran every round, None for one that did not (or is not there)."""
    return read_results(run, require=NEEDS) if completed(run) else None


def _personal_layers(results: Results) -> list[str]:
    return results.get("method_summary", {}).get("fedlag_personal", [])


def _seeds(point: Path) -> dict[str, float]:
    """Seen accuracy (%) of each finished seed of a grid point, by seed folder."""
    return {d.name: 100 * r["summary"]["seen/accuracy"] for d in seed_dirs(point) if (r := _finished(d)) is not None}


def _fmt(vals: list[float]) -> str:
    if not vals:
        return "-"
    return f"{np.mean(vals):.2f} +- {np.std(vals, ddof=1):.2f}" if len(vals) > 1 else f"{vals[0]:.2f}"


def _personal(point: Path) -> str:
    """The personal layers each finished seed chose, distinct sets with how many seeds chose each."""
    sets: dict[str, int] = {}
    for d in seed_dirs(point):
        if (r := _finished(d)) is not None:
            key = ", ".join(_personal_layers(r))
            sets[key] = sets.get(key, 0) + 1
    return "; ".join(f"{k} ({n})" for k, n in sets.items()) or "-"


def sections(folder: Path) -> list[tuple[str, Path, Path]]:
    """(title, main folder, fixed folder) of each section in ``folder``: a sweep pair or the reproduce blocks."""
    if (folder / "main").is_dir():
        return [(folder.name, folder / "main", folder / "fixed")]
    found = [
        (f"{folder.name} {m.name[len('main-') :]}", m, folder / f"fixed-{m.name[len('main-') :]}")
        for m in sorted(folder.glob("main-*"))
        if m.is_dir()
    ]
    if not found:
        raise SystemExit(
            f"fedlag_report: {folder} has neither main/ nor main-<tag>/ folders; pass a sweep folder "
            "of docs/fedlag.md or an experiment folder of `fedtailor reproduce fedlag-...`"
        )
    return found


def table(main: Path, fixed: Path) -> list[str]:
    lines = [
        "| base | without FedLAG | with FedLAG (top_k = 2) | paired difference | seeds | personal layers (seed 41) |",
        "|---|---|---|---|---|---|",
    ]
    for base in bases():
        if not (main / f"name={base}_top_k=0").exists() and not (main / f"name={base}_top_k=2").exists():
            continue
        off, on = _seeds(main / f"name={base}_top_k=0"), _seeds(main / f"name={base}_top_k=2")
        both = sorted(set(off) & set(on))
        diff = [on[s] - off[s] for s in both]
        chosen = "-"
        r41 = main / f"name={base}_top_k=2" / "seed41"
        if (r41 / RESULTS).exists():
            chosen = ", ".join(_personal_layers(read_results(r41, require=())))
        lines.append(
            f"| {base} | {_fmt(list(off.values()))} | {_fmt(list(on.values()))} | {_fmt(diff)} | "
            f"{len(both)} | {chosen} |"
        )
    if fixed.exists():
        lines += [
            "",
            "| FedAvg + personal layers chosen by | accuracy | seeds | personal layers (seeds) |",
            "|---|---|---|---|",
        ]
        rows = [("conflict score (FedLAG)", main / "name=fedavg_top_k=2")]
        rows += [(f"fixed {c.capitalize()}-K", fixed / f"choice={c}") for c in ("first", "middle", "last")]
        module = fixed.parent / fixed.name.replace("fixed", "unit", 1) / "unit=module"
        rows.append(("conflict score over modules (weight + bias), top_k = 1", module))
        for label, point in rows:
            if point.exists():
                got = _seeds(point)
                lines.append(f"| {label} | {_fmt(list(got.values()))} | {len(got)} | {_personal(point)} |")
    return lines


def heatmap(folders: list[Path], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [
        (title, main, b)
        for f in folders
        for title, main, _ in sections(f)
        for b in ("fedavg", "fedper")
        if (main / f"name={b}_top_k=2" / "seed41" / RESULTS).exists()
    ]
    if not runs:
        return
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.6), squeeze=False)
    for ax, (title, main, base) in zip(axes[0], runs):
        s = read_results(main / f"name={base}_top_k=2" / "seed41", require=("method_summary",))["method_summary"]
        grid = np.asarray(s["fedlag_conflicts_per_round"], dtype=float).T  # layers x rounds
        im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_yticks(range(len(s["fedlag_candidates"])), s["fedlag_candidates"], fontsize=7)
        ax.set_xlabel("warm-up round")
        ax.set_title(f"{title}: {base}\npersonal: {', '.join(s['fedlag_personal'])}", fontsize=8)
        fig.colorbar(im, ax=ax, label="conflicting pairs (cos < 0)")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--table", type=Path)
    ap.add_argument("--png", type=Path)
    args = ap.parse_args()
    text = []
    for folder in args.folders:
        for title, main, fixed in sections(folder):
            text += [f"### {title}", "", *table(main, fixed), ""]
    out = "\n".join(text)
    print(out)
    if args.table:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text(out + "\n")
    if args.png:
        heatmap(args.folders, args.png)


if __name__ == "__main__":
    main()
