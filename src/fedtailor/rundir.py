"""The run directory: where a run lives, what it holds, and how its files are written and read.

Every command that writes or reads runs goes through this module: ``fedtailor run`` (the runner writes),
``fedtailor report``, ``fedtailor sweep`` and ``fedtailor reproduce`` (they read and skip finished runs) and the
report scripts. A run directory holds

* ``config.json``: the resolved config (:data:`CONFIG`);
* ``metrics.jsonl``: one JSON record per round (:data:`METRICS`);
* ``results.json``: the summary, per-client results and the method's facts, schema :class:`Results`;
* ``clients.csv``: the per-client results as a table (:data:`CLIENTS`);
* ``checkpoint.pt``: the loop's checkpoint, to resume (:data:`CHECKPOINT`);
* a method's artifacts and the report's plots.

Sweeps and reproductions keep one run directory per grid point and seed, ``PARENT/<slug>/seed<S>``
(:func:`point_dir`). A finished run counts for a planned one only when its resolved config is the planned one
(:func:`finished`).
"""

import csv
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Required, TypedDict

from fedtailor.config import RunConfig, dump_config

CONFIG = "config.json"
METRICS = "metrics.jsonl"
RESULTS = "results.json"
CLIENTS = "clients.csv"
CHECKPOINT = "checkpoint.pt"
DIVERGED = "diverged.json"

#: A grid point: its overrides as (dotted key, value) pairs, in grid order.
Point = tuple[tuple[str, str], ...]


class Results(TypedDict, total=False):
    """The schema of ``results.json``, as the runner writes it (``Required``: every run has it; this module has
    no ``from __future__ import annotations``, which would hide ``Required`` from ``__required_keys__``).

    ``summary``: the final evaluation summarized over clients per group (``seen/accuracy`` the mean over seen
    clients, ``seen/accuracy/std``, ``/p10``, ``/ci95_lo``, ``/ci95_hi``, ``/n``; groups ``seen``,
    ``future``, ``all``: :func:`fedtailor.fl.loop.summarize`), and from the rounds evaluated every
    ``eval_every`` rounds ``best_round`` with ``best/...`` (the round best on the test metric: optimistic) and
    ``chosen_round`` with ``chosen/...`` (the round best on the validation split, ``data.validation_mode =
    "alongside"``) (:func:`fedtailor.fl.loop.chosen_rounds`); docs/evaluation.md says what each measures.
    ``method_summary``: the method's facts (privacy ledger, FedLAG's chosen layers, ...); ``round_totals``: sums
    and means of the per-round records (:func:`fedtailor.runner.round_totals`); ``per_client``: one row per
    evaluated client (``client``, ``seen``, its metrics, ``num_examples``)."""

    name: Required[str]
    method: Required[str]
    dataset: Required[str]
    seed: Required[int]
    rounds_completed: Required[int]
    rounds: Required[int]
    summary: Required[dict[str, float]]
    method_summary: dict[str, Any]
    round_totals: dict[str, float]
    per_client: Required[list[dict[str, Any]]]
    wall_seconds: float


#: The keys every results.json of a run has (in the order errors name them).
REQUIRED: tuple[str, ...] = (
    "name",
    "method",
    "dataset",
    "seed",
    "rounds",
    "rounds_completed",
    "summary",
    "per_client",
)


def default_run_dir(cfg: RunConfig) -> Path:
    """The run directory of ``cfg`` when none is given: ``OUT_DIR/NAME-seedSEED``."""
    return Path(cfg.out_dir) / f"{cfg.name}-seed{cfg.seed}"


_SEPARATORS = re.compile(r"[/\\\0]")  # what would make a slug more than one path component


def slug(point: Point) -> str:
    """The folder name of a grid point: ``key=value`` (the key's last part) joined by ``_``, ``base`` for none.
    Always one path component: a value holding a path separator (``out_dir=../../x``) has it replaced, and a
    digest of the point keeps such points apart; every other slug is the plain join (earlier runs resume)."""
    if not point:
        return "base"
    text = "_".join(f"{k.split('.')[-1]}={v.strip(chr(34))}" for k, v in point)
    if _SEPARATORS.search(text):
        return f"{_SEPARATORS.sub('_', text)}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"
    return text


def seed_dir(point_folder: Path, seed: int) -> Path:
    """The run directory of ``seed`` inside a grid point's folder."""
    return Path(point_folder) / f"seed{seed}"


def point_dir(parent: Path, point: Point, seed: int) -> Path:
    """The run directory of a grid point and seed: ``PARENT/<slug>/seed<S>``."""
    return seed_dir(Path(parent) / slug(point), seed)


def seed_dirs(point_folder: Path) -> list[Path]:
    """The run directories (``seed*``) inside a grid point's folder, sorted by name."""
    return sorted(Path(point_folder).glob("seed*"))


def read_results(run_dir: str | Path, *, require: Iterable[str] = REQUIRED) -> Results:
    """The run's ``results.json``, checked to hold the keys in ``require`` (every key of a run by default; a
    reader that needs fewer names them). Raises FileNotFoundError for a directory without results and
    ValueError, naming the file, for one that is damaged or not a run's."""
    path = Path(run_dir) / RESULTS
    if not path.exists() and diverged(run_dir):
        raise FileNotFoundError(f"{run_dir} holds a run that diverged, without results ({read_diverged(run_dir)})")
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} has no {RESULTS}; is it a finished `fedtailor run` directory?")
    try:
        results = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"{path} is not valid JSON (damaged?); rerun the run to rewrite it.") from None
    missing = [k for k in require if not isinstance(results, dict) or k not in results]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}: not the results of a `fedtailor run`.")
    return results


def completed(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds the results of a run that ran every round, whatever its config."""
    try:
        results = read_results(run_dir, require=("rounds", "rounds_completed"))
    except (OSError, ValueError):
        return False
    return results["rounds_completed"] == results["rounds"]


def finished(run_dir: str | Path, cfg: RunConfig) -> bool:
    """Whether ``run_dir`` holds a finished run of exactly ``cfg`` (every round, and its saved config equal to
    ``cfg`` resolved, fields added since at their defaults; the run's ``name`` and ``out_dir`` aside, which name
    the directory, not the run). A finished run of another config (a ``--quick`` one, another ``--set``) is not
    done: running ``cfg`` there with ``resume`` then refuses, naming the keys that differ."""
    if not completed(run_dir):
        return False
    try:
        return not config_differences_from(run_dir, cfg)
    except (OSError, ValueError):
        return False


def write_diverged(run_dir: Path, cfg: RunConfig, reason: str) -> None:
    """Mark ``run_dir`` as a run of ``cfg`` that diverged (``reason``: the error that stopped it), its config saved
    beside the mark: an outcome as final as a finished run's, since the same config diverges again (a tuning
    grid's largest step). It writes no results."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(run_dir, dump_config(cfg))
    write_json(run_dir / DIVERGED, {"reason": reason})


def diverged(run_dir: str | Path, cfg: RunConfig | None = None) -> bool:
    """Whether ``run_dir`` holds a run that diverged (:func:`write_diverged`), of exactly ``cfg`` where given."""
    if not (Path(run_dir) / DIVERGED).is_file():
        return False
    try:
        return cfg is None or not config_differences_from(run_dir, cfg)
    except (OSError, ValueError):
        return False


def read_diverged(run_dir: str | Path) -> str:
    """Why the run in ``run_dir`` diverged (:func:`write_diverged`); ValueError, naming the file, for a mark that
    is damaged."""
    path = Path(run_dir) / DIVERGED
    try:
        reason = json.loads(path.read_text())["reason"]
        if isinstance(reason, str):
            return reason
    except (ValueError, UnicodeDecodeError, KeyError, TypeError):
        pass
    raise ValueError(f"{path} is not a divergence mark (damaged?); delete it to run the run again.")


def config_differences_from(run_dir: str | Path, cfg: RunConfig) -> list[str]:
    """The keys (with both values) in which the config saved in ``run_dir`` differs from ``cfg`` resolved, fields
    added since at their defaults, the run's ``name`` and ``out_dir`` aside; OSError or ValueError without a
    readable saved config."""
    old, new = read_config(run_dir), json.loads(dump_config(cfg))
    for tree in (old, new):
        tree.pop("name", None)
        tree.pop("out_dir", None)
    return config_differences(old, new, defaults=config_defaults(cfg))


def read_config(run_dir: str | Path) -> dict[str, Any]:
    """The resolved config the run saved (``config.json``) as a JSON tree; OSError or ValueError if it is
    missing or unreadable."""
    tree = json.loads((Path(run_dir) / CONFIG).read_text())
    if not isinstance(tree, dict):
        raise ValueError(f"{Path(run_dir) / CONFIG} is not a config (a JSON object).")
    return tree


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's per-round records (``metrics.jsonl``), empty if it has none; a damaged line raises ValueError
    naming it."""
    path = Path(run_dir) / METRICS
    history = []
    if path.exists():
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if line.strip():
                try:
                    history.append(json.loads(line))
                except ValueError:
                    raise ValueError(f"{path} line {i} is not valid JSON (damaged?)") from None
    return history


def read_clients(run_dir: str | Path) -> list[dict[str, str]]:
    """The per-client table (``clients.csv``), its cells as text."""
    with (Path(run_dir) / CLIENTS).open(newline="") as fh:
        return list(csv.DictReader(fh))


def _jsonable(value: Any) -> Any:
    """Plain JSON values; non-finite floats become null (bare NaN is not JSON)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _json_line(record: Mapping[str, Any]) -> str:
    return json.dumps(_jsonable(record), allow_nan=False) + "\n"


def write_json(path: Path, value: Any) -> None:
    """Valid JSON (non-finite floats as null), written atomically (temp file + rename)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_jsonable(value), indent=2, allow_nan=False))
    os.replace(tmp, path)


def write_config(run_dir: Path, text: str) -> None:
    """Save the resolved config (the text of :func:`fedtailor.config.dump_config`)."""
    (run_dir / CONFIG).write_text(text)


def write_metrics(run_dir: Path, history: list[dict[str, Any]]) -> None:
    """Rewrite ``metrics.jsonl`` from a history (a checkpoint's, on resume), atomically."""
    path = run_dir / METRICS
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(_json_line(r) for r in history))
    os.replace(tmp, path)


def append_metrics(run_dir: Path, record: Mapping[str, Any]) -> None:
    """Append one round's record to ``metrics.jsonl``."""
    with (run_dir / METRICS).open("a") as fh:
        fh.write(_json_line(record))


def write_results(run_dir: Path, results: Results) -> None:
    """Write ``results.json`` (atomically) and its per-client table ``clients.csv``."""
    missing = [k for k in REQUIRED if k not in results]
    if missing:
        raise ValueError(f"results lack {', '.join(missing)}")
    write_json(run_dir / RESULTS, results)
    per_client = results["per_client"]
    # every client's fields in order of appearance (unseen clients report fine-tuned metrics too)
    fields = list(dict.fromkeys(k for row in per_client for k in row)) or ["client", "seen", "num_examples"]
    with (run_dir / CLIENTS).open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(per_client)


def write_artifacts(run_dir: Path, artifacts: Mapping[str, str]) -> None:
    """A method's text artifacts, each a file of the run directory."""
    for name, text in artifacts.items():
        (run_dir / name).write_text(text)


def config_differences(
    saved: dict[str, Any], new: dict[str, Any], prefix: str = "", *, defaults: dict[str, Any] | None = None
) -> list[str]:
    """Dotted keys whose values differ between two resolved configs, with both values. With ``defaults`` (the
    new config's sections at their default values), a key the saved config lacks (it was written before that
    field existed) is no difference when the new value is that field's default."""
    out = []
    for key in sorted(set(saved) | set(new)):
        a, b, name = saved.get(key), new.get(key), f"{prefix}{key}"
        d = (defaults or {}).get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, name + ".", defaults=d if isinstance(d, dict) else None)
        elif key not in saved and defaults is not None and key in defaults and b == d:
            continue
        elif a != b:
            out.append(f"{name} (was {a!r}, now {b!r})")
    return out


def config_defaults(cfg: RunConfig) -> dict[str, Any]:
    """``cfg``'s sections (their classes: the method named in it) with every field at its default."""
    return {
        "data": type(cfg.data)().model_dump(mode="json"),
        "federation": type(cfg.federation)().model_dump(mode="json"),
        "method": type(cfg.method)().model_dump(mode="json"),
    }
