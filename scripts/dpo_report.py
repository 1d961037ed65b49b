"""Figures of pFedDPO runs in the style of the paper's: the methods' DPO loss, base-gradient norm and training
reward accuracy over rounds, per-client reward accuracy at the end, and kappa^2 over rounds (when the runs
logged diagnostics).

    python scripts/dpo_report.py RUN_DIR [RUN_DIR ...] --png docs/figures/pfeddpo_hh.png [--table T.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(run: Path) -> tuple[dict, list[dict]]:
    results = json.loads((run / "results.json").read_text())
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return results, history


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--png", type=Path, required=True)
    ap.add_argument("--table", type=Path)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(r, *load(r)) for r in args.runs]
    has_kappa = any("kappa2" in h for _, _, hist in runs for h in hist)
    panels = ["loss", "base_grad_norm", "seen/train_accuracy", "per-client"] + (["kappa2"] if has_kappa else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.3))
    rows = []
    for run, results, hist in runs:
        label = results["method"]
        for ax, key in zip(axes, panels):
            if key == "per-client":
                continue
            pts = [(h["round"], h[key]) for h in hist if h.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), label=label, marker="o" if key.startswith("seen") or key == "kappa2" else None,
                        ms=3)
        clients = results["per_client"]
        axes[panels.index("per-client")].bar([f"{label}\n{c['client']}" for c in clients],
                                             [c.get("train_accuracy", 0) for c in clients])
        s = results["summary"]
        rows.append(f"| {label} | {s.get('seen/train_accuracy', float('nan')):.3f} | {s.get('seen/accuracy', float('nan')):.3f} | "
                    f"{hist[-1].get('base_grad_norm', float('nan')):.3f} | {results['rounds_completed']} |")
    titles = {"loss": "DPO loss", "base_grad_norm": "base-gradient norm", "seen/train_accuracy":
              "training reward accuracy", "per-client": "per-client training reward accuracy", "kappa2": "kappa^2"}
    for ax, key in zip(axes, panels):
        ax.set_title(titles[key], fontsize=9)
        ax.set_xlabel("round" if key != "per-client" else "")
        if key != "per-client":
            ax.legend(fontsize=7)
        else:
            ax.tick_params(axis="x", labelsize=5)
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=120)
    table = "\n".join(["| method | training reward acc. | held-out reward acc. | last base-grad norm | rounds |",
                       "|---|---|---|---|---|", *rows])
    print(table)
    if args.table:
        args.table.write_text(table + "\n")


if __name__ == "__main__":
    main()
