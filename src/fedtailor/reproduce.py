"""``fedtailor reproduce NAME``: the papers' experiments from one command, resumable, with tables, plots and one
self-contained HTML report.

An *experiment* is a list of *blocks*; a block is a config file, a grid of overrides (every combination is a
point) and fixed overrides. Every (point, seed) is an ordinary run directory
``OUT/NAME/<block>/<point>/seed<S>``, so an interrupted reproduction resumes: finished runs are skipped,
unfinished ones continue from their checkpoints. ``--quick`` adds the experiment's reduced-scale overrides
and runs its first seed only (``--seeds`` gives more). ``all`` names every experiment; ``NAME/BLOCK[,BLOCK]``
runs only those blocks of an experiment (``compact-table1-mnist/eps16``) in the same folders, so the rest can be
added later. A point whose resolved config (less its name) equals one planned before runs once: its folder is a
link to the first (Table 2's alpha 0.5 is Table 1 at eps 16).
``--jobs N`` runs N processes of ``cores // N`` threads each (``OMP_NUM_THREADS``), never more than the cores.

Outputs per experiment: ``table.md`` and ``table.csv`` (mean +- std over seeds of the per-client means, per
point), ``accuracy.png`` (a bar per point with the seed spread), ``trend.png`` where the experiment has a numeric
axis (each metric against eps, alpha or k, as the papers' figures), and ``OUT/report.html`` linking every
experiment with its tables and images inline (one file, no external resources).
"""

from __future__ import annotations

import base64
import csv
import html
import itertools
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fedtailor.config import RunConfig, load_config
from fedtailor.report import aggregate_seeds
from fedtailor.rundir import finished

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Block:
    """A config, a grid of overrides and fixed overrides. ``needs`` names another run of the same experiment and
    seed (``"block/point"``) that must finish first; ``{needs}`` in ``sets`` becomes its run directory (Replay
    reads the gains of the Factorized run of its seed)."""

    name: str
    config: str
    grid: tuple[tuple[str, tuple[str, ...]], ...] = ()
    sets: tuple[str, ...] = ()
    needs: str | None = None

    def points(self) -> list[tuple[tuple[str, str], ...]]:
        return list(itertools.product(*[[(k, v) for v in vals] for k, vals in self.grid])) if self.grid else [()]


@dataclass(frozen=True)
class Experiment:
    name: str
    description: str
    blocks: tuple[Block, ...]
    quick: tuple[str, ...] = ()  # overrides of --quick
    metrics: tuple[str, ...] = ("seen/accuracy", "future/accuracy")
    seeds: tuple[int, ...] = (41, 42, 43)
    # a numeric axis for trend.png (each metric against it, one line per other point value), as the papers' figures:
    # a grid key's last part ("coef_dim", "alpha") or "block" (the number in the block name, e.g. eps16 -> 16)
    x_axis: str | None = None
    log_x: bool = False


def _fedlag_blocks(prefix: str) -> tuple[Block, ...]:
    """Every base with and without FedLAG (``top_k = 0`` is the base exactly), the fixed First/Middle/Last-K, and
    FedLAG scoring modules (a module's weight and bias as one layer; ``top_k = 1``: half of the DNN's two layers) at
    both alphas, from ``configs/fedlag/<prefix>-alpha{01,10}.toml``. The bases are every registered one that
    FedLAG wraps (:func:`fedtailor.fl.registry.fedlag_bases`), so a new base is picked up."""
    from fedtailor.fl.registry import fedlag_bases

    bases = fedlag_bases()
    out = []
    for a in ("01", "10"):
        config = f"configs/fedlag/{prefix}-alpha{a}.toml"
        out += [
            Block(f"main-alpha{a}", config, (("method.name", bases), ("method.fedlag.top_k", ("0", "2")))),
            Block(f"fixed-alpha{a}", config, (("method.fedlag.choice", ("first", "middle", "last")),)),
            Block(f"unit-alpha{a}", config, (("method.fedlag.unit", ("module",)),), ("method.fedlag.top_k=1",)),
        ]
    return tuple(out)


# --quick for compact adaptation: 10 rounds on 25,000 records (500 per client: a client needs context_size /
# (1 - eval_fraction) = 417 at least)
COMPACT_QUICK = ("federation.rounds=10", "federation.eval_every=0", "data.limit=25000")
# --quick for pFedDPO: 2 rounds of one local step on 8 pairs per client
DPO_QUICK = (
    "federation.rounds=2",
    "method.local_steps=1",
    "data.pairs_per_client=8",
    "data.heldout_pairs=4",
    "federation.eval_every=0",
)
FMNIST_REDUCED = ("federation.rounds=40", "federation.eval_every=0", "data.limit=20000")
DPO_METRICS = ("seen/train_accuracy", "seen/accuracy", "seen/loss")
COMPACT_VARIANTS = ("global", "full-dg", "deeplin-dg", "ours-dg", "ours-lrsuq", "dg-q12")


def _controls_blocks(config: str) -> tuple[Block, ...]:
    """The geometry controls at the config's eps and without noise (eps = inf); Replay applies the per-round gains
    of the Factorized run of the same seed and noise."""
    controls = (("method.variant", ("direct", "deeplin", "factorized", "radial", "factorized-ctx")),)
    replay = (("method.variant", ("replay",)),)
    out = []
    for name, sets in (("eps16", ()), ("noiseless", ("method.privacy.epsilon=inf",))):
        out += [
            Block(name, config, controls, sets),
            Block(
                f"{name}-replay",
                config,
                replay,
                (*sets, 'method.replay_from="{needs}"'),
                needs=f"{name}/variant=factorized",
            ),
        ]
    return tuple(out)


def _compact_experiments(data: str, label: str) -> tuple[Experiment, ...]:
    """The compact-adaptation paper's experiments on ``configs/compact/<data>-eps*.toml``."""
    eps16 = f"configs/compact/{data}-eps16.toml"
    head = f"Compact adaptation on {label}"
    return (
        Experiment(
            f"compact-table1-{data}",
            f"{head}, Table 1: Seen/Future accuracy of each variant at eps 4, 8, 16, 32",
            tuple(
                Block(f"eps{e}", f"configs/compact/{data}-eps{e}.toml", (("method.variant", COMPACT_VARIANTS),))
                for e in (4, 8, 16, 32)
            ),
            quick=COMPACT_QUICK,
            x_axis="block",
            log_x=True,
        ),
        Experiment(
            f"compact-controls-{data}",
            f"{head}, the geometry controls (public context u0; Factorized+ctx "
            "restores the private context) at eps 16 and without noise",
            _controls_blocks(eps16),
            quick=COMPACT_QUICK,
        ),
        Experiment(
            f"compact-alpha-{data}",
            f"{head}, Table 2: Dirichlet alpha sweep at eps 16",
            (
                Block(
                    "eps16",
                    eps16,
                    (
                        ("data.alpha", ("0.1", "0.5", "1.0")),
                        ("method.variant", ("global", "full-dg", "ours-dg", "ours-lrsuq")),
                    ),
                ),
            ),
            quick=COMPACT_QUICK,
            x_axis="alpha",
            log_x=True,
        ),
        Experiment(
            f"compact-k-{data}",
            f"{head}, the k trade-off at eps 16: accuracy, protected uplink and the "
            "realised perturbation norm (diagnostics on: those runs report eps as void)",
            (
                Block(
                    "eps16",
                    eps16,
                    (("method.coef_dim", ("4096", "8192", "16384", "32768", "65536")),),
                    ("method.diagnostics=true",),
                ),
            ),
            quick=COMPACT_QUICK,
            x_axis="coef_dim",
            log_x=True,
            metrics=("seen/accuracy", "future/accuracy", "uplink_payload_MB", "perturbation_norm_mean"),
        ),
        Experiment(
            f"compact-comm-{data}",
            f"{head}, the communication table at eps 16: bits per coefficient, "
            "protected uplink, encode time per release and accuracy of each codec (diagnostics on for the "
            "times)",
            (
                Block(
                    "eps16",
                    eps16,
                    (("method.variant", ("ours-dg", "dg-q12", "ours-lrsuq")),),
                    ("method.diagnostics=true",),
                ),
            ),
            quick=COMPACT_QUICK,
            metrics=(
                "seen/accuracy",
                "future/accuracy",
                "bits_per_coefficient_mean",
                "uplink_payload_MB",
                "encode_ms_mean",
            ),
        ),
    )


EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in (
        *_compact_experiments("mnist", "MNIST"),
        *_compact_experiments("fmnist", "Fashion-MNIST (stands in for CIFAR-10)"),
        Experiment(
            "fedlag-mnist",
            "FedLAG: every base with and without FedLAG, and fixed First/Middle/Last-K, on MNIST "
            "(DNN) at Dirichlet alpha 0.1 and 1.0",
            _fedlag_blocks("mnist-dnn"),
            quick=("federation.rounds=10", "federation.eval_every=0", "method.fedlag.warmup=5", "data.limit=10000"),
            metrics=("seen/accuracy",),
        ),
        Experiment(
            "fedlag-fmnist",
            "FedLAG on Fashion-MNIST (FedAvgCNN) at alpha 0.1 and 1.0",
            _fedlag_blocks("fmnist-fedavgcnn"),
            quick=("federation.rounds=5", "federation.eval_every=0", "method.fedlag.warmup=2", "data.limit=5000"),
            metrics=("seen/accuracy",),
        ),
        Experiment(
            "fedlag-fmnist-reduced",
            "FedLAG on Fashion-MNIST (FedAvgCNN) at the scale this 2-core CPU fits: "
            "FedAvg, FedPer and Ditto with and without FedLAG and fixed Last-K, 40 rounds (warm-up 20) on 20,000 "
            "records, at alpha 0.1 and 1.0",
            tuple(
                b
                for a in ("01", "10")
                for b in (
                    Block(
                        f"main-alpha{a}",
                        f"configs/fedlag/fmnist-fedavgcnn-alpha{a}.toml",
                        (("method.name", ("fedavg", "fedper", "ditto")), ("method.fedlag.top_k", ("0", "2"))),
                        FMNIST_REDUCED,
                    ),
                    Block(
                        f"fixed-alpha{a}",
                        f"configs/fedlag/fmnist-fedavgcnn-alpha{a}.toml",
                        (("method.fedlag.choice", ("last",)),),
                        FMNIST_REDUCED,
                    ),
                )
            ),
            quick=("federation.rounds=5", "method.fedlag.warmup=2", "data.limit=5000"),
            metrics=("seen/accuracy",),
        ),
        Experiment(
            "pfeddpo-hh",
            "pFedDPO against vanilla FedDPO and centralized DPO on HH-RLHF with SmolLM2 (the "
            "federated methods log kappa^2 every 10 rounds)",
            (
                Block(
                    "federated",
                    "configs/pfeddpo/hh-rlhf.toml",
                    (("method.name", ("pfeddpo", "feddpo")),),
                    ("method.diagnostics_every=10",),
                ),
                Block("central", "configs/pfeddpo/hh-rlhf.toml", (("method.name", ("dpo-central",)),)),
            ),
            quick=DPO_QUICK,
            metrics=DPO_METRICS,
            seeds=(41,),
        ),
        Experiment(
            "pfeddpo-rank",
            "pFedDPO's LoRA rank (4, 8, 16) on HH-RLHF with SmolLM2, 10 rounds",
            (
                Block(
                    "rank",
                    "configs/pfeddpo/hh-rlhf.toml",
                    (("method.lora_rank", ("4", "8", "16")),),
                    ("federation.rounds=10",),
                ),
            ),
            quick=DPO_QUICK,
            metrics=DPO_METRICS,
            seeds=(41,),
            x_axis="lora_rank",
            log_x=True,
        ),
        Experiment(
            "pfeddpo-participation",
            "pFedDPO with S = 2, 3, 5 of the 5 clients per round on HH-RLHF with SmolLM2, 10 rounds",
            (
                Block(
                    "participation",
                    "configs/pfeddpo/hh-rlhf.toml",
                    (("federation.clients_per_round", ("2", "3", "5")),),
                    ("federation.rounds=10",),
                ),
            ),
            quick=DPO_QUICK,
            metrics=DPO_METRICS,
            seeds=(41,),
            x_axis="clients_per_round",
        ),
    )
}


@dataclass
class Run:
    experiment: str
    block: str
    point: tuple[tuple[str, str], ...]
    seed: int
    config: str
    sets: list[str]
    out: Path
    after: Path | None = None  # a run directory that must be finished first
    same_as: Path | None = None  # another planned run of the same resolved config: linked to it, never run twice
    cfg: RunConfig | None = None  # the resolved config: a finished run counts only if it ran exactly this

    @property
    def done(self) -> bool:
        """A finished run of this point's resolved config (a ``--quick`` result, or a run with other settings,
        in the same folder is not this run)."""
        return finished(self.out, self.cfg) if self.cfg is not None else _finished(self.out)


def _finished(out: Path) -> bool:
    f = out / "results.json"
    if not f.exists():
        return False
    r = json.loads(f.read_text())
    return r.get("rounds_completed") == r.get("rounds")


def _config_path(config: str) -> str:
    """A block's config as given if it exists from here, else inside the fedtailor checkout this module runs from
    (``configs/...`` beside ``src/``), so a reproduction starts from any directory."""
    if Path(config).exists():
        return config
    beside = Path(__file__).resolve().parents[2] / config
    return str(beside) if beside.exists() else config


def slug(point: tuple[tuple[str, str], ...]) -> str:
    return "_".join(f"{k.split('.')[-1]}={v.strip(chr(34))}" for k, v in point) or "base"


def plan(
    names: list[str], *, out: Path, seeds: list[int] | None, quick: bool, registry: dict[str, Experiment] = EXPERIMENTS
) -> list[Run]:
    """Every run of the named experiments, each config validated now (a bad point fails before any run)."""
    from fedtailor.experiment import check_data_name

    runs = []
    first: dict[str, Path] = {}  # resolved config (less name and out_dir) -> the run directory planned for it
    for spec in [n for name in names for n in (registry if name == "all" else [name])]:
        name, _, only = spec.partition("/")
        if name not in registry:
            raise ValueError(f"unknown experiment {name!r}; `fedtailor reproduce --list` shows them.")
        exp = registry[name]
        blocks = [b for b in exp.blocks if not only or b.name in only.split(",")]
        if only and len(blocks) != len(set(only.split(","))):
            raise ValueError(
                f"{spec!r}: {name} has the blocks {', '.join(b.name for b in exp.blocks)}; "
                f"name them as {name}/BLOCK[,BLOCK]."
            )
        known = {f"{b.name}/{slug(p)}" for b in exp.blocks for p in b.points()}
        for block in blocks:
            if block.needs is not None and block.needs not in known:
                raise ValueError(f"{name}/{block.name} needs {block.needs!r}, which is not a run of {name}.")
            for point in block.points():
                for seed in seeds or (exp.seeds[:1] if quick else exp.seeds):
                    after = out / name / block.needs / f"seed{seed}" if block.needs else None
                    fixed = [v.replace("{needs}", str(after)) for v in block.sets]
                    sets = [*fixed, *(exp.quick if quick else ()), *(f"{k}={v}" for k, v in point), f"seed={seed}"]
                    try:
                        cfg = load_config(config := _config_path(block.config), sets)
                        check_data_name(cfg)
                    except ValueError as err:
                        raise ValueError(f"{name}/{block.name}/{slug(point)} seed {seed}: {err}") from None
                    run_dir = out / name / block.name / slug(point) / f"seed{seed}"
                    if any(r.out == run_dir for r in runs):  # a block named twice (``all`` and NAME) runs once
                        continue
                    key = cfg.model_dump_json(exclude={"name", "out_dir"})
                    same = first.setdefault(key, run_dir)
                    if same != run_dir and not (run_dir.exists() and not run_dir.is_symlink()):
                        # the same run under another name (Factorized+ctx is Ours-DG): a link, once that finishes
                        runs.append(
                            Run(name, block.name, point, seed, config, sets, run_dir, same, same_as=same, cfg=cfg)
                        )
                    else:
                        runs.append(Run(name, block.name, point, seed, config, sets, run_dir, after, cfg=cfg))
    planned = {r.out for r in runs}
    for r in runs:
        if r.after is not None and r.after not in planned and not _finished(r.after):
            raise ValueError(
                f"{r.experiment}/{r.block} needs the run {r.after}; include its block too "
                f"(e.g. {r.experiment} without /BLOCK)."
            )
    return runs


def execute(
    runs: list[Run],
    *,
    jobs: int = 1,
    progress: Callable[[str], None] = print,
    command: Callable[[Run], list[str]] | None = None,
) -> list[Run]:
    """Run what is not finished, ``jobs`` processes at a time (``cores // jobs`` threads each), with a progress
    line after each start and finish: done / running / left and an estimate of the time left. Returns the runs
    that failed."""
    cores = os.cpu_count() or 1
    jobs = max(1, min(jobs, cores))
    todo = [r for r in runs if not r.done]
    done, failed, running = len(runs) - len(todo), [], {}
    durations: list[float] = []
    threads = str(cores // jobs)  # jobs x threads never exceeds the cores
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    build = command or _run_command

    def line() -> None:
        left = len(todo) + len(running)
        work = left - sum(r.same_as is not None for r in todo)  # links take no time
        eta = (sum(durations) / len(durations)) * work / jobs if durations else float("nan")
        progress(
            f"reproduce: {done} done, {len(running)} running, {left - len(running)} waiting"
            + (f", about {eta / 60:.1f} min left" if durations else "")
        )

    def ready() -> Run | None:  # the first waiting run whose prerequisite has finished
        return next((r for r in todo if r.after is None or _finished(r.after)), None)

    line()
    while todo or running:
        while len(running) < jobs and (run := ready()) is not None:
            todo.remove(run)
            run.out.parent.mkdir(parents=True, exist_ok=True)
            if run.same_as is not None:  # finished under its first name: link it (relative, so out can move)
                if not run.out.is_symlink():
                    run.out.symlink_to(os.path.relpath(run.same_as, run.out.parent), target_is_directory=True)
                done += 1
                line()
                continue
            logf = open(run.out.parent / f"{run.out.name}.log", "w")  # noqa: SIM115 - closed when the run ends
            running[subprocess.Popen(build(run), env=env, stdout=logf, stderr=subprocess.STDOUT)] = (
                run,
                time.time(),
                logf,
            )
            line()
        time.sleep(0.2)
        for proc in [p for p in running if p.poll() is not None]:
            run, started, logf = running.pop(proc)
            logf.close()
            if proc.returncode == 0:
                done += 1
                durations.append(time.time() - started)
            else:
                failed.append(run)
                progress(
                    f"reproduce: {run.experiment}/{run.block}/{slug(run.point)} seed {run.seed} failed "
                    f"(exit {proc.returncode}); see {run.out.parent / (run.out.name + '.log')}"
                )
            line()
        if todo and not running and ready() is None:  # what is left waits for runs that failed
            for run in todo:
                failed.append(run)
                progress(
                    f"reproduce: {run.experiment}/{run.block}/{slug(run.point)} seed {run.seed} not run: "
                    f"{run.after} did not finish"
                )
            todo.clear()
    return failed


def _run_command(run: Run) -> list[str]:
    cmd = [sys.executable, "-m", "fedtailor", "run", run.config, "--out", str(run.out), "--no-progress", "--no-plots"]
    if run.out.exists() and any(run.out.iterdir()):
        cmd.append("--resume")
    for s in run.sets:
        cmd += ["--set", s]
    return cmd


def tables(runs: list[Run], *, out: Path, registry: dict[str, Experiment] = EXPERIMENTS) -> list[Path]:
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
            for m in exp.metrics:
                if m in stats:
                    scale = 100.0 if m.endswith("accuracy") else 1.0  # accuracies in percent, the rest as they are
                    mean, std = scale * stats[m][0], scale * stats[m][1]
                    row[m] = f"{mean:.2f} +- {std:.2f}" if scale == 100 else f"{mean:.4g} +- {std:.2g}"
                    row[m + " (mean)"], row[m + " (std)"] = mean, std
            rows.append(row)
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        cols = ["block", "point", "seeds", *[m for m in exp.metrics if any(m in r for r in rows)]]
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


def _pyplot():
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


def html_report(folders: list[Path], *, out: Path, registry: dict[str, Experiment] = EXPERIMENTS) -> Path:
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
        cols = ["block", "point", "seeds", *[m for m in exp.metrics if rows and m in rows[0]]]
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


def listing(registry: dict[str, Experiment] = EXPERIMENTS) -> str:
    lines = []
    for exp in registry.values():
        points = sum(len(b.points()) for b in exp.blocks)
        lines.append(f"{exp.name:24s} {points * len(exp.seeds):4d} runs ({points:3d} with --quick)  {exp.description}")
    return "\n".join(lines)


@dataclass
class Outcome:
    runs: list[Run]
    failed: list[Run] = field(default_factory=list)
    report: Path | None = None


def reproduce(
    names: list[str],
    *,
    out: Path,
    seeds: list[int] | None = None,
    quick: bool = False,
    jobs: int = 1,
    progress: Callable[[str], None] = print,
) -> Outcome:
    runs = plan(names, out=out, seeds=seeds, quick=quick)
    failed = execute(runs, jobs=jobs, progress=progress)
    folders = tables(runs, out=out)
    return Outcome(runs=runs, failed=failed, report=html_report(folders, out=out))
