"""Tables and plots of a run directory (``fedtailor report RUN_DIR``) and of several seeds; the run directory is
read through :mod:`fedtailor.rundir`."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from fedtailor.rundir import Results, read_metrics, read_results


def load_run(run_dir: str | Path) -> tuple[Results, list[dict[str, Any]]]:
    """A run's results (every key a run writes, checked) and its per-round records (:mod:`fedtailor.rundir`)."""
    results = read_results(run_dir)
    try:
        history = read_metrics(run_dir)
    except ValueError as err:
        raise ValueError(f"{err}; delete the file to report without learning curves.") from None
    return results, history


def format_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """A plain-text table with right-aligned numbers."""
    if not rows:
        return "(empty)"
    columns = columns or list(rows[0])

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4f}"
        return str(v)

    body = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(columns)]
    line = "  ".join(c.rjust(w) for c, w in zip(columns, widths))
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line, sep] + ["  ".join(v.rjust(w) for v, w in zip(b, widths)) for b in body])


#: The suffixes of a summary metric's spread over clients (:func:`fedtailor.fl.loop.client_statistics`).
STATISTICS = ("std", "p10", "ci95_lo", "ci95_hi")


def is_accuracy(key: str) -> bool:
    """Whether a summary key is an accuracy (or its spread over clients), shown in percent."""
    parts = key.split("/")
    return (parts[-2] if parts[-1] in STATISTICS and len(parts) > 1 else parts[-1]).endswith("accuracy")


def summary_groups(summary: dict[str, Any]) -> dict[str, list[str]]:
    """The client groups of a run's final summary, each with its metrics (``G/M`` keys, in order)."""
    groups: dict[str, list[str]] = {}
    for key in summary:
        group, _, metric = key.partition("/")
        if metric and "/" not in metric and group not in ("best", "chosen"):
            groups.setdefault(group, []).append(metric)
    return groups


def _pct(value: float, key: str) -> str:
    return f"{100 * value:.2f}%" if is_accuracy(key) else f"{value:.4g}"


def distribution_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per group and metric: clients, mean, std, 10th percentile and the 95% interval of the mean."""
    rows = []
    for group, metrics in summary_groups(summary).items():
        for metric in metrics:
            key = f"{group}/{metric}"
            row = {"group": group, "metric": metric, "clients": int(summary.get(f"{key}/n", 0)) or "?"}
            row["mean"] = _pct(summary[key], key)
            for stat in STATISTICS:
                row[stat] = _pct(summary[f"{key}/{stat}"], key) if f"{key}/{stat}" in summary else "-"
            rows.append(row)
    return rows


def round_rows(results: Results, *, metric: str = "accuracy") -> list[dict[str, Any]]:
    """The final, best (optimistic) and validation-chosen round with each group's mean ``metric``."""
    s = results["summary"]
    groups = [g for g, metrics in summary_groups(s).items() if metric in metrics]
    rows = []
    for label, prefix, what in (
        ("final", "", "the last round (the summary above)"),
        ("best", "best/", "highest seen mean on these numbers: optimistic"),
        ("chosen", "chosen/", "highest seen mean on the validation split"),
    ):
        rnd = results["rounds_completed"] if label == "final" else s.get(f"{label}_round")
        if rnd is None:
            continue
        row = {"round choice": label, "round": int(rnd)}
        for g in groups:
            key = f"{prefix}{g}/{metric}"
            row[f"{g}/{metric}"] = _pct(s[key], key) if key in s else "-"
        row["picked by"] = what
        rows.append(row)
    return rows


def summary_lines(results: Results) -> list[str]:
    s = results["summary"]
    lines = [
        f"run {results['name']}: method {results['method']} on {results['dataset']}, seed {results['seed']}, "
        f"{results['rounds_completed']}/{results['rounds']} rounds, {results.get('wall_seconds', 0.0):.1f} s"
    ]
    for group in summary_groups(s):
        key = f"{group}/accuracy"
        if key not in s:
            continue
        n = s.get(f"{key}/n") or sum(1 for r in results["per_client"] if r["seen"] == (group == "seen"))
        line = f"  {group.capitalize():6s} accuracy {100 * s[key]:.2f}% (mean over {int(n)} clients)"
        if f"{key}/std" in s:
            line += (
                f" +- {100 * s[f'{key}/std']:.2f} std, p10 {100 * s[f'{key}/p10']:.2f}%, 95% interval of the mean "
                f"[{100 * s[f'{key}/ci95_lo']:.2f}, {100 * s[f'{key}/ci95_hi']:.2f}]%"
            )
        lines.append(line)
    facts = results.get("method_summary", {})
    for k, v in facts.items():
        if isinstance(v, (int, float, str)) and not k.startswith("epsilon_void"):
            lines.append(f"  {k}: {v:.6g}" if isinstance(v, float) else f"  {k}: {v}")
    if facts.get("epsilon_void"):
        lines.append("  EPSILON VOID for this run: " + "; ".join(facts.get("epsilon_void_reasons", [])))
    totals = results.get("round_totals", {})
    for key, label in (
        ("uplink_payload_MB", "protected uplink (MB, all releases)"),
        ("bits_per_coefficient_mean", "bits per coefficient (mean)"),
        ("perturbation_norm_mean", "measured perturbation norm (mean; diagnostic, outside DP)"),
        ("encode_ms_mean", "encode ms per release (mean; diagnostic)"),
        ("decode_ms_mean", "decode ms per release (mean; diagnostic)"),
        ("h_norm2_mean", "||h||^2 (mean over rounds)"),
        ("uplink_MB", "uplink (MB)"),
    ):
        if key in totals:
            lines.append(f"  {label}: {totals[key]:.4g}")
    return lines


def plot_run(results: Results, history: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """learning_curves.png (loss and accuracies over rounds) and per_client_accuracy.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    paths = []
    series = sorted(
        {
            k
            for r in history
            for k, v in r.items()
            if isinstance(v, (int, float)) and (k == "loss" or k.endswith(("accuracy", "/loss")))
        }
    )
    if history and series:
        fig, axes = plt.subplots(1, len(series), figsize=(4.2 * len(series), 3.4), squeeze=False)
        for ax, key in zip(axes[0], series):
            pts = [(r["round"], r[key]) for r in history if key in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 60 else None)
            ax.set_xlabel("round")
            ax.set_title(key)
            ax.grid(alpha=0.3)
        variant = results.get("method_summary", {}).get("variant")
        label = f"{results['method']} ({variant})" if variant else results["method"]
        fig.suptitle(f"{label} on {results['dataset']} (seed {results['seed']})")
        fig.tight_layout()
        paths.append(out_dir / "learning_curves.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    clients = results["per_client"]
    if clients and "accuracy" in clients[0]:
        fig, ax = plt.subplots(figsize=(max(6, 0.18 * len(clients)), 3.4))
        colors = ["tab:blue" if c["seen"] else "tab:orange" for c in clients]
        ax.bar(range(len(clients)), [100 * c["accuracy"] for c in clients], color=colors)
        ax.set_xticks(range(len(clients)), [str(c["client"]) for c in clients], fontsize=6, rotation=90)
        ax.set_xlabel("client (blue: seen, orange: future)")
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(0, 100)
        ax.set_title("per-client accuracy")
        fig.tight_layout()
        paths.append(out_dir / "per_client_accuracy.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def report(run_dir: str | Path, *, plots: bool = True) -> str:
    """The text report of a run (summary and per-client table); writes the PNG plots into the run directory."""
    results, history = load_run(run_dir)
    clients = results["per_client"]
    if clients:
        cols = ["client", "seen"] + [k for k in clients[0] if k not in ("client", "seen")]
        table = format_table(clients, cols)
    else:
        table = "(no client was evaluated: no client has evaluation records in this run)"
    text = "\n".join(summary_lines(results))
    distribution = distribution_rows(results["summary"])
    if distribution:
        text += (
            "\n\nover clients, final round (mean, sample std, 10th percentile, 95% Student-t interval of the mean; "
            "docs/evaluation.md):\n" + format_table(distribution)
        )
    rounds = round_rows(results)
    if len(rounds) > 1:
        text += "\n\nround choice (mean accuracy over clients):\n" + format_table(rounds)
    text += "\n\nper-client results:\n" + table
    if plots:
        written = plot_run(results, history, run_dir)
        text += "\n\nplots: " + ", ".join(str(p) for p in written)
    return text


def metric_variants(metric: str) -> list[str]:
    """The summary keys the seed tables show for ``metric``: the final round's mean over clients, the 10th
    percentile over clients, and the best (optimistic) and the validation-chosen round's mean."""
    return [metric, f"{metric}/p10", f"best/{metric}", f"chosen/{metric}"]


def seed_cell(key: str, mean: float, std: float) -> str:
    """``mean +- std`` over seeds; accuracies in percent."""
    if is_accuracy(key):
        return f"{100 * mean:.2f} +- {100 * std:.2f}"
    return f"{mean:.4g} +- {std:.2g}"


def seed_cells(stats: dict[str, tuple[float, float]], metrics: Iterable[str]) -> dict[str, str]:
    """The cells of ``metrics`` and their variants (:func:`metric_variants`) present in ``stats``
    (:func:`aggregate_seeds`), by summary key."""
    return {k: seed_cell(k, *stats[k]) for m in metrics for k in metric_variants(m) if k in stats}


def aggregate_seeds(run_dirs: list[str | Path]) -> dict[str, tuple[float, float]]:
    """Mean and standard deviation over runs (seeds) of each numeric summary figure; accuracies in a run's
    summary are already per-client means, so this is the papers' "within client, over clients, over seeds"."""
    values: dict[str, list[float]] = {}
    for d in run_dirs:
        results, _ = load_run(d)
        scalars = {**results.get("round_totals", {}), **results.get("method_summary", {}), **results["summary"]}
        for k, v in scalars.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                values.setdefault(k, []).append(float(v))
    return {k: (float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0) for k, v in values.items()}
