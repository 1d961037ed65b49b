"""The planner of ``fedtailor reproduce``: the named experiments (from :mod:`fedtailor.fl.experiments`) as a list
of runs, each with its run directory ``OUT/NAME/<block>/<point>/seed<S>``, its overrides and its resolved config,
every config validated before anything runs. A point whose resolved config (less its name) was planned before is
a link to the first; a run that reads another (``Block.needs``) is planned after it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fedtailor
from fedtailor.config import RunConfig, load_config
from fedtailor.fl.experiments import EXPERIMENTS, Block, Experiment
from fedtailor.rundir import Point, completed, diverged, finished, point_dir, seed_dir, slug


@dataclass
class Run:
    """One planned (point, seed) of an experiment's block.

    ``after``: a run directory that must be finished first; ``same_as``: another planned run of the same resolved
    config, linked to it and never run twice; ``cfg``: the resolved config (a finished run counts only if it ran
    exactly this)."""

    experiment: str
    block: str
    point: Point
    seed: int
    config: str
    sets: list[str]
    out: Path
    cfg: RunConfig
    after: Path | None = None
    same_as: Path | None = None

    @property
    def label(self) -> str:
        """``NAME/BLOCK/POINT seed S``, as messages name the run."""
        return f"{self.experiment}/{self.block}/{slug(self.point)} seed {self.seed}"

    @property
    def done(self) -> bool:
        """A finished run of this point's resolved config (a ``--quick`` result, or a run with other settings,
        in the same folder is not this run)."""
        return finished(self.out, self.cfg)

    @property
    def diverged(self) -> bool:
        """A run of this point's resolved config that diverged (:func:`fedtailor.rundir.write_diverged`): not run
        again, since the same config diverges again."""
        return diverged(self.out, self.cfg)


def config_path(config: str) -> str:
    """A block's config as given if it exists from here, else inside the fedtailor checkout this package runs from
    (``configs/...`` beside ``src/``), so a reproduction starts from any directory."""
    if Path(config).exists():
        return config
    beside = Path(fedtailor.__file__).resolve().parents[2] / config
    return str(beside) if beside.exists() else config


#: Where committed choices live, beside the configs (``configs/tuned/NAME.json``).
COMMITTED = "configs/tuned"
CHOICES = "choices.json"


def tuning_dir(out: Path, name: str) -> Path:
    """The folder of an experiment's tuning runs and choices."""
    return Path(out) / name / "tuning"


def choices_record(name: str, *, out: Path, quick: bool) -> dict[str, Any]:
    """The tuning record (``choices``, ``scores``, ...) of experiment ``name`` that its runs use: the output
    folder's own ``OUT/NAME/tuning/choices.json`` when made at this scale (``--quick`` or not), else the committed
    ``configs/tuned/NAME.json``, else none (``{}``)."""
    for path in (tuning_dir(out, name) / CHOICES, Path(config_path(f"{COMMITTED}/{name}.json"))):
        if not path.exists():
            continue
        try:
            record = json.loads(path.read_text())
            if path.parent != Path(config_path(COMMITTED)) and bool(record["quick"]) != quick:
                continue  # choices of the other scale in this output folder
            record["choices"] = {str(k): {str(a): str(b) for a, b in v.items()} for k, v in record["choices"].items()}
            return record
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{path} is not a tuning choices file ({err}); delete it or run --tune again.") from None
    return {}


def load_choices(name: str, *, out: Path, quick: bool) -> dict[str, dict[str, str]]:
    """The chosen overrides of experiment ``name`` by point (``block/point``), from :func:`choices_record`."""
    return choices_record(name, out=out, quick=quick).get("choices", {})


def _has(cfg: Any, key: str) -> bool:
    """Whether the config has the (dotted) field ``key``, e.g. ``method.mu`` only for a method with a proximal
    weight."""
    node = cfg
    for part in key.split("."):
        if not hasattr(node, part):
            return False
        node = getattr(node, part)
    return True


def resolve(label: str, config: str, sets: list[str]) -> tuple[str, RunConfig]:
    """A block's config path and its config resolved with ``sets``, the data name checked (cheap: nothing is read);
    a bad point raises one ValueError that begins with ``label``."""
    from fedtailor.experiment import check_data_name

    try:
        cfg = load_config(path := config_path(config), sets)
        check_data_name(cfg)
    except ValueError as err:
        raise ValueError(f"{label}: {err}") from None
    return path, cfg


def tuned_keys(exp: Experiment, block: Block, point: Point, *, quick: bool) -> list[str]:
    """The keys of the experiment's tuning grid that the point's config has (all of them but, say, ``method.mu``
    for a method without a proximal weight)."""
    assert exp.tuning is not None
    sets = [*block.sets, *(exp.quick if quick else ()), *(f"{k}={v}" for k, v in point)]
    cfg = load_config(config_path(block.config), sets)
    return [k for k, _ in exp.tuning.grid if _has(cfg, k)]


def everything(registry: Mapping[str, Experiment]) -> list[str]:
    """What ``all`` names: every experiment but those that need data a user fetches first (``outside_all``)."""
    return [name for name, exp in registry.items() if not exp.outside_all]


def specs(names: Sequence[str], registry: Mapping[str, Experiment]) -> list[str]:
    """The experiment specs (``NAME`` or ``NAME/BLOCK[,BLOCK]``) that ``names`` stand for, ``all`` expanded."""
    return [spec for name in names for spec in (everything(registry) if name == "all" else [name])]


def unit_key(block: str, point: Point) -> str:
    """A point's name in tuning choices: ``block/<point slug>``."""
    return f"{block}/{slug(point)}"


def borrowed(
    exp: Experiment, registry: Mapping[str, Experiment], *, out: Path, quick: bool
) -> list[tuple[Point, dict[str, str]]]:
    """The choices an experiment takes from another's tuning stage (``Experiment.tuned_as``): each chosen point of
    that experiment with its choice."""
    source = registry.get(exp.tuned_as)
    if source is None or source.tuning is None:
        raise ValueError(
            f"{exp.name} takes the tuning choices of {exp.tuned_as!r}, which is not an experiment with a "
            "tuning stage; name one in tuned_as."
        )
    choices = load_choices(source.name, out=out, quick=quick)
    return [
        (point, choices[unit_key(b.name, point)])
        for b in source.blocks
        for point in b.points()
        if unit_key(b.name, point) in choices
    ]


def agreeing(
    label: str, config: str, sets: list[str], candidates: list[tuple[Point, dict[str, str]]]
) -> dict[str, str]:
    """The choice of the candidate point whose grid values ``config`` resolved with ``sets`` already has (setting
    them changes nothing), else none."""

    def resolved(extra: list[str]) -> dict[str, Any]:
        return resolve(label, config, [*sets, *extra])[1].model_dump(exclude={"name", "out_dir"})

    own = resolved([])
    found = [choice for point, choice in candidates if resolved([f"{k}={v}" for k, v in point]) == own]
    if any(f != found[0] for f in found):
        raise ValueError(
            f"{label}: tuned points of its tuned_as experiment with different choices agree with it; make them "
            "differ in a key the run sets."
        )
    return found[0] if found else {}


def _once(values: Sequence[object], what: str, noun: str) -> None:
    """Refuse a repeated seed or grid value: it would count twice in the mean and shrink the std over seeds."""
    twice = [v for i, v in enumerate(values) if v in values[:i]]
    if twice:
        raise ValueError(f"{what} gives {noun} {twice[0]} more than once; give each {noun} once.")


def plan(
    names: list[str],
    *,
    out: Path,
    seeds: list[int] | None,
    quick: bool,
    registry: Mapping[str, Experiment] = EXPERIMENTS,
) -> list[Run]:
    """Every run of the named experiments (``all``: every one; ``NAME/BLOCK[,BLOCK]``: those blocks), each config
    validated now (a bad point fails before any run). A point of an experiment with a tuning stage runs with its
    tuned values when there are choices (:func:`fedtailor.reproduce.tune.load_choices`)."""

    if seeds is not None:
        _once(seeds, "--seeds", "seed")
    runs: list[Run] = []
    first: dict[str, Path] = {}  # resolved config (less name and out_dir) -> the run directory planned for it
    for spec in specs(names, registry):
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
        tuned = load_choices(name, out=out, quick=quick) if exp.tuning is not None else {}
        on = None if exp.tuning is None else exp.tuning.on  # the block whose choices serve the others
        candidates = borrowed(exp, registry, out=out, quick=quick) if exp.tuned_as else []
        run_seeds = seeds or (exp.seeds[:1] if quick else exp.seeds)
        _once(run_seeds, f"{name}: the seeds", "seed")
        known = {f"{b.name}/{slug(p)}" for b in exp.blocks for p in b.points()}
        for block in blocks:
            if block.needs is not None and block.needs not in known:
                raise ValueError(f"{name}/{block.name} needs {block.needs!r}, which is not a run of {name}.")
            _once([k for k, _ in block.grid], f"{name}/{block.name}: the grid", "key")
            for key, values in block.grid:
                _once(values, f"{name}/{block.name}: the grid of {key}", "value")
            for point in block.points():
                for seed in run_seeds:
                    after = seed_dir(out / name / block.needs, seed) if block.needs else None
                    fixed = [v.replace("{needs}", str(after)) for v in block.sets]
                    # the point's own choice, else (Tuning.on) that of the same point in the block tuned for all
                    own = tuned.get(unit_key(block.name, point))
                    fallback = tuned.get(unit_key(on, point), {}) if on is not None else {}
                    chosen = (own if own is not None else fallback) if block.needs is None else {}
                    label = f"{name}/{block.name}/{slug(point)} seed {seed}"
                    base = [*fixed, *(exp.quick if quick else ())]
                    mine = [*(f"{k}={v}" for k, v in point), f"seed={seed}"]
                    if candidates:  # Experiment.tuned_as: the choice of the other experiment's agreeing point
                        chosen = agreeing(label, block.config, [*base, *mine], candidates)
                    sets = [*base, *(f"{k}={v}" for k, v in chosen.items()), *mine]
                    config, cfg = resolve(label, block.config, sets)
                    run_dir = point_dir(out / name / block.name, point, seed)
                    if any(r.out == run_dir for r in runs):  # a block named twice (``all`` and NAME) runs once
                        continue
                    key = cfg.model_dump_json(exclude={"name", "out_dir"})
                    same = first.setdefault(key, run_dir)
                    run = Run(name, block.name, point, seed, config, sets, run_dir, cfg, after=after)
                    if same != run_dir and not (run_dir.exists() and not run_dir.is_symlink()):
                        # the same run under another name (Factorized+ctx is Ours-DG): a link, once that finishes
                        run.after = run.same_as = same
                    runs.append(run)
    planned = {r.out for r in runs}
    for r in runs:
        if r.after is not None and r.after not in planned and not completed(r.after):
            raise ValueError(
                f"{r.experiment}/{r.block} needs the run {r.after}; include its block too "
                f"(e.g. {r.experiment} without /BLOCK)."
            )
    return runs


def listing(registry: Mapping[str, Experiment] = EXPERIMENTS) -> str:
    """One line per experiment: its name, how many runs (all seeds, and ``--quick``'s one seed), its description."""
    lines = []
    for exp in registry.values():
        points = sum(len(b.points()) for b in exp.blocks)
        tuning = ""
        if exp.tuning is not None:
            tuned = sum(
                len(exp.tuning.points(tuned_keys(exp, b, p, quick=False)))
                for b in exp.blocks
                if b.needs is None and exp.tuning.on in (None, b.name)
                for p in b.points()
            )
            tuning = f" + {tuned * len(exp.tuning.seeds)} to tune"
        elif exp.tuned_as:
            tuning = f" (at {exp.tuned_as}'s tuned steps)"
        lines.append(
            f"{exp.name:24s} {points * len(exp.seeds):4d} runs ({points:3d} with --quick){tuning}  {exp.description}"
            + (f" (not in 'all': {exp.outside_all})" if exp.outside_all else "")
        )
    return "\n".join(lines)
