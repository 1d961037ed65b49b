"""Run an experiment from a config into a run directory (:mod:`fedtailor.rundir`: what it holds and how its
files are written): the directory checked before anything loads, the loop run with every round's record
appended, the results written at the end, and a resume that continues from the checkpoint."""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedtailor import rundir
from fedtailor.config import RunConfig, dump_config
from fedtailor.experiment import build_method, build_setup
from fedtailor.fl.checkpoint import load_checkpoint
from fedtailor.fl.loop import GROUPS, RunInterrupted, Transport, chosen_rounds, run_federated, summarize

log = logging.getLogger(__name__)


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
    saved_path = out / rundir.CONFIG
    if not saved_path.exists():
        raise ValueError(
            f"--resume: {out} has no {rundir.CONFIG}, so it is not a run directory (or not one of ours); "
            "start the run in a new directory with --out."
        )
    try:
        saved = rundir.read_config(out)
    except (OSError, ValueError) as err:
        raise ValueError(f"--resume: {saved_path} is unreadable ({err}); start the run in a new directory.") from None
    diff = rundir.config_differences(saved, json.loads(cfg_text), defaults=defaults)
    if diff:
        raise ValueError(
            f"{out} was run with a different config: {'; '.join(diff[:8])}"
            f"{' ...' if len(diff) > 8 else ''}. Resume with the same config and --set values, or "
            "use --out for a new run."
        )
    return False


def round_totals(history: list[dict[str, Any]]) -> dict[str, float]:
    """Run-level figures from the per-round records: sums of ``*_bytes`` (also in MB as ``*_MB``) and of
    ``*_coefficients``, of the rejected and abstained replies (``*_total``), means of the other numeric metrics
    (``*_mean``); with both ``uplink_bytes`` and ``uplink_coefficients`` (a DP wrapper's releases: the values they
    carried), ``uplink_bits_per_coefficient``, what the uplink cost a released value. The rounds' evaluation
    summaries (``seen/...``) are not averaged: the results carry the final, best and chosen round's."""
    evaluation = tuple(f"{g}/" for g in GROUPS)
    keys = sorted(
        {
            k
            for r in history
            for k, v in r.items()
            if isinstance(v, (int, float)) and k != "round" and not k.startswith(evaluation)
        }
    )
    out: dict[str, float] = {}
    for k in keys:
        vals = [float(r[k]) for r in history if isinstance(r.get(k), (int, float))]
        if k.endswith("_bytes"):
            out[k] = sum(vals)
            out[k[: -len("_bytes")] + "_MB"] = sum(vals) / 1e6
        elif k.endswith("_coefficients"):
            out[k] = sum(vals)
        elif k in ("rejected", "abstained"):
            out[k + "_total"] = sum(vals)
        else:
            out[k + "_mean"] = sum(vals) / len(vals)
    if out.get("uplink_coefficients") and "uplink_bytes" in out:
        out["uplink_bits_per_coefficient"] = 8.0 * out["uplink_bytes"] / out["uplink_coefficients"]
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
    out = Path(run_dir) if run_dir is not None else rundir.default_run_dir(cfg)
    ckpt = out / rundir.CHECKPOINT
    cfg_text = dump_config(cfg)
    create = _check_out(out, cfg_text, resume=resume, defaults=rundir.config_defaults(cfg), given=run_dir is not None)

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
    rundir.write_config(out, cfg_text)
    # metrics.jsonl mirrors the loop's history: rewritten from the checkpoint's (atomically), then appended
    rundir.write_metrics(out, history)

    def written(record: dict[str, Any]) -> None:  # the driver has checked it (fl.records.check_diverged)
        rundir.append_metrics(out, record)
        if on_round is not None:
            on_round(record)

    result = run_federated(
        method,
        setup.clients,
        setup.schedule,
        eval_every=cfg.federation.eval_every,
        checkpoint=out / rundir.CHECKPOINT,
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
            **{k: int(v) if k.endswith("num_examples") else v for k, v in result.evaluation[cid].items()},
        }
        for cid in sorted(result.evaluation)
    ]
    results: rundir.Results = {
        "name": cfg.name,
        "method": cfg.method.name,
        "dataset": setup.dataset.name,
        "seed": cfg.seed,
        "rounds_completed": result.state.round,
        "rounds": cfg.federation.rounds,
        "summary": {**summarize(result.evaluation, setup.clients), **chosen_rounds(result.history)},
        "method_summary": method.summary(result.state.server),
        "round_totals": round_totals(result.history),
        "per_client": per_client,
        "wall_seconds": wall,
    }
    rundir.write_results(out, results)
    rundir.write_artifacts(out, method.artifacts(result.state.server))
