"""The tables and quoted numbers of the docs, regenerated from the committed result files.

    python scripts/docs_tables.py            # rewrite every generated region in place
    python scripts/docs_tables.py --check    # exit 1, naming file and region, where a doc differs from its sources

A generated region of a Markdown file is

    <!-- generated: KEY -->
    ...
    <!-- end generated -->

and everything between the two marker lines is what the renderer ``KEY`` of :data:`RENDERERS` gives. Each renderer
reads its sources under ``docs/results/`` (``table.csv`` and ``summary.md`` as ``fedtailor reproduce`` and the
report scripts wrote them, per-seed ``*.csv``) or ``benchmarks/RESULTS.md``, and checks them against each other
where two hold the same number (per-seed values against the mean +- std of ``table.csv``); a disagreement is an
error naming both files. Text outside the regions is never touched.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = (
    "README.md",
    "docs/RESULTS.md",
    "docs/compact.md",
    "docs/pfeddpo.md",
    "docs/fedlag.md",
    "docs/codecs.md",
    "docs/privacy.md",
)
START = re.compile(r"^<!-- generated: (?P<key>[\w./=-]+) -->$")
END = "<!-- end generated -->"
RESULTS_DIR = "docs/results"
# a per-seed value is rounded to 0.01, so its mean and std may differ from table.csv's by about that much
SEED_TOLERANCE = 0.01


class SourceError(ValueError):
    """The sources of a region are missing or disagree with each other."""


class RegionError(ValueError):
    """A doc's markers are malformed or name no renderer."""


# ---------------------------------------------------------------------------------------------------- sources


def read_csv(root: Path, rel: str) -> list[dict[str, str]]:
    path = root / rel
    if not path.is_file():
        raise SourceError(f"{rel}: missing")
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def points(root: Path, experiment: str) -> dict[str, dict[str, str]]:
    """The rows of ``docs/results/EXPERIMENT/table.csv`` by ``block/point``."""
    rows = read_csv(root, f"{RESULTS_DIR}/{experiment}/table.csv")
    return {f"{r['block']}/{r['point']}": r for r in rows}


def read_choices(root: Path, folder: str) -> dict:
    """The tuning record ``docs/results/FOLDER/choices.json`` (grid, scores and each point's choice)."""
    rel = f"{RESULTS_DIR}/{folder}/choices.json"
    if not (root / rel).is_file():
        raise SourceError(f"{rel}: missing")
    return json.loads((root / rel).read_text())


def mean_std(row: dict[str, str], metric: str) -> tuple[float, float]:
    return float(row[f"{metric} (mean)"]), float(row[f"{metric} (std)"])


def md_tables(root: Path, rel: str) -> list[list[list[str]]]:
    """Every Markdown table of a file as rows of cells (the header row first, the separator row dropped)."""
    path = root / rel
    if not path.is_file():
        raise SourceError(f"{rel}: missing")
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*path.read_text().splitlines(), ""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-: ") for c in cells):
                current.append(cells)
        elif current:
            tables.append(current)
            current = []
    return tables


def md_section(root: Path, rel: str, heading: str) -> str:
    """The text under ``heading`` of a Markdown file, up to the next heading, without surrounding blank lines."""
    path = root / rel
    if not path.is_file():
        raise SourceError(f"{rel}: missing")
    lines = path.read_text().splitlines()
    if heading not in lines:
        raise SourceError(f"{rel}: no heading {heading!r}")
    body: list[str] = []
    for line in lines[lines.index(heading) + 1 :]:
        if line.startswith("#"):
            break
        body.append(line)
    return "\n".join(body).strip()


# ---------------------------------------------------------------------------------------------------- format


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def pm(mean: float, std: float) -> str:
    return f"{mean:.2f} +- {std:.2f}"


def signed(value: float) -> str:
    """``+0.79``, ``-1.03``, and ``0.00`` for what rounds to zero."""
    return "0.00" if abs(value) < 0.005 else f"{value:+.2f}"


def paired_differences(diffs: list[float]) -> str:
    return ", ".join(signed(d) for d in diffs) + f" (mean {signed(statistics.mean(diffs))})"


def bold(text: str, on: bool) -> str:
    return f"**{text}**" if on else text


# ---------------------------------------------------------------------------------------------------- compact

COMPACT_VARIANTS = {
    "global": "Global (one model, no personalization)",
    "full-dg": "Full-DG (generator in the full parameter space)",
    "deeplin-dg": "DeepLin-DG (`a = W V c~`)",
    "ours-dg": "Ours-DG",
    "ours-lrsuq": "Ours-LRSUQ",
    "dg-q12": "DG+Q12",
}
SHORT_NAMES = {**COMPACT_VARIANTS, "global": "Global", "full-dg": "Full-DG", "deeplin-dg": "DeepLin-DG"}
CONTROLS = {
    "eps16/variant=direct": "Direct (the coefficient vector itself is trained)",
    "eps16/variant=deeplin": "DeepLin (`a = W V u0`)",
    "eps16/variant=factorized": "Factorized (`a = W h_psi(u0)`)",
    "eps16/variant=radial": "Radial (only the gain of the initial hidden direction trains)",
    "eps16-replay/variant=replay": "Replay (Direct with Factorized's per-round gain)",
    "eps16/variant=factorized-ctx": "Factorized+ctx (the private context restored; = Ours-DG)",
}
SEEN, FUTURE = "seen/accuracy", "future/accuracy"


TUNED_TABLE1 = {f"eps16/variant={v}": name for v, name in COMPACT_VARIANTS.items()}
TUNED_CONTROLS = {
    **{k: v for k, v in CONTROLS.items() if k.startswith("eps16/") and k != "eps16/variant=factorized-ctx"},
    "eps16/variant=factorized-ctx": "Factorized+ctx (the private context; = Ours-DG)",
    "eps16/variant=factorized-clean": "Factorized+clean (the exact context mean, no noise; eps void)",
    "eps16-replay/variant=replay": "Replay (Direct with Factorized's per-round gain; not tuned)",
}
TUNED_NOISELESS = {
    "noiseless/variant=direct": "Direct, without noise",
    "noiseless/variant=deeplin": "DeepLin, without noise",
    "noiseless/variant=factorized": "Factorized, without noise",
    "noiseless/variant=radial": "Radial, without noise",
    "noiseless/variant=factorized-ctx": "Factorized+ctx (the exact context), without noise",
    "noiseless-replay/variant=replay": "Replay, without noise (not tuned)",
}


def seed_values(root: Path, experiment: str) -> dict[str, dict[int, dict[str, str]]]:
    """``docs/results/EXPERIMENT/seeds.csv`` by variant and seed, each variant's values checked against the
    mean +- std of the experiment's ``table.csv``."""
    rel = f"{RESULTS_DIR}/{experiment}/seeds.csv"
    table_rows = points(root, experiment)
    out: dict[str, dict[int, dict[str, str]]] = {}
    for r in read_csv(root, rel):
        out.setdefault(r["variant"], {})[int(r["seed"])] = r
    for variant, by_seed in out.items():
        row = next((v for k, v in table_rows.items() if k.endswith(f"/variant={variant}")), None)
        if row is None:
            raise SourceError(f"{rel}: variant {variant} is not in table.csv")
        for metric, column in ((SEEN, "seen_accuracy"), (FUTURE, "future_accuracy")):
            values = [float(s[column]) for s in by_seed.values() if s[column]]
            if not values:
                continue
            mean, std = mean_std(row, metric)
            got = (statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0)
            if len(values) != int(row["seeds"]) or max(abs(got[0] - mean), abs(got[1] - std)) > SEED_TOLERANCE:
                raise SourceError(
                    f"{rel}: {variant} {column} gives {pm(*got)} over {len(values)} seeds, "
                    f"table.csv {pm(mean, std)} over {row['seeds']}"
                )
    return out


def uplink(root: Path) -> dict[str, dict[str, str]]:
    """Bits per coefficient and protected uplink of each Table 1 variant (``uplink.csv``), the rows that the
    communication table of the same era (seed 41, LRSUQ frame version 1: ``compact-comm-mnist-v1``) also measured
    checked against it."""
    rel = f"{RESULTS_DIR}/compact-table1-mnist/uplink.csv"
    rows = {r["variant"]: r for r in read_csv(root, rel)}
    comm = points(root, "compact-comm-mnist-v1")
    for key, r in comm.items():
        variant = key.split("variant=")[1]
        mine = rows.get(variant)
        bits = float(r["bits_per_coefficient_mean (mean)"])
        mb = float(r["uplink_payload_MB (mean)"])
        if mine is None or abs(float(mine["bits_per_coefficient"]) - bits) > 1e-3:
            raise SourceError(f"{rel}: {variant} bits differ from compact-comm-mnist-v1/table.csv ({bits:.4f})")
        if abs(float(mine["uplink_payload_MB"]) - mb) > 5e-3:
            raise SourceError(f"{rel}: {variant} MB differ from compact-comm-mnist-v1/table.csv ({mb:.3f})")
    return rows


def compact_table1(root: Path) -> str:
    rows = points(root, "compact-table1-mnist")
    comm = uplink(root)
    best = max(mean_std(r, FUTURE)[0] for r in rows.values())
    body = []
    for variant, name in COMPACT_VARIANTS.items():
        r = rows[f"eps16/variant={variant}"]
        future = mean_std(r, FUTURE)
        bits, mb = comm[variant]["bits_per_coefficient"], float(comm[variant]["uplink_payload_MB"])
        # a plain "32" is the nominal FP32 rate; a measured one is shown to 0.01 (0.001 below one bit)
        shown_bits = bits if "." not in bits else f"{float(bits):.3f}" if float(bits) < 1 else f"{float(bits):.2f}"
        body.append([name, pm(*mean_std(r, SEEN)), bold(pm(*future), future[0] == best), shown_bits, f"{mb:.2f}"])
    return table(["variant", "Seen", "Future", "bits per coef.", "protected uplink (MB)"], body)


def compact_table1_seeds(root: Path) -> str:
    seeds = seed_values(root, "compact-table1-mnist")
    parts = []
    for variant in ("ours-dg", "full-dg", "deeplin-dg", "ours-lrsuq"):
        by_seed = seeds[variant]
        values = ", ".join(f"{by_seed[s]['seen_accuracy']} / {by_seed[s]['future_accuracy']}" for s in sorted(by_seed))
        parts.append(f"{SHORT_NAMES[variant]} {values}")
    first, last = min(seeds["ours-dg"]), max(seeds["ours-dg"])
    return f"Per seed ({first}-{last}, Seen / Future; `seeds.csv`): " + "; ".join(parts) + "."


def compact_table1_summary(root: Path) -> str:
    rows = points(root, "compact-table1-mnist")
    parts = []
    for variant in COMPACT_VARIANTS:
        r = rows[f"eps16/variant={variant}"]
        parts.append(f"{SHORT_NAMES[variant]} {mean_std(r, SEEN)[0]:.2f} / {mean_std(r, FUTURE)[0]:.2f}")
    return ", ".join(parts) + " (Seen / Future, mean over seeds 41-43)."


def compact_controls(root: Path) -> str:
    rows = points(root, "compact-controls-mnist")
    body = [[name, pm(*mean_std(rows[key], SEEN)), pm(*mean_std(rows[key], FUTURE))] for key, name in CONTROLS.items()]
    return table(["control", "Seen", "Future"], body)


def compact_tuned(experiment: str, names: dict[str, str]) -> Callable[[Path], str]:
    """The fair-tuning re-run of ``experiment`` (``docs/results/EXPERIMENT-tuned/``): each point's chosen step, its
    validation score (``choices.json``, seed 41) and the test accuracies over seeds (``table.csv``)."""

    def render(root: Path) -> str:
        folder = f"{experiment}-tuned"
        rows = points(root, folder)
        record = read_choices(root, folder)
        body = []
        most = max(int(rows[key]["seeds"]) for key in names if key in rows)
        for key, name in names.items():
            if key not in rows:
                raise SourceError(f"{RESULTS_DIR}/{folder}/table.csv: no row {key}")
            seeds = int(rows[key]["seeds"])
            name += f" ({seeds} of {most} seeds)" if seeds < most else ""
            unit = key if key in record["choices"] else None
            lr = record["choices"][unit]["method.lr"] if unit else "-"
            score = record["scores"][unit][f"lr={lr}"] if unit else float("nan")
            edge = " (edge)" if unit in record["at_edge"] else ""
            shown = f"{100 * score:.2f}" if score == score else "-"
            body.append([name, f"{lr}{edge}", shown, pm(*mean_std(rows[key], SEEN)), pm(*mean_std(rows[key], FUTURE))])
        grid = ", ".join(record["grid"]["method.lr"])
        header = ["point", f"chosen lr (of {grid})", "validation Seen (seed 41)", "test Seen", "test Future"]
        return table(header, body)

    return render


ALPHA_VARIANTS = ("global", "full-dg", "ours-dg", "ours-lrsuq")


def _alphas(rows: dict[str, dict[str, str]]) -> list[str]:
    return sorted({key.split("/")[0].removeprefix("alpha") for key in rows}, key=float)


def compact_alpha(root: Path) -> str:
    """Table 2 (``docs/results/compact-alpha-mnist-tuned/``): each variant's step at each alpha (``choices.json``;
    an alpha without its own choice runs with alpha 0.5's, the tuning stage's block) and its test Seen / Future
    accuracy over seeds at each alpha."""
    folder = "compact-alpha-mnist-tuned"
    rows = points(root, folder)
    choices = read_choices(root, folder)["choices"]
    alphas = _alphas(rows)
    body = []
    for variant in ALPHA_VARIANTS:
        lrs = []
        cells = []
        for a in alphas:
            key = f"alpha{a}/variant={variant}"
            row = rows.get(key)
            cells.append(f"{pm(*mean_std(row, SEEN))} / {pm(*mean_std(row, FUTURE))}" if row else "-")
            lrs.append(choices.get(key, choices.get(f"alpha0.5/variant={variant}", {})).get("method.lr", "-"))
        body.append([COMPACT_VARIANTS[variant], " / ".join(lrs), *cells])
    header = ["variant", f"lr at alpha {' / '.join(alphas)}", *[f"alpha {a}: Seen / Future" for a in alphas]]
    return table(header, body)


def compact_table1_by_eps(folder: str) -> Callable[[Path], str]:
    """Table 1 at every eps a results folder has (``docs/results/FOLDER/table.csv``): each variant's test Seen /
    Future accuracy over seeds, one column per eps."""

    def render(root: Path) -> str:
        rows = points(root, folder)
        blocks = sorted({key.split("/")[0] for key in rows}, key=lambda b: float(b.removeprefix("eps")))
        body = []
        for variant, name in COMPACT_VARIANTS.items():
            cells = []
            for block in blocks:
                row = rows.get(f"{block}/variant={variant}")
                cells.append(f"{pm(*mean_std(row, SEEN))} / {pm(*mean_std(row, FUTURE))}" if row else "-")
            body.append([name, *cells])
        return table(["variant", *[f"eps {b.removeprefix('eps')}: Seen / Future" for b in blocks]], body)

    return render


def compact_k(root: Path) -> str:
    """The k trade-off (``docs/results/compact-k-mnist/``): each k's chosen step (``choices.json``), test accuracy,
    protected uplink and realised perturbation norm over seeds (``table.csv``)."""
    folder = "compact-k-mnist"
    rows = points(root, folder)
    choices = read_choices(root, folder)["choices"]
    body = []
    for key in sorted(rows, key=lambda k: int(k.rsplit("=", 1)[1])):
        r = rows[key]
        lr = choices.get(key, {}).get("method.lr", "-")
        body.append(
            [
                f"{int(key.rsplit('=', 1)[1]):,}",
                lr,
                r["seeds"],
                pm(*mean_std(r, SEEN)),
                pm(*mean_std(r, FUTURE)),
                f"{float(r['uplink_payload_MB (mean)']):.2f}",
                "{:.3f} +- {:.3f}".format(*mean_std(r, "perturbation_norm_mean")),
            ]
        )
    header = ["k", "chosen lr", "seeds", "test Seen", "test Future", "protected uplink MB", "perturbation norm (mean)"]
    return table(header, body)


def compact_paired(experiment: str, names: dict[str, str]) -> Callable[[Path], str]:
    """The paired differences of the fair-tuning re-run (``paired.csv``): each point minus its reference, over
    seeds (t interval) and over (seed, client) pairs (bootstrap), with the paper's claim and the verdict."""

    def render(root: Path) -> str:
        rows = read_csv(root, f"{RESULTS_DIR}/{experiment}-tuned/paired.csv")
        body = []
        for r in rows:
            key = f"{r['block']}/{r['point']}"
            if key not in names:
                continue
            metric = {"seen/accuracy": "Seen", "future/accuracy": "Future"}.get(r["metric"], r["metric"])
            verdict = r.get("verdict") or "-"
            body.append([names[key], metric, r["mean"], r["seeds ci95"], r["per seed"], r["clients ci95"], verdict])
        header = ["point minus " + rows[0]["reference"].split("=")[-1], "metric", "mean", "95% CI (seeds)"]
        return table([*header, "per seed", "95% CI (seed, client)", "paper's claim: verdict"], body)

    return render


def compact_comm(root: Path) -> str:
    rows = points(root, "compact-comm-mnist")
    names = {"ours-dg": "DG FP32", "dg-q12": "DG+Q12", "ours-lrsuq": "LRSUQ", "ours-ppr": "PPR (b = 4)"}
    body = []
    for key, r in rows.items():
        variant = key.split("variant=")[1]
        body.append(
            [
                names[variant],
                f"{float(r['bits_per_coefficient_mean (mean)']):.3f}",
                f"{float(r['uplink_payload_MB (mean)']):.2f}",
                f"{float(r['encode_ms_mean (mean)']):.2f}",
                f"{pm(*mean_std(r, SEEN))} / {pm(*mean_std(r, FUTURE))}",
            ]
        )
    header = ["codec (variant)", "bits per coef. (padded)", "protected uplink (MB)", "encode ms per release (mean)"]
    return table([*header, "Seen / Future (seeds 41-43)"], body)


def layer_allocation_validation(root: Path) -> str:
    rel = f"{RESULTS_DIR}/compact-layer-allocation/validation.csv"
    groups: dict[tuple[str, str], dict[int, float]] = {}
    for r in read_csv(root, rel):
        groups.setdefault((r["P"], r["allocation"]), {})[int(r["seed"])] = float(r["validation_accuracy"])
    ref = groups[("blocked-dct", "")]
    seeds = sorted(ref)
    best = max(statistics.mean(v.values()) for v in groups.values())
    body = []
    for (p, allocation), by_seed in groups.items():
        if sorted(by_seed) != seeds:
            raise SourceError(f"{rel}: {p} {allocation} has seeds {sorted(by_seed)}, the reference {seeds}")
        values = [by_seed[s] for s in seeds]
        mean = statistics.mean(values)
        top = mean == best
        diffs = [by_seed[s] - ref[s] for s in seeds]
        paired = "" if by_seed is ref else paired_differences(diffs)
        body.append(
            [
                "blocked DCT" if p == "blocked-dct" else p,
                bold(allocation, top and bool(allocation)),
                *(f"{v:.2f}" for v in values),
                bold(pm(mean, statistics.stdev(values)), top),
                paired,
            ]
        )
    header = ["P", "allocation", *(f"seed {s}" for s in seeds), "mean +- std", "paired difference vs blocked DCT"]
    return table(header, body)


def layer_allocation_test(root: Path) -> str:
    rel = f"{RESULTS_DIR}/compact-layer-allocation/test.csv"
    groups: dict[str, dict[int, tuple[float, float]]] = {}
    for r in read_csv(root, rel):
        name = "blocked DCT" if r["P"] == "blocked-dct" else f"{r['P']}, {r['allocation']}"
        groups.setdefault(name, {})[int(r["seed"])] = (float(r["seen_accuracy"]), float(r["future_accuracy"]))
    ref = groups["blocked DCT"]
    body = []
    for name, by_seed in groups.items():
        seeds = sorted(by_seed)
        cols = [[by_seed[s][i] for s in seeds] for i in (0, 1)]
        per_seed = "; ".join(f"{s}: {by_seed[s][0]:.2f} / {by_seed[s][1]:.2f}" for s in seeds)
        paired = []
        if by_seed is not ref:
            for i in (0, 1):
                diffs = [by_seed[s][i] - ref[s][i] for s in seeds]
                paired.append(paired_differences(diffs))
        body.append(
            [
                name,
                *(pm(statistics.mean(c), statistics.stdev(c)) + "%" for c in cols),
                per_seed,
                "; ".join(paired),
            ]
        )
    header = ["P", "Seen acc.", "Future acc.", "per seed (Seen / Future)"]
    return table([*header, "paired difference vs blocked DCT (Seen; Future)"], body)


# ---------------------------------------------------------------------------------------------------- FedLAG


def fedlag_section(experiment: str, tag: str, folder: str) -> Callable[[Path], str]:
    """The tables ``scripts/fedlag_report.py`` wrote for one alpha of ``experiment``, their means checked against
    ``table.csv``, both in ``docs/results/<folder>`` (``<experiment>-v1``: the runs at the paper's lr, untuned)."""

    def render(root: Path) -> str:
        rel = f"{RESULTS_DIR}/{folder}/fedlag.md"
        text = md_section(root, rel, f"### {experiment} {tag}")
        rows = points(root, folder)
        for base, without, with_ in re.findall(r"^\| (\w+) \| ([\d.]+) \+- [\d.]+ \| ([\d.]+) \+-", text, re.M):
            for top_k, value in (("0", without), ("2", with_)):
                row = rows.get(f"main-{tag}/name={base}_top_k={top_k}")
                if row is None or f"{mean_std(row, SEEN)[0]:.2f}" != value:
                    raise SourceError(f"{rel}: {tag} {base} top_k={top_k} {value} is not in table.csv")
        return text

    return render


# the seeds the catalogue plans for an experiment whose tables show "N of M" while its runs land (3 where not named)
PLANNED_SEEDS = {"fedlag-mnist": 5, "pfeddpo-hh": 5, "pfeddpo-rank": 3, "pfeddpo-participation": 3}


def planned(experiment: str) -> int:
    """The seeds the catalogue plans for ``experiment`` (:data:`PLANNED_SEEDS`)."""
    return PLANNED_SEEDS.get(experiment, 3)


def _diverged(row: dict[str, str] | None) -> int:
    """How many of a point's runs diverged (``table.csv``'s ``diverged`` column; 0 where it has none)."""
    return int((row or {}).get("diverged") or 0)


def _seen(row: dict[str, str] | None, of: int) -> str:
    """A FedLAG point's Seen accuracy over seeds: mean +- std, the mean alone from one seed, "N of M" while its
    runs land or where some diverged (``of``: M, the seeds planned; "K diverged" said), "-" before any has."""
    if row is None:
        return f"- (0 of {of})"
    seeds, lost = int(row["seeds"]), _diverged(row)
    if not seeds:
        return f"- (0 of {of}; {lost} diverged)"
    mean, std = mean_std(row, SEEN)
    shown = pm(mean, std) if seeds > 1 else f"{mean:.2f}"
    return shown + (f" ({seeds} of {of}{f'; {lost} diverged' if lost else ''})" if seeds < of else "")


FEDLAG_VARIANTS = {
    "main-{a}/name=fedavg_top_k=0": "FedAvg alone",
    "main-{a}/name=fedavg_top_k=2": "FedLAG (tensors, round update scored; top_k 2)",
    "unit-{a}/unit=module": "FedLAG, modules as layers (top_k 1)",
    "score-{a}/update=gradient": "FedLAG, last-minibatch gradient scored (top_k 2)",
}
FEDLAG_FIXED = {  # the fixed choices; Last-K (the head) in every table, First-K and Middle-K where they ran
    "fixed-{a}/choice=first": "fixed First-K (top_k 2)",
    "fixed-{a}/choice=middle": "fixed Middle-K (top_k 2)",
    "fixed-{a}/choice=last": "fixed Last-K (the head; top_k 2)",
}


def fedlag_variants(folder: str, *, fixed: bool = False) -> Callable[[Path], str]:
    """FedLAG's scoring variants around FedAvg (``docs/results/<folder>/table.csv``): Seen accuracy over seeds at
    each alpha, and the layers each made personal (in how many seeds each), where the run directories were there to
    count them; ``fixed``: the fixed First-K and Middle-K too (an experiment that ran them)."""

    def render(root: Path) -> str:
        rows = points(root, folder)
        body = []
        fixed_rows = {k: v for k, v in FEDLAG_FIXED.items() if fixed or k.endswith("last")}
        for pattern, name in {**FEDLAG_VARIANTS, **fixed_rows}.items():
            cells = []
            for a in ("alpha01", "alpha10"):
                row = rows.get(pattern.format(a=a))
                personal = (row or {}).get("fedlag_personal") or ""
                shown = f" ({personal})" if personal not in ("", "-", "none") else ""
                cells.append(_seen(row, planned(folder)) + shown)
            body.append([name, *cells])
        return table(["around FedAvg", "alpha 0.1: Seen (personal layers)", "alpha 1.0: Seen (personal layers)"], body)

    return render


TUNED_EXTRA = {"method.mu": "mu", "method.lam": "lam"}


def _chosen(choice: dict[str, str], at_edge: bool) -> str:
    """A point's chosen step, with FedProx's mu or Ditto's lambda where it has them: ``0.05, mu 0.01``; "(grid
    edge)" where a chosen value is the smallest or largest of its grid."""
    shown = ", ".join([choice["method.lr"], *(f"{n} {choice[k]}" for k, n in TUNED_EXTRA.items() if k in choice)])
    return shown + (" (grid edge)" if at_edge else "")


def fedlag_tuned(experiment: str, tag: str) -> Callable[[Path], str]:
    """The tuned runs of ``experiment`` at one alpha (``docs/results/EXPERIMENT/``): each base without and with
    FedLAG at its own chosen step (``choices.json``), test Seen accuracy over seeds (``table.csv``; "N of M" while
    its runs land), with minus without (``paired.csv``: Student-t interval over seeds, with the verdict on the
    paper's claim, "so far" before every seed has landed) and the layers FedLAG made personal (in how many seeds
    each)."""

    def render(root: Path) -> str:
        folder = f"{RESULTS_DIR}/{experiment}"
        tuning = read_choices(root, experiment)
        choices, edge = tuning["choices"], set(tuning["at_edge"])
        block = f"main-{tag}"
        rows = points(root, experiment)
        paired = {
            r["point"]: r for r in read_csv(root, f"{folder}/paired.csv") if r["block"] == block and r["metric"] == SEEN
        }
        body = []
        for base in dict.fromkeys(u.split("/name=")[1].rsplit("_top_k=", 1)[0] for u in choices if u.startswith(block)):
            cells = [base]
            for top_k in ("0", "2"):
                unit = f"{block}/name={base}_top_k={top_k}"
                if unit not in choices:
                    raise SourceError(f"{folder}/choices.json: no choice for {unit}")
                cells += [_chosen(choices[unit], unit in edge), _seen(rows.get(unit), planned(experiment))]
            diff = paired.get(f"name={base}_top_k=2")
            personal = rows.get(f"{block}/name={base}_top_k=2", {}).get("fedlag_personal") or "-"
            interval = f"{diff['mean']} {diff['seeds ci95']}".strip() if diff else "-"
            verdict = f"{diff['paper']}: {diff['verdict']}" if diff and diff["paper"] else "-"
            if diff and int(diff["seeds"]) < planned(experiment):
                pair = [rows.get(f"{block}/name={base}_top_k={k}") for k in ("0", "2")]
                lost = sum(map(_diverged, pair))
                landed = sum(int((r or {}).get("seeds") or 0) for r in pair) + lost == 2 * planned(experiment)
                seeds = f"{diff['seeds']} of {planned(experiment)} seeds"
                verdict += f" over {seeds}, a run in the others diverged" if landed and lost else f" so far ({seeds})"
            body.append([*cells, interval, verdict, personal])
        header = ["base", "its step", "Seen alone", "its step with FedLAG", "Seen with FedLAG"]
        return table([*header, "with minus alone (95% CI)", "paper: verdict", "personal layers (seeds)"], body)

    return render


DP_BASES = {"fedavg": "FedAvg", "fedper": "FedPer", "ditto": "Ditto"}
DP_LEVELS = {"record": "record-level DP-SGD", "client": "client-level (each client's noise)"}


def _dp_points(root: Path) -> dict[str, dict[str, dict[str, str]]]:
    """``dp-utility-mnist/table.csv`` by block, then by point slug (``top_k=0_epsilon=1``)."""
    out: dict[str, dict[str, dict[str, str]]] = {}
    for r in read_csv(root, f"{RESULTS_DIR}/dp-utility-mnist/table.csv"):
        out.setdefault(r["block"], {})[r["point"]] = r
    return out


def dp_utility(root: Path) -> str:
    """Seen accuracy (mean +- std over seeds) of each base with and without FedLAG at each eps, per block of
    ``dp-utility-mnist`` that has finished."""
    blocks = _dp_points(root)
    epsilons = ("1", "4", "8", "inf")
    body = []
    for level, level_name in DP_LEVELS.items():
        for base, base_name in DP_BASES.items():
            rows = blocks.get(f"{level}-{base}")
            if rows is None:
                continue
            for lag in (False, True):  # FedLAG's top_k is 2 (FedPer: 1, docs/privacy.md)
                cells = []
                for eps in epsilons:
                    row = next(
                        (r for p, r in rows.items() if p.endswith(f"_epsilon={eps}") and (p[:7] != "top_k=0") == lag),
                        None,
                    )
                    cells.append(_dp_cell(row))
                body.append([level_name, base_name + (" + FedLAG" if lag else ""), *cells])
    if "client-lrsuq" in blocks:  # the same release as client-level FedAvg + FedLAG at eps 8, sent over LRSUQ
        row = blocks["client-lrsuq"]["codec=lrsuq"]
        bits = row.get("uplink_bits_per_coefficient (mean)")
        sent = f" ({float(bits):.3f} bits a value sent)" if bits else ""
        body.append([DP_LEVELS["client"], f"FedAvg + FedLAG, LRSUQ uplink{sent}", "-", "-", _dp_cell(row), "-"])
    return table(["DP", "method", "eps 1", "eps 4", "eps 8", "without DP"], body)


def _dp_cell(row: dict[str, str] | None) -> str:
    """Seen accuracy over seeds, with the number of seeds where a run failed (diverged)."""
    if row is None:
        return "-"
    seeds = int(row["seeds"])
    return pm(*mean_std(row, SEEN)) + (f" ({seeds} seed{'s' if seeds > 1 else ''})" if seeds < 3 else "")


def dp_utility_fedlag(root: Path) -> str:
    """FedLAG against its base at each eps (``paired.csv``: by seed, t interval) and the layers it made personal
    (``table.csv``: in how many seeds each)."""
    blocks = _dp_points(root)
    paired = read_csv(root, f"{RESULTS_DIR}/dp-utility-mnist/paired.csv")
    body = []
    for r in paired:
        if r["metric"] != SEEN or r["point"].startswith("top_k=0"):
            continue
        eps = r["point"].split("epsilon=")[1]
        row = blocks[r["block"]][r["point"]]
        level, base = r["block"].split("-", 1)
        body.append(
            [
                f"{DP_BASES[base]}, {level}",
                "without DP" if eps == "inf" else eps,
                r["mean"],
                r["seeds ci95"] or "-",
                r["per seed"],
                row.get("fedlag_personal", "-"),
            ]
        )
    header = ["base, DP", "eps", "FedLAG minus base (Seen, points)", "95% CI (seeds)", "per seed", "personal layers"]
    return table(header, body)


SENSITIVITY = {"xi": ("xi", "0.0", "the paper's"), "top_k": ("top_k", "0", "FedAvg alone")}


def fedlag_sensitivity(root: Path) -> str:
    """FedLAG's sensitivity (``fedlag-sensitivity-mnist``): Seen accuracy over seeds at each xi and top_k, both
    alphas, each point minus its reference (``paired.csv``: xi = 0, and top_k = 0, FedAvg alone) with the 95%
    interval over seeds, and the layers it made personal (in how many seeds each)."""
    folder = f"{RESULTS_DIR}/fedlag-sensitivity-mnist"
    rows = {(r["block"], r["point"]): r for r in read_csv(root, f"{folder}/table.csv")}
    paired = {(r["block"], r["point"]): r for r in read_csv(root, f"{folder}/paired.csv") if r["metric"] == SEEN}
    body = []
    for (block, point), row in rows.items():
        sweep, alpha = block.split("-alpha")
        key, ref, what = SENSITIVITY[sweep]
        value = point.removeprefix(f"{key}=")
        diff = paired.get((block, point))
        if diff is None and value != ref:
            raise SourceError(f"{folder}: {block}/{point} has no paired difference")
        body.append(
            [
                f"{int(alpha) / 10:.1f}",
                f"{key} = {value}" + (f" ({what})" if value == ref else ""),
                pm(*mean_std(row, SEEN)),
                "reference" if diff is None else f"{diff['mean']} {diff['seeds ci95']}",
                row.get("fedlag_personal", "-"),
            ]
        )
    header = ["alpha", "setting", "Seen accuracy (%)", "minus the reference (95% CI, seeds)", "personal layers"]
    return table(header, body)


def fedlag_adversary(root: Path) -> str:
    rows = read_csv(root, f"{RESULTS_DIR}/fedlag-adversary/adversary.csv")
    header = [h for h in rows[0] if h not in ("clients", "warmup", "run s")]
    return table(header, [[r[h] for h in header] for r in rows])


# ---------------------------------------------------------------------------------------------------- pFedDPO

DPO_NAMES = {"pfeddpo": "pFedDPO", "feddpo": "vanilla FedDPO", "dpo-central": "centralized DPO"}


def dpo_summary(root: Path, experiment: str) -> list[dict[str, str]]:
    """The per-run table of ``summary.md`` (``scripts/dpo_report.py``), its accuracies checked against
    ``table.csv``."""
    rel = f"{RESULTS_DIR}/{experiment}/summary.md"
    header, *rows = md_tables(root, rel)[0]
    out = [dict(zip(header, r, strict=True)) for r in rows]
    csv_rows = list(points(root, experiment).values())
    if len(csv_rows) != len(out):
        raise SourceError(f"{rel}: {len(out)} runs, table.csv {len(csv_rows)}")
    for mine, r in zip(out, csv_rows, strict=True):
        for column, metric in (("held-out reward acc.", SEEN), ("training reward acc.", "seen/train_accuracy")):
            if abs(float(mine[column]) - mean_std(r, metric)[0] / 100) > 5e-4:
                raise SourceError(f"{rel}: {mine['method']} {column} differs from table.csv ({r['point']})")
    return out


def grad_norm(text: str) -> str:
    return f"{float(text):.2f}" if float(text) < 10 else f"{float(text):.1f}"


def pfeddpo_hh(root: Path) -> str:
    rows = dpo_summary(root, "pfeddpo-hh-v1")
    best = max(float(r["held-out reward acc."]) for r in rows)
    body = [
        [
            DPO_NAMES[r["method"]],
            r["training reward acc."],
            bold(r["held-out reward acc."], float(r["held-out reward acc."]) == best),
            grad_norm(r["base-grad norm, second half"]),
            r["DPO loss, second half"],
        ]
        for r in rows
    ]
    header = ["round 80", "training reward acc.", "held-out reward acc.", "base-grad norm, rounds 41-80 (mean)"]
    return table([*header, "DPO loss, rounds 41-80 (mean)"], body)


def pfeddpo_ablations(root: Path) -> str:
    body = []
    for experiment, label in (("pfeddpo-rank-v1", "rank {}"), ("pfeddpo-participation-v1", "S = {}")):
        for r in dpo_summary(root, experiment):
            value = r["method"].split("=")[1]
            body.append(
                [
                    label.format(value),
                    r["training reward acc."],
                    r["held-out reward acc."],
                    grad_norm(r["base-grad norm, second half"]),
                    r["DPO loss, second half"],
                ]
            )
    header = ["point", "training reward acc.", "held-out reward acc.", "base-grad norm, rounds 6-10 (mean)"]
    return table([*header, "DPO loss, rounds 6-10 (mean)"], body)


DPO_POINTS = (("federated", "pfeddpo"), ("federated", "feddpo"), ("central", "dpo-central"))


def dpo_units() -> list[tuple[str, str, str]]:
    """``pfeddpo-hh``'s points in table order: (split, method, its key in ``choices.json`` and ``table.csv``)."""
    return [
        (split, method, f"{block}/preference_split={split}_name={method}")
        for split in ("random", "length")
        for block, method in DPO_POINTS
    ]


def pfeddpo_tuning(root: Path) -> str:
    """``pfeddpo-hh``'s tuning stage (``choices.json``): each method's validation reward accuracy at every step of
    the grid on each split, the chosen step in bold, a choice at the grid's edge marked."""
    record = read_choices(root, "pfeddpo-hh")
    grid = record["grid"]["method.lr"]
    body = []
    for split, method, unit in dpo_units():
        if unit not in record["choices"]:
            raise SourceError(f"{RESULTS_DIR}/pfeddpo-hh/choices.json: no choice for {unit}")
        chosen = record["choices"][unit]["method.lr"]
        scores = record["scores"][unit]
        cells = [bold(f"{scores[f'lr={lr}']:.3f}", lr == chosen) for lr in grid]
        edge = " (edge)" if unit in record["at_edge"] else ""
        body.append([split, DPO_NAMES[method], *cells, chosen + edge])
    return table(["split", "method", *(f"lr {lr}" for lr in grid), "chosen"], body)


# the per-round figures averaged over the second half of the rounds (``late/`` metrics of table.csv and paired.csv)
DPO_LATE = {"late/base_grad_norm": "base-grad norm, rounds 41-80", "late/loss": "training DPO loss, rounds 41-80"}


def seeds_of(row: dict[str, str], experiment: str) -> str:
    """A point's seeds, "N of M" while it is still running."""
    n = planned(experiment)
    return row["seeds"] if int(row["seeds"]) == n else f"{row['seeds']} of {n}"


def spread(mean: float, std: float, seeds: int) -> str:
    """mean +- std over seeds; the mean alone for one seed (no spread to show)."""
    return f"{mean:.3f} +- {std:.3f}" if seeds > 1 else f"{mean:.3f}"


def fraction(row: dict[str, str], metric: str) -> str:
    """A reward accuracy of ``table.csv`` (in percent there) as the paper gives it, a fraction over seeds."""
    mean, std = mean_std(row, metric)
    return spread(mean / 100, std / 100, int(row["seeds"]))


def dpo_point(point: str, source: str) -> tuple[str, str]:
    """The split and method of a ``pfeddpo-hh`` point (``preference_split=random_name=feddpo``)."""
    match = re.fullmatch(r"preference_split=(\w+?)_name=([\w-]+)", point)
    if match is None or match[2] not in DPO_NAMES:
        raise SourceError(f"{RESULTS_DIR}/pfeddpo-hh/{source}: a point {point!r} of no split and method")
    return match[1], match[2]


def pfeddpo_main(root: Path) -> str:
    """``pfeddpo-hh`` over seeds (``table.csv``): each method on each split at its chosen step (``choices.json``),
    reward accuracies and the held-out DPO loss at round 80; a point still running says how many seeds it has."""
    rows = points(root, "pfeddpo-hh")
    record = read_choices(root, "pfeddpo-hh")
    body = []
    for split, method, key in dpo_units():
        lr = record["choices"][key]["method.lr"]
        r = rows.get(key)
        if r is None:
            body.append([split, DPO_NAMES[method], lr, f"0 of {planned('pfeddpo-hh')}", *["-"] * 5])
            continue
        losses = [spread(*mean_std(r, m), int(r["seeds"])) for m in ("seen/loss", *DPO_LATE)]
        body.append(
            [
                split,
                DPO_NAMES[method],
                lr,
                seeds_of(r, "pfeddpo-hh"),
                fraction(r, "seen/train_accuracy"),
                fraction(r, SEEN),
                *losses,
            ]
        )
    header = ["split", "method", "step", "seeds", "training reward acc.", "held-out reward acc.", "held-out DPO loss"]
    return table([*header, *DPO_LATE.values()], body)


def pfeddpo_main_paired(root: Path) -> str:
    """Each baseline minus pFedDPO on each split (``paired.csv``): over seeds (t interval) and over (seed, client)
    pairs (bootstrap), with the paper's claim and its verdict."""
    body = []
    names = {SEEN: "held-out reward acc.", "seen/train_accuracy": "training reward acc.", **DPO_LATE}
    for r in read_csv(root, f"{RESULTS_DIR}/pfeddpo-hh/paired.csv"):
        metric = names.get(r["metric"])
        if metric is None:
            continue
        split, method = dpo_point(r["point"], "paired.csv")
        claim = f"{r['paper']}: {r['verdict']}" if r.get("paper") else "-"
        body.append(
            [
                split,
                DPO_NAMES[method],
                metric,
                r["seeds"],
                r["mean"],
                r.get("seeds ci95") or "-",
                r["per seed"],
                r.get("clients ci95") or "-",
                claim,
            ]
        )
    header = ["split", "minus pFedDPO", "metric", "seeds", "mean (points for accuracies)", "95% CI (seeds)", "per seed"]
    return table([*header, "95% CI (seed, client)", "paper's claim: verdict"], body)


DPO_PRIVATE = "pfeddpo-private-reduced"
DPO_LEVELS = {"eps8": "eps 8 (pair-level DP-SGD)", "no-noise": "without DP"}


def pfeddpo_private(root: Path) -> str:
    """pFedDPO and FedDPO with and without pair-level DP-SGD (``pfeddpo-private-reduced``, ``table.csv``): reward
    accuracies and held-out DPO loss over seeds, the noise multiplier and the largest client eps each run spent."""
    rows = points(root, DPO_PRIVATE)
    body = []
    for level, level_name in DPO_LEVELS.items():
        for method in ("pfeddpo", "feddpo"):
            key = f"{level}/name={method}"
            if key not in rows:
                raise SourceError(f"{RESULTS_DIR}/{DPO_PRIVATE}/table.csv: no row {key}")
            r = rows[key]
            eps = f"{float(r['epsilon_max (mean)']):.2f}" if r.get("epsilon_max (mean)") else "-"
            zeta = f"{float(r['noise_multiplier (mean)']):.3f}" if r.get("noise_multiplier (mean)") else "-"
            body.append(
                [
                    level_name,
                    DPO_NAMES[method],
                    r["seeds"],
                    pm(*mean_std(r, "seen/train_accuracy")),
                    pm(*mean_std(r, SEEN)),
                    "{:.4f} +- {:.4f}".format(*mean_std(r, "seen/loss")),
                    zeta,
                    eps,
                ]
            )
    header = ["DP", "method", "seeds", "training reward acc.", "held-out reward acc.", "held-out DPO loss"]
    return table([*header, "noise multiplier", "eps spent (largest client)"], body)


def pfeddpo_private_paired(root: Path) -> str:
    """FedDPO minus pFedDPO at each DP level (``paired.csv``): over seeds (t interval) and over (seed, client)
    pairs (bootstrap)."""
    body = []
    for r in read_csv(root, f"{RESULTS_DIR}/{DPO_PRIVATE}/paired.csv"):
        metric = {SEEN: "held-out reward acc.", "seen/train_accuracy": "training reward acc."}.get(r["metric"])
        if metric is None:
            continue
        body.append([DPO_LEVELS[r["block"]], metric, r["mean"], r["seeds ci95"], r["per seed"], r["clients ci95"]])
    header = ["DP", "FedDPO minus pFedDPO", "mean (points)", "95% CI (seeds)", "per seed", "95% CI (seed, client)"]
    return table(header, body)


# the ablations' points in table order: (experiment, point in table.csv, setting, method), 40 rounds each
DPO_ABLATIONS = (
    *(("pfeddpo-rank", f"lora_rank={r}", f"rank {r}", "pfeddpo") for r in ("2", "4", "8", "16")),
    *(
        ("pfeddpo-participation", f"name={m}_clients_per_round={k}", f"S = {k}", m)
        for k in ("1", "3", "5")
        for m in ("pfeddpo", "feddpo")
    ),
)


def pfeddpo_ablations_seeds(root: Path) -> str:
    """``pfeddpo-rank`` and ``pfeddpo-participation`` over seeds (``table.csv``; an experiment not run yet has no
    folder and its points read "0 of 3"): reward accuracies at round 40, the gradient norm and training loss over
    rounds 21-40, and each paper claim on the point with its verdict (``paired.csv``)."""
    rows: dict[str, dict[str, dict[str, str]]] = {}
    verdicts: dict[tuple[str, str], list[str]] = {}
    for experiment in dict.fromkeys(e for e, *_ in DPO_ABLATIONS):
        if (root / RESULTS_DIR / experiment).is_dir():
            rows[experiment] = {r["point"]: r for r in read_csv(root, f"{RESULTS_DIR}/{experiment}/table.csv")}
            for r in read_csv(root, f"{RESULTS_DIR}/{experiment}/paired.csv"):
                if r.get("paper"):
                    verdicts.setdefault((experiment, r["point"]), []).append(f"{r['paper']}: {r['verdict']}")
    body = []
    for experiment, point, setting, method in DPO_ABLATIONS:
        r = rows.get(experiment, {}).get(point)
        claims = "; ".join(verdicts.get((experiment, point), [])) or "-"
        if r is None:
            body.append([setting, DPO_NAMES[method], f"0 of {planned(experiment)}", *["-"] * 4, claims])
            continue
        late = [spread(*mean_std(r, m), int(r["seeds"])) for m in DPO_LATE]
        accuracies = [fraction(r, "seen/train_accuracy"), fraction(r, SEEN)]
        body.append([setting, DPO_NAMES[method], seeds_of(r, experiment), *accuracies, *late, claims])
    header = ["setting", "method", "seeds", "training reward acc.", "held-out reward acc."]
    return table([*header, "base-grad norm, rounds 21-40", "training DPO loss, rounds 21-40", "paper: verdict"], body)


def pfeddpo_precision(root: Path) -> str:
    """``pfeddpo-participation`` at S = 1 in fp32 (``table.csv``) beside the same runs made in bf16 before the
    ablations moved to fp32 (``pfeddpo-participation-bf16/table.csv``): means +- std over seeds, how many each."""
    bf16 = {r["point"]: r for r in read_csv(root, f"{RESULTS_DIR}/pfeddpo-participation-bf16/table.csv")}
    fp32 = {}
    if (root / RESULTS_DIR / "pfeddpo-participation" / "table.csv").is_file():
        fp32 = {r["point"]: r for r in read_csv(root, f"{RESULTS_DIR}/pfeddpo-participation/table.csv")}
    body = []
    for method in ("pfeddpo", "feddpo"):
        point = f"name={method}_clients_per_round=1"
        for precision, rows in (("bf16", bf16), ("fp32", fp32)):
            r = rows.get(point)
            if r is None:
                body.append([DPO_NAMES[method], precision, "0 of 3", *["-"] * 4])
                continue
            late = [spread(*mean_std(r, m), int(r["seeds"])) for m in DPO_LATE]
            accuracies = [fraction(r, "seen/train_accuracy"), fraction(r, SEEN)]
            body.append([DPO_NAMES[method], precision, seeds_of(r, "pfeddpo-participation"), *accuracies, *late])
    header = ["method (S = 1)", "precision", "seeds", "training reward acc.", "held-out reward acc."]
    return table([*header, "base-grad norm, rounds 21-40", "training DPO loss, rounds 21-40"], body)


KAPPA_NAMES = {
    "kappa2": "kappa^2",
    "kappa2_eff": "kappa_eff^2",
    "kappa2_rel": "kappa^2 / norm(g_bar)^2",
    "kappa2_eff_rel": "kappa_eff^2 / norm(g_bar_eff)^2",
}


def pfeddpo_kappa(root: Path) -> str:
    """The federated methods' kappa^2 family at every diagnosed round of ``pfeddpo-hh`` (``rounds.csv``: mean +- std
    over the seeds that logged it, how many in brackets)."""
    body = []
    for r in read_csv(root, f"{RESULTS_DIR}/pfeddpo-hh/rounds.csv"):
        split, method = dpo_point(r["point"], "rounds.csv")
        body.append([split, DPO_NAMES[method], r["round"], *(r[k] or "-" for k in KAPPA_NAMES)])
    return table(["split", "method", "round", *KAPPA_NAMES.values()], body)


# ---------------------------------------------------------------------------------------------------- benchmarks

ROUND_BENCH = (
    "python benchmarks/bench_compact_round.py --threads 2 --repeat 5 --transforms layer-kronecker,kronecker,blocked-dct"
)


def bench_compact_round(root: Path) -> str:
    """The latest ``benchmarks/RESULTS.md`` section of the round benchmark over all three P."""
    rel = "benchmarks/RESULTS.md"
    sections = (root / rel).read_text().split("\n## ")
    found = [s for s in sections if f"- command: `{ROUND_BENCH}`" in s]
    if not found:
        raise SourceError(f"{rel}: no section with the command {ROUND_BENCH}")
    section = found[-1]
    date = re.search(r"^- date: (.+)$", section, re.M)
    found_rows = re.findall(r"^\| fedtailor, P = ([\w-]+) \| ([\d.]+) \| ([\d.]+) \|", section, re.M)
    seconds = {p: float(s) for p, s, _ in found_rows}
    naive = {p: float(r) for p, _, r in found_rows}
    share = re.search(r"Profile with P = layer-kronecker.*?per_record_grads: [\d.]+ \((\d+)%\)", section, re.S)
    if date is None or share is None or set(seconds) != {"layer-kronecker", "kronecker", "blocked-dct"}:
        raise SourceError(f"{rel}: the section of {ROUND_BENCH} lacks its date, times or profile")
    default = seconds["layer-kronecker"]
    return (
        f"Time (`{ROUND_BENCH}`, `benchmarks/RESULTS.md`, {date.group(1)}; the machine is shared, so times vary "
        f"between runs): a private round takes {default:.2f} s with the default layer-wise P, "
        f"{seconds['kronecker']:.2f} s with the Kronecker P and {seconds['blocked-dct']:.2f} s with the blocked DCT "
        f"of the tables above ({seconds['kronecker'] / default:.1f}x and {seconds['blocked-dct'] / default:.1f}x the "
        f"default); the default is {naive['layer-kronecker']:.0f}x faster than a naive path (per-record Python loop "
        f"+ dense projection); with the default P the per-record coefficient gradients are {share.group(1)}% of a "
        "round."
    )


def bench_section(root: Path, title: str, command: str | None = None) -> tuple[str, list[list[str]]]:
    """(date, table rows with the header first) of the latest ``benchmarks/RESULTS.md`` section ``title`` (that
    ``command`` wrote, when given)."""
    rel = "benchmarks/RESULTS.md"
    sections = (root / rel).read_text().split("\n## ")
    found = [s for s in sections if s.startswith(title + "\n") and (command is None or f"- command: `{command}`" in s)]
    if not found:
        raise SourceError(f"{rel}: no section {title!r}" + (f" with the command {command}" if command else ""))
    date = re.search(r"^- date: (.+)$", found[-1], re.M)
    rows = [  # the norm's bars are not cell borders
        [c.strip().replace("\0", "||u||") for c in line.replace("||u||", "\0").strip().strip("|").split("|")]
        for line in found[-1].splitlines()
        if line.startswith("|") and not set(line) <= set("|-: ")
    ]
    if date is None or len(rows) < 2:
        raise SourceError(f"{rel}: the section {title!r} lacks its date or table")
    return date.group(1), rows


FULL_RUN = "Compact adaptation: the full 500-round MNIST run (Ours-LRSUQ, default P), 2 threads"


def bench_compact_full_run(root: Path) -> str:
    """The latest timed full 500-round run (``benchmarks/RESULTS.md``): the current code's row against the first
    row of the same section (the code before, on the same machine), and the 90-second target."""
    date, rows = bench_section(root, FULL_RUN)
    if len(rows) < 3:
        raise SourceError(f"benchmarks/RESULTS.md: the section {FULL_RUN!r} lacks its two rows")
    (_, wall0, *_), (what, wall, fit, median, seen, future) = rows[1], rows[-1]
    met = "met" if float(wall) < 90 else "not met"
    return (
        f"A full 500-round Ours-LRSUQ run with the default P (`OMP_NUM_THREADS=2 fedtailor run "
        f"configs/compact/mnist-eps16.toml --set method.variant='\"ours-lrsuq\"'`, alone on 2 cores; "
        f"`benchmarks/RESULTS.md`, {date}) takes **{float(wall):.1f} s** wall clock, startup and the 10 "
        f"evaluations included (fit {float(fit):.1f} s, median round {float(median):.3f} s; Seen {seen}%, Future "
        f"{future}%), against {float(wall0):.1f} s on the same machine before the last change ({what}): "
        f"the project's 90-second target is **{met}**."
    )


CODEC_BENCH = "python benchmarks/bench_codecs.py"
CODEC_SECTION = "Codecs at k = 16384, sigma = 0.01468 (eps = 16)"


def bench_codecs(root: Path) -> str:
    """Every codec side by side (the latest ``bench_codecs.py`` run): rate, times, the time relative to DG FP32
    in the same run, and each codec's speed target with its verdict."""
    date, rows = bench_section(root, CODEC_SECTION, CODEC_BENCH)
    head, rows = rows[0], [dict(zip(rows[0], r)) for r in rows[1:]]
    need = {"codec", "bpc", "encode ms", "decode ms", "enc+dec ms", "target", "meets target", "time vs first"}
    if not need <= set(head):
        raise SourceError(f"benchmarks/RESULTS.md: unexpected columns in {CODEC_SECTION!r}: {head}")
    body = [
        [
            r["codec"],
            r["bpc"],
            f"{float(r['encode ms']):.2f}",
            f"{float(r['decode ms']):.2f}",
            f"{float(r['enc+dec ms']):.2f}",
            f"{float(r['time vs first']):.1f}x",
            r["target"] or "-",
            r["meets target"] or "-",
        ]
        for r in rows
    ]
    header = ["codec", "bpc", "encode ms", "decode ms", "enc+dec ms", "vs DG FP32", "target", "met"]
    intro = f"`OMP_NUM_THREADS=1 {CODEC_BENCH}` ({date}, `benchmarks/RESULTS.md`):"
    return intro + "\n\n" + table(header, body)


PPR_BENCH = "python benchmarks/bench_ppr.py"
PPR_SIDE = "PPR beside LRSUQ and DG at k = 16384"
PPR_CURVE = "PPR's rate-time curve at eps 16 (k = 16384, ||u|| = 1)"
PAPER_LRSUQ_MS = 13.97


def bench_ppr(root: Path) -> str:
    """PPR beside LRSUQ and DG (the latest full ``bench_ppr.py`` run), its rate-time curve, and the issue's target
    (at most 0.5 bpc within the paper's 13.97 ms at eps 16, ||u|| = 1) read off the b = 8 rows."""
    date, side = bench_section(root, PPR_SIDE, PPR_BENCH)
    curve_date, curve = bench_section(root, PPR_CURVE, PPR_BENCH)
    if curve_date != date:
        raise SourceError(f"benchmarks/RESULTS.md: the two sections of {PPR_BENCH} are of different runs")
    head, rows = side[0], [dict(zip(side[0], r)) for r in side[1:]]
    if not {"eps", "||u||", "codec", "bpc unpadded", "bpc padded", "enc+dec ms", "time vs DG FP32"} <= set(head):
        raise SourceError(f"benchmarks/RESULTS.md: unexpected columns in {PPR_SIDE!r}: {head}")
    by = {(r["eps"], r["||u||"], r["codec"]): r for r in rows}
    body = []
    for r in rows:
        if r["||u||"] != "1" or r["codec"] == "DG FP32":
            continue
        zero = by[(r["eps"], "0", r["codec"])]
        body.append(
            [
                r["eps"],
                r["codec"],
                f"{float(zero['bpc unpadded']):.3f}",
                f"{float(r['bpc unpadded']):.3f}",
                f"{float(r['bpc padded']):.3f}",
                f"{float(r['enc+dec ms']):.1f}",
                f"{float(r['time vs DG FP32']):.1f}x",
            ]
        )
    header = ["eps", "codec", "bpc, u = 0", "bpc, norm 1", "padded", "enc + dec ms, norm 1", "vs DG FP32"]
    crow = [dict(zip(curve[0], r)) for r in curve[1:]]
    columns = {"b", "alpha", "spread", "bpc unpadded", "bpc sd", "bpc elias", "enc+dec ms", "releases", "refused"}
    if not columns <= set(curve[0]):
        raise SourceError(f"benchmarks/RESULTS.md: unexpected columns in {PPR_CURVE!r}: {curve[0]}")
    cbody = [
        [
            c["b"],
            c["alpha"],
            c["spread"],
            f"{float(c['bpc unpadded']):.3f} +- {float(c['bpc sd']):.3f}",
            f"{float(c['bpc elias']):.3f}",
            f"{float(c['enc+dec ms']):.1f}",
            f"{c['releases']} ({c['refused']} refused)" if c["refused"] != "0" else c["releases"],
        ]
        for c in crow
    ]

    def error(c: dict[str, str]) -> float:  # the standard error of a point's mean rate
        return float(c["bpc sd"]) / math.sqrt(int(c["releases"]))

    lowest = min(crow, key=lambda c: float(c["bpc unpadded"]))
    low, se = float(lowest["bpc unpadded"]), error(lowest)
    reached = (
        f"the curve {'reaches' if low - 2 * se <= 0.35 else 'stops short of'} 0.35 bpc within two standard errors "
        f"of its mean: its lowest point is {low:.3f} +- {se:.3f} (standard error) at b = {lowest['b']}, spread "
        f"{lowest['spread']}, {float(lowest['enc+dec ms']) / 1e3:.1f} s a release"
    )
    if lowest["refused"] != "0":
        reached += f", {lowest['refused']} of {int(lowest['releases']) + int(lowest['refused'])} releases refused"
    target = [c for c in crow if c["b"] == "8" and c["alpha"] == "inf"]
    side8 = by.get(("16", "1", "PPR b=8, argmin"))
    if not target or side8 is None:
        raise SourceError("benchmarks/RESULTS.md: the PPR run lacks its b = 8 argmin rows")
    ms = sorted([float(target[0]["enc+dec ms"]), float(side8["enc+dec ms"])])
    bpc = sorted([float(target[0]["bpc unpadded"]), float(side8["bpc unpadded"])])
    met = "met" if ms[1] <= PAPER_LRSUQ_MS and bpc[1] <= 0.5 else "not met"

    def span(pair: list[float], digits: int) -> str:
        low, high = (f"{v:.{digits}f}" for v in pair)
        return low if low == high else f"{low}-{high}"

    return (
        f"`OMP_NUM_THREADS=1 {PPR_BENCH}` ({date}, `benchmarks/RESULTS.md`): selected rows at ||u|| = 1 (norm "
        "1; the `u = 0` column: the same codec on a zero input) and the time relative to DG FP32 in the same run:\n\n"
        + table(header, body)
        + "\n\nThe rate-time curve at eps 16, ||u|| = 1, same run (bpc unpadded, frame included, +- its standard "
        "deviation over releases; `elias`: the same "
        "indices Elias-gamma coded; refused: releases whose search would pass the codec's bound, never sent "
        "approximately):\n\n"
        + table(["b", "alpha", "spread", "bpc", "bpc, elias", "enc + dec ms", "releases"], cbody)
        + f"\n\nThe target at eps 16 (at most 0.5 bpc within the paper's {PAPER_LRSUQ_MS} ms a release, one core) "
        f"read off the two b = 8 argmin rows of this run: {span(bpc, 3)} bpc in {span(ms, 1)} ms: "
        f"**{met}** on this machine; {reached}."
    )


# ---------------------------------------------------------------------------------------------------- regions

RENDERERS: dict[str, Callable[[Path], str]] = {
    "compact-table1": compact_table1,
    "compact-table1-seeds": compact_table1_seeds,
    "compact-table1-summary": compact_table1_summary,
    "compact-controls": compact_controls,
    "compact-comm": compact_comm,
    "compact-table1-tuned": compact_tuned("compact-table1-mnist", TUNED_TABLE1),
    "compact-table1-tuned-paired": compact_paired("compact-table1-mnist", TUNED_TABLE1),
    "compact-table1-tuned-by-eps": compact_table1_by_eps("compact-table1-mnist-tuned"),
    "compact-table1-eps16-steps": compact_table1_by_eps("compact-table1-mnist-eps16-steps"),
    "compact-table1-fmnist-tuned": compact_tuned("compact-table1-fmnist", TUNED_TABLE1),
    "compact-table1-fmnist-tuned-paired": compact_paired("compact-table1-fmnist", TUNED_TABLE1),
    "compact-controls-tuned": compact_tuned("compact-controls-mnist", TUNED_CONTROLS),
    "compact-k": compact_k,
    "compact-alpha": compact_alpha,
    "compact-alpha-paired": compact_paired(
        "compact-alpha-mnist",
        {
            f"alpha{a}/variant={v}": f"{COMPACT_VARIANTS[v]}, alpha {a}"
            for a in ("0.1", "0.5", "1.0")
            for v in ALPHA_VARIANTS
            if v != "ours-dg"
        },
    ),
    "compact-controls-tuned-paired": compact_paired("compact-controls-mnist", TUNED_CONTROLS),
    "compact-controls-noiseless-tuned": compact_tuned("compact-controls-mnist", TUNED_NOISELESS),
    "compact-controls-noiseless-tuned-paired": compact_paired("compact-controls-mnist", TUNED_NOISELESS),
    "compact-layer-allocation-validation": layer_allocation_validation,
    "compact-layer-allocation-test": layer_allocation_test,
    "fedlag-mnist-v1/alpha01": fedlag_section("fedlag-mnist", "alpha01", "fedlag-mnist-v1"),
    "fedlag-mnist-v1/alpha10": fedlag_section("fedlag-mnist", "alpha10", "fedlag-mnist-v1"),
    "fedlag-fmnist-reduced-v1/alpha01": fedlag_section("fedlag-fmnist-reduced", "alpha01", "fedlag-fmnist-reduced-v1"),
    "fedlag-fmnist-reduced-v1/alpha10": fedlag_section("fedlag-fmnist-reduced", "alpha10", "fedlag-fmnist-reduced-v1"),
    "fedlag-mnist/alpha01": fedlag_tuned("fedlag-mnist", "alpha01"),
    "fedlag-mnist/alpha10": fedlag_tuned("fedlag-mnist", "alpha10"),
    "fedlag-mnist-variants": fedlag_variants("fedlag-mnist", fixed=True),
    "fedlag-fmnist-reduced/alpha01": fedlag_tuned("fedlag-fmnist-reduced", "alpha01"),
    "fedlag-fmnist-reduced/alpha10": fedlag_tuned("fedlag-fmnist-reduced", "alpha10"),
    "fedlag-fmnist-reduced-variants": fedlag_variants("fedlag-fmnist-reduced"),
    "fedlag-adversary": fedlag_adversary,
    "fedlag-sensitivity": fedlag_sensitivity,
    "fedlag-mnist-v1-variants": fedlag_variants("fedlag-mnist-v1"),
    "fedlag-fmnist-reduced-v1-variants": fedlag_variants("fedlag-fmnist-reduced-v1"),
    "dp-utility": dp_utility,
    "dp-utility-fedlag": dp_utility_fedlag,
    "pfeddpo-hh-v1": pfeddpo_hh,
    "pfeddpo-ablations-v1": pfeddpo_ablations,
    "pfeddpo-tuning": pfeddpo_tuning,
    "pfeddpo-main": pfeddpo_main,
    "pfeddpo-main-paired": pfeddpo_main_paired,
    "pfeddpo-kappa": pfeddpo_kappa,
    "pfeddpo-ablations": pfeddpo_ablations_seeds,
    "pfeddpo-precision": pfeddpo_precision,
    "pfeddpo-private": pfeddpo_private,
    "pfeddpo-private-paired": pfeddpo_private_paired,
    "bench-compact-round": bench_compact_round,
    "bench-codecs": bench_codecs,
    "bench-compact-full-run": bench_compact_full_run,
    "bench-ppr": bench_ppr,
}


def regions(text: str, name: str) -> list[tuple[str, int, int]]:
    """(key, first line, end-marker line) of every region, lines 0-based; malformed markers raise."""
    lines = text.split("\n")
    out: list[tuple[str, int, int]] = []
    open_at: tuple[str, int] | None = None
    for i, line in enumerate(lines):
        start = START.match(line)
        if start:
            if open_at:
                raise RegionError(f"{name}:{i + 1}: region {start['key']} opens inside {open_at[0]}")
            if start["key"] not in RENDERERS:
                raise RegionError(f"{name}:{i + 1}: no renderer {start['key']!r} (known: {', '.join(RENDERERS)})")
            open_at = (start["key"], i + 1)
        elif line == END:
            if open_at is None:
                raise RegionError(f"{name}:{i + 1}: an end marker without a region")
            out.append((open_at[0], open_at[1], i))
            open_at = None
    if open_at:
        raise RegionError(f"{name}: region {open_at[0]} is never closed")
    return out


def sync(doc: Path, root: Path = ROOT, *, write: bool) -> list[str]:
    """The keys of the regions of ``doc`` that differ from their sources (rewritten when ``write``)."""
    text = doc.read_text()
    lines = text.split("\n")
    stale: list[str] = []
    for key, first, end in reversed(regions(text, str(doc))):
        want = RENDERERS[key](root).split("\n")
        if lines[first:end] != want:
            stale.append(key)
            lines[first:end] = want
    if write and stale:
        doc.write_text("\n".join(lines))
    return stale[::-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a region is stale")
    parser.add_argument("docs", nargs="*", type=Path, help=f"Markdown files (default: {', '.join(DOCS)})")
    args = parser.parse_args(argv)
    docs = args.docs or [ROOT / d for d in DOCS]
    failed = False
    for doc in docs:
        try:
            stale = sync(doc, ROOT, write=not args.check)
        except (SourceError, RegionError) as e:
            print(f"{doc}: {e}", file=sys.stderr)
            failed = True
            continue
        for key in stale:
            print(f"{doc}: region {key} {'differs from its sources' if args.check else 'rewritten'}")
        failed |= args.check and bool(stale)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
