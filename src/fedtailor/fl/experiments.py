"""The registry of the papers' experiments: what ``fedtailor reproduce`` can run.

An :class:`Experiment` is a list of :class:`Block` s; a block is a config file, a grid of overrides (every
combination is a point) and fixed overrides. Each method family declares its experiments beside its methods, in
a catalogue module that registers them at import, as method modules register their methods
(:mod:`fedtailor.fl.registry`):

    register_experiment(Experiment("fedlag-mnist", ...), Experiment("fedlag-fmnist", ...), module=__name__)

:data:`CATALOGUE_MODULES` lists the built-in catalogues once; they are imported on the first question asked of
the registry (:func:`experiments`, :data:`EXPERIMENTS`). The order is fixed: the built-in catalogues' experiments
in :data:`CATALOGUE_MODULES` order (each in its registration order), then any registered elsewhere, whatever
imported a catalogue first. This module imports no catalogue, method or torch itself.
"""

from __future__ import annotations

import importlib
import itertools
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

#: The built-in catalogues, one per method family (each registers its experiments when imported).
CATALOGUE_MODULES = (
    "fedtailor.methods.compact.catalogue",
    "fedtailor.methods.pfl.catalogue",
    "fedtailor.methods.dpo.catalogue",
)


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
        """Every combination of the grid's values, in grid order (one empty point without a grid)."""
        return list(itertools.product(*[[(k, v) for v in vals] for k, vals in self.grid])) if self.grid else [()]


@dataclass(frozen=True)
class Claim:
    """A paper's claim about a point against the experiment's reference point: the paired difference (point minus
    reference) in ``metric`` is expected ``"above"`` zero, ``"below"`` zero, or ``"within"`` +-``bound`` (in the
    table's unit: points for accuracies); ``point``: the grid values that pick the point (in ``block`` when given);
    ``paper``: the paper's own figure, as it gives it. The verdict reads the 95% interval over seeds
    (``fedtailor.reproduce.report.verdict``)."""

    point: tuple[tuple[str, str], ...]
    metric: str
    expect: Literal["above", "below", "within"]
    paper: str
    bound: float = 0.0
    block: str | None = None


@dataclass(frozen=True)
class Tuning:
    """The tuning stage of an experiment: every point of its blocks (each compared method and variant, at each setting)
    gets its own values of ``grid`` (e.g. the step size ``method.lr``), chosen by ``metric`` on a validation split held
    out of the seen clients' training records (``sets``: that split, and a reduced budget where the full one does not
    fit, e.g. ``federation.rounds=20``; ``--quick``'s overrides come after them), from the same grid and the same budget
    (rounds, ``seeds``) for all. A grid key a point's config does not have (``method.mu`` for a method without a
    proximal weight) is left out for that point. Blocks that read another run (``Block.needs``) are not tuned. ``on``: a
    reduced budget where tuning every block does not fit: ``--tune NAME`` tunes only that block, and a point of another
    block without a choice of its own runs with the choice of the same point there (Table 1's variants tuned at eps 16
    serve eps 8 and 32); ``--tune NAME/BLOCK`` tunes the blocks named, whose own choices then come first. An experiment
    that uses it says so in its docs, since a step need not transfer (measured: at eps 4 the eps-16 steps leave Ours-DG
    at 28% Seen accuracy)."""

    grid: tuple[tuple[str, tuple[str, ...]], ...]
    sets: tuple[str, ...] = ("data.validation=0.2",)
    metric: str = "seen/accuracy"
    seeds: tuple[int, ...] = (41,)
    on: str | None = None

    def points(self, keys: Iterable[str] | None = None) -> list[tuple[tuple[str, str], ...]]:
        """Every combination of the grid's values (of ``keys`` only, when given), in grid order."""
        keep = None if keys is None else set(keys)
        grid = [(k, vals) for k, vals in self.grid if keep is None or k in keep]
        return list(itertools.product(*[[(k, v) for v in vals] for k, vals in grid]))


@dataclass(frozen=True)
class Experiment:
    """A named list of blocks with its seeds, the overrides of ``--quick`` and the metrics its table shows.

    ``x_axis``: a numeric axis for ``trend.png`` (each metric against it, one line per other point value), as the
    papers' figures: a grid key's last part (``"coef_dim"``) or ``"block"`` (the number in the block name, e.g.
    eps16 -> 16 on an axis labelled eps); ``log_x``: that axis on a log scale; ``tuning``: the experiment's tuning stage
    (``fedtailor reproduce NAME --tune``), whose choices its runs then use; ``outside_all``: why ``all`` leaves the
    experiment out (data a user fetches first), empty for one that ``all`` runs; ``reference``: the grid values
    (key, value) every point is compared with in ``paired.md``: one, or one per swept key for blocks that sweep
    different keys (a point takes the first whose key it has); none: no paired tables. ``round_metrics``: metrics of
    the per-round records (pFedDPO's kappa^2 at its diagnosed rounds) that ``rounds.md`` gives at every round the runs
    logged them, mean +- std over seeds. ``tuned_as``: another experiment whose tuning choices this one's points take
    (an ablation run at the compared methods' chosen steps rather than tuned again at every setting): a point takes
    the choice of that experiment's point whose grid values its own resolved config already has (pFedDPO on the
    random split for each LoRA rank), none where no point agrees (the config's own values)."""

    name: str
    description: str
    blocks: tuple[Block, ...]
    quick: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ("seen/accuracy", "future/accuracy")
    seeds: tuple[int, ...] = (41, 42, 43)
    x_axis: str | None = None
    log_x: bool = False
    tuning: Tuning | None = None
    outside_all: str = ""
    reference: tuple[tuple[str, str], ...] = ()
    claims: tuple[Claim, ...] = ()
    round_metrics: tuple[str, ...] = ()
    tuned_as: str = ""

    def __post_init__(self) -> None:
        if self.tuned_as and self.tuning is not None:
            raise ValueError(f"{self.name}: an experiment has a tuning stage or takes another's choices, not both.")
        on = None if self.tuning is None else self.tuning.on
        if on is not None and on not in {b.name for b in self.blocks}:
            raise ValueError(f"{self.name}: its tuning stage is on block {on!r}, which is not a block of it.")


_EXPERIMENTS: dict[str, tuple[str, Experiment]] = {}  # name -> (registering module, experiment)
_loaded = False
_lock = threading.RLock()


def register_experiment(*experiments: Experiment, module: str = "") -> None:
    """Register ``experiments`` in the order given; ``module``: the catalogue module registering them
    (``__name__``), which places them in the listing. A second registration of a name is refused unless it is the
    same experiment (a module imported twice)."""
    with _lock:
        for experiment in experiments:
            old = _EXPERIMENTS.get(experiment.name)
            if old is not None and old[1] != experiment:
                raise ValueError(f"experiment {experiment.name!r} is registered already (by {old[0] or 'a caller'}).")
            _EXPERIMENTS[experiment.name] = (module, experiment)


def load_builtin() -> None:
    """Import the built-in catalogues (once)."""
    global _loaded
    if _loaded:
        return
    with _lock:
        if not _loaded:
            for module in CATALOGUE_MODULES:
                importlib.import_module(module)
            _loaded = True


def experiments() -> dict[str, Experiment]:
    """Every registered experiment by name, in listing order (built-in catalogues first)."""
    load_builtin()
    rank = {m: i for i, m in enumerate(CATALOGUE_MODULES)}
    items = list(_EXPERIMENTS.values())
    ordered = sorted(range(len(items)), key=lambda i: (rank.get(items[i][0], len(rank)), i))
    return {items[i][1].name: items[i][1] for i in ordered}


class _Experiments(Mapping[str, Experiment]):
    """Every registered experiment by name: a live, read-only view of the registry, in listing order."""

    def __getitem__(self, name: str) -> Experiment:
        load_builtin()
        return _EXPERIMENTS[name][1]

    def __iter__(self) -> Iterator[str]:
        return iter(experiments())

    def __len__(self) -> int:
        return len(experiments())


EXPERIMENTS: Mapping[str, Experiment] = _Experiments()
