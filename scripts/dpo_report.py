"""Figures and tables of pFedDPO runs in the style of the paper's (*pFedDPO*, Figures 7-8 on hh-rlhf): the
methods' DPO loss, base-gradient norm and training reward accuracy over rounds, each client's training reward
accuracy at the end, and kappa^2 (adapters off, solid) with the kappa_eff^2 estimate (adapters on, dashed) over
the rounds that logged diagnostics.

    python scripts/dpo_report.py RUN_DIR [RUN_DIR ...] --png docs/figures/pfeddpo_hh.png [--table T.md]

Runs of one method are told apart by the config values in which they differ (``pfeddpo lora_rank=4``), so the
rank and participation ablations draw with the same command.

The Markdown printed (and written to ``--table``) has one row per run: final training and held-out reward
accuracy and held-out DPO loss (means over clients), the DPO loss and base-gradient norm averaged over the second
half of the rounds and the norm's median over the last ten (single rounds are noisy: 5 clients x 3 steps of 4
pairs, and a saturated loss leaves rare spikes), then one row per diagnosed round with
kappa^2, kappa_eff^2, the adapted / other split of kappa^2 and the mean adapter-gradient square.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedtailor.rundir import CONFIG, RESULTS, Results, read_config, read_metrics, read_results

# what this report reads of a run's results.json
NEEDS = ("method", "rounds_completed", "summary", "per_client")
KAPPA = ("kappa2", "kappa2_eff", "kappa2_adapted", "kappa2_other", "adapter_grad_sq_mean", "kappa2_rel")


def load(run: Path) -> tuple[Results, list[dict]]:
    """A run's results and its per-round records."""
    return read_results(run, require=NEEDS), read_metrics(run)


def labels(runs: list[Path], methods: list[str]) -> list[str]:
    """Each run's method, plus the config values that tell apart runs of the same method (``lora_rank=4``)."""
    flat = []
    for run in runs:
        cfg = read_config(run) if (run / CONFIG).exists() else {}
        flat.append({f"{k}.{kk}": vv for k, v in cfg.items() if isinstance(v, dict) for kk, vv in v.items()})
    out = []
    for i, method in enumerate(methods):
        same = [flat[j] for j, m in enumerate(methods) if m == method]
        keys = sorted(k for k in flat[i] if len({repr(f.get(k)) for f in same}) > 1)
        out.append(" ".join([method, *(f"{k.split('.')[-1]}={flat[i][k]}" for k in keys)]))
    return out


def second_half_mean(history: list[dict], key: str) -> float:
    vals = [h[key] for h in history if h.get(key) is not None]
    vals = vals[len(vals) // 2 :]
    return sum(vals) / len(vals) if vals else float("nan")


def last_median(history: list[dict], key: str, last: int = 10) -> float:
    vals = sorted(h[key] for h in history[-last:] if h.get(key) is not None)
    return (vals[(len(vals) - 1) // 2] + vals[len(vals) // 2]) / 2 if vals else float("nan")


def tables(runs: list[tuple[Path, Results, list[dict]]]) -> str:
    out = [
        "| method | rounds | training reward acc. | held-out reward acc. | held-out DPO loss | DPO loss, second half "
        "| base-grad norm, second half | base-grad norm, median of last 10 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (_, results, hist), name in zip(runs, labels([r for r, _, _ in runs], [r["method"] for _, r, _ in runs])):
        s = results["summary"]
        out.append(
            f"| {name} | {results['rounds_completed']} | {s.get('seen/train_accuracy', float('nan')):.3f} "
            f"| {s.get('seen/accuracy', float('nan')):.3f} | {s.get('seen/loss', float('nan')):.3f} "
            f"| {second_half_mean(hist, 'loss'):.3f} | {second_half_mean(hist, 'base_grad_norm'):.3g} "
            f"| {last_median(hist, 'base_grad_norm'):.3g} |"
        )
    names = labels([r for r, _, _ in runs], [r["method"] for _, r, _ in runs])
    diag = [(name, h) for (_, _, hist), name in zip(runs, names) for h in hist if h.get("kappa2") is not None]
    if diag:
        out += [
            "",
            "| method | round | kappa^2 (adapters off) | kappa_eff^2 (on) | adapted part | other part "
            "| mean adapter-grad sq. | kappa^2 / ||g_bar||^2 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for method, h in diag:
            out.append(
                f"| {method} | {h['round']} | "
                + " | ".join(f"{h[k]:.3g}" if h.get(k) is not None else "-" for k in KAPPA)
                + " |"
            )
        for (_, _, hist), name in zip(runs, names):
            ks = [h["kappa2"] for h in hist if h.get("kappa2") is not None]
            if len(ks) > 1:
                out.append(
                    f"\n{name}: kappa^2 {ks[0]:.3g} -> {ks[-1]:.3g} "
                    f"({100 * (ks[-1] - ks[0]) / ks[0]:+.0f}%), minimum {min(ks):.3g}"
                )
    return "\n".join(out)


def figure(runs: list[tuple[Path, Results, list[dict]]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_kappa = any("kappa2" in h for _, _, hist in runs for h in hist)
    panels = ["loss", "base_grad_norm", "seen/train_accuracy", "seen/accuracy", "per-client"] + (
        ["kappa2"] if has_kappa else []
    )
    titles = {
        "loss": "(a) DPO loss",
        "base_grad_norm": "(b) base-gradient norm (before clipping)",
        "seen/train_accuracy": "(c) training reward accuracy",
        "seen/accuracy": "(d) held-out reward accuracy",
        "per-client": "(e) per client, final: held-out (bars), training (-)",
        "kappa2": "(f) kappa^2: adapters off (solid), on (dashed)",
    }
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4))
    width = 0.8 / len(runs)
    names = labels([r for r, _, _ in runs], [r["method"] for _, r, _ in runs])
    for j, ((_, results, hist), label) in enumerate(zip(runs, names)):
        for ax, key in zip(axes, panels):
            if key == "per-client":
                clients = results["per_client"]
                xs = [c["client"] + j * width for c in clients]
                bars = ax.bar(xs, [c.get("accuracy", 0) for c in clients], width, label=label)
                ax.plot(xs, [c.get("train_accuracy", 0) for c in clients], "_", ms=8, color=bars[0].get_facecolor())
                continue
            pts = [(h["round"], h[key]) for h in hist if h.get(key) is not None]
            if not pts:
                continue
            (line,) = ax.plot(
                *zip(*pts), label=label, marker=None if key in ("loss", "base_grad_norm") else "o", ms=3, lw=1
            )
            eff = [(h["round"], h["kappa2_eff"]) for h in hist if h.get("kappa2_eff") is not None]
            if key == "kappa2" and eff and results["method"] == "pfeddpo":  # FedDPO has no adapters: eff = off
                ax.plot(*zip(*eff), ls="--", marker="x", ms=3, lw=1, color=line.get_color())
    for ax, key in zip(axes, panels):
        ax.set_title(titles[key], fontsize=9)
        ax.set_xlabel("client" if key == "per-client" else "round")
        if key == "kappa2":
            ax.set_yscale("log")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (results.json and metrics.jsonl)")
    ap.add_argument("--png", type=Path, required=True)
    ap.add_argument("--table", type=Path)
    args = ap.parse_args()
    missing = [str(r) for r in args.runs if not (r / RESULTS).exists()]
    if missing:
        ap.error(
            f"not finished runs (no results.json): {', '.join(missing)}; finish them with fedtailor reproduce "
            "or fedtailor run --resume."
        )
    runs = [(r, *load(r)) for r in args.runs]
    figure(runs, args.png)
    text = tables(runs)
    print(text)
    if args.table:
        args.table.write_text(text + "\n")


if __name__ == "__main__":
    main()
