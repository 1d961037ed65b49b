"""Run an experiment from a config into a run directory.

A run directory holds ``config.json`` (the resolved config), ``metrics.jsonl`` (one record per round),
``results.json`` (summary, per-client results, method facts such as the privacy ledger), ``clients.csv``,
``checkpoint.pt`` (to resume) and the report's plots.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedtailor.config import RunConfig, dump_config
from fedtailor.experiment import build_method, build_setup
from fedtailor.fl.checkpoint import load_checkpoint
from fedtailor.fl.loop import RunInterrupted, Transport, run_federated, summarize

log = logging.getLogger(__name__)


def default_run_dir(cfg: RunConfig) -> Path:
    return Path(cfg.out_dir) / f"{cfg.name}-seed{cfg.seed}"


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


def write_json(path: Path, value: Any) -> None:
    """Valid JSON (non-finite floats as null), written atomically (temp file + rename)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_jsonable(value), indent=2, allow_nan=False))
    os.replace(tmp, path)


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


def _defaults_of(cfg: RunConfig) -> dict[str, Any]:
    """``cfg``'s sections (their classes: the method named in it) with every field at its default."""
    return {
        "data": type(cfg.data)().model_dump(mode="json"),
        "federation": type(cfg.federation)().model_dump(mode="json"),
        "method": type(cfg.method)().model_dump(mode="json"),
    }


def _check_out(
    out: Path, cfg_text: str, *, resume: bool, defaults: dict[str, Any] | None = None, given: bool = True
) -> bool:
    """Refuse an unusable run directory before anything is loaded; returns True when it must be created.
    ``given``: the directory was given (``--out``), not made from the config's ``out_dir`` and ``name``."""
    if out.exists() and not out.is_dir():
        if not given:
            raise ValueError(
                f"the run directory {out} (the config's out_dir/NAME-seedSEED) is a file, not a "
                "directory; choose another with --out, or change name or out_dir."
            )
        raise ValueError(f"--out {out} is a file, not a directory; choose another path for the run directory.")
    fresh = not out.exists() or not any(out.iterdir())
    if not resume:
        if not fresh:
            raise FileExistsError(
                f"run directory {out} already exists; pass --resume to continue it or --out to choose another."
            )
        return not out.exists()
    if fresh:
        raise FileNotFoundError(f"--resume: {out} holds no run to continue; drop --resume to start one there.")
    saved_path = out / "config.json"
    if not saved_path.exists():
        raise ValueError(
            f"--resume: {out} has no config.json, so it is not a run directory (or not one of ours); "
            "start the run in a new directory with --out."
        )
    try:
        saved = json.loads(saved_path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"--resume: {saved_path} is unreadable ({err}); start the run in a new directory.") from None
    diff = config_differences(saved, json.loads(cfg_text), defaults=defaults)
    if diff:
        raise ValueError(
            f"{out} was run with a different config: {'; '.join(diff[:8])}"
            f"{' ...' if len(diff) > 8 else ''}. Resume with the same config and --set values, or "
            "use --out for a new run."
        )
    return False


def finished(out: Path, cfg: RunConfig) -> bool:
    """Whether ``out`` holds a finished run of exactly ``cfg`` (every round, and its saved config equal to
    ``cfg`` resolved, fields added since at their defaults; the run's ``name`` and ``out_dir`` aside, which name
    the directory, not the run). A finished run of another config is not done: running ``cfg`` there with
    ``resume`` then refuses, naming the keys that differ."""
    results, saved = Path(out) / "results.json", Path(out) / "config.json"
    try:
        r = json.loads(results.read_text())
        old, new = json.loads(saved.read_text()), json.loads(dump_config(cfg))
        for tree in (old, new):
            tree.pop("name", None)
            tree.pop("out_dir", None)
        diff = config_differences(old, new, defaults=_defaults_of(cfg))
    except (OSError, ValueError):
        return False
    return not diff and r.get("rounds_completed") == r.get("rounds")


def round_totals(history: list[dict[str, Any]]) -> dict[str, float]:
    """Run-level figures from the per-round records: sums of ``*_bytes`` (also in MB as ``*_MB``), of the
    rejected and abstained replies (``*_total``), means of the other numeric metrics (``*_mean``)."""
    keys = sorted({k for r in history for k, v in r.items() if isinstance(v, (int, float)) and k != "round"})
    out: dict[str, float] = {}
    for k in keys:
        vals = [float(r[k]) for r in history if isinstance(r.get(k), (int, float))]
        if k.endswith("_bytes"):
            out[k] = sum(vals)
            out[k[: -len("_bytes")] + "_MB"] = sum(vals) / 1e6
        elif k in ("rejected", "abstained"):
            out[k + "_total"] = sum(vals)
        else:
            out[k + "_mean"] = sum(vals) / len(vals)
    return out


def run_experiment(
    cfg: RunConfig,
    run_dir: str | Path | None = None,
    *,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    built: tuple[Any, Any] | None = None,
    transport: Transport | None = None,
    on_round: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """Run ``cfg``; returns the run directory. With ``resume`` an interrupted run continues from its
    checkpoint and ends with the same results as an uninterrupted one.

    Nothing is written until the run can start: the directory, data, method and (on resume) the checkpoint are
    checked first, and a run that fails before its first checkpoint removes the directory this call created.
    A diverging run (a non-finite value, or a loss above :data:`~fedtailor.fl.records.LOSS_LIMIT`) raises
    :class:`~fedtailor.fl.records.TrainingDiverged` and writes no results; an interrupt raises
    :class:`~fedtailor.fl.loop.RunInterrupted` naming the last checkpoint.

    ``built``: the (setup, method) of ``cfg`` when the caller has them already; ``transport``: where the clients
    run (default: in this process; the Flower ServerApp passes its nodes); ``on_round``: called with each
    round's record after it is written.
    """
    out = Path(run_dir) if run_dir is not None else default_run_dir(cfg)
    ckpt = out / "checkpoint.pt"
    cfg_text = dump_config(cfg)
    create = _check_out(out, cfg_text, resume=resume, defaults=_defaults_of(cfg), given=run_dir is not None)

    t0 = time.perf_counter()
    if built is None:
        setup = build_setup(cfg)
        built = (setup, build_method(setup))
    setup, method = built
    history: list[dict[str, Any]] = []
    if ckpt.exists():  # read and check it before touching anything
        history = load_checkpoint(ckpt, setup.schedule).history
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(
            f"cannot create the run directory {out}: {err.strerror or err}; choose another --out."
        ) from None
    try:
        result = _run_in(
            out,
            cfg,
            cfg_text,
            setup,
            method,
            history,
            progress=progress,
            stop_after=stop_after,
            transport=transport,
            on_round=on_round,
        )
    except BaseException as err:
        if create and not ckpt.exists():  # nothing to resume: leave no directory behind
            shutil.rmtree(out, ignore_errors=True)
        if isinstance(err, RunInterrupted):
            err.run_dir = out if ckpt.exists() else None
        raise
    finally:
        method.close()  # e.g. pFedDPO's spilled sum of a round that an error or Ctrl-C cut short
    if result.state.round < cfg.federation.rounds:
        log.info("stopped after round %d of %d; continue with --resume", result.state.round, cfg.federation.rounds)
    _write_results(out, cfg, setup, method, result, wall=time.perf_counter() - t0)
    return out


def _run_in(
    out: Path,
    cfg: RunConfig,
    cfg_text: str,
    setup: Any,
    method: Any,
    history: list[dict[str, Any]],
    *,
    progress: bool,
    stop_after: int | None,
    transport: Transport | None,
    on_round: Callable[[dict[str, Any]], None] | None,
) -> Any:
    (out / "config.json").write_text(cfg_text)
    metrics_path = out / "metrics.jsonl"
    # metrics.jsonl mirrors the loop's history: rewritten from the checkpoint's (atomically), then appended
    tmp = metrics_path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(_jsonable(r), allow_nan=False) + "\n" for r in history))
    os.replace(tmp, metrics_path)

    def written(record: dict[str, Any]) -> None:  # the driver has checked it (fl.records.check_diverged)
        with metrics_path.open("a") as fh:
            fh.write(json.dumps(_jsonable(record), allow_nan=False) + "\n")
        if on_round is not None:
            on_round(record)

    result = run_federated(
        method,
        setup.clients,
        setup.schedule,
        eval_every=cfg.federation.eval_every,
        checkpoint=out / "checkpoint.pt",
        checkpoint_every=cfg.federation.checkpoint_every,
        on_round=written,
        progress=progress,
        stop_after=stop_after,
        transport=transport,
    )
    return result


def _write_results(out: Path, cfg: RunConfig, setup: Any, method: Any, result: Any, *, wall: float) -> None:
    per_client = [
        {
            "client": cid,
            "seen": setup.clients[cid].seen,
            **result.evaluation[cid],
            "num_examples": int(result.evaluation[cid]["num_examples"]),
        }
        for cid in sorted(result.evaluation)
    ]
    results = {
        "name": cfg.name,
        "method": cfg.method.name,
        "dataset": setup.dataset.name,
        "seed": cfg.seed,
        "rounds_completed": result.state.round,
        "rounds": cfg.federation.rounds,
        "summary": summarize(result.evaluation, setup.clients),
        "method_summary": method.summary(result.state.server),
        "round_totals": round_totals(result.history),
        "per_client": per_client,
        "wall_seconds": wall,
    }
    write_json(out / "results.json", results)
    for name, text in method.artifacts(result.state.server).items():
        (out / name).write_text(text)
    fields = list(per_client[0]) if per_client else ["client", "seen", "num_examples"]
    with (out / "clients.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(per_client)
