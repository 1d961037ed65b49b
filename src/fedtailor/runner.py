"""Run an experiment from a config into a run directory.

A run directory holds ``config.json`` (the resolved config), ``metrics.jsonl`` (one record per round),
``results.json`` (summary, per-client results, method facts such as the privacy ledger), ``clients.csv``,
``checkpoint.pt`` (to resume) and the report's plots.
"""

from __future__ import annotations

import csv
import json
import logging
import time
from pathlib import Path
from typing import Any

from fedtailor.config import RunConfig, dump_config
from fedtailor.experiment import build_method, build_setup
from fedtailor.fl.loop import run_federated, summarize

log = logging.getLogger(__name__)


def default_run_dir(cfg: RunConfig) -> Path:
    return Path(cfg.out_dir) / f"{cfg.name}-seed{cfg.seed}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    return value


def round_totals(history: list[dict[str, Any]]) -> dict[str, float]:
    """Run-level figures from the per-round records: sums of ``*_bytes`` (also in MB as ``*_MB``), means of the
    other numeric metrics (``*_mean``)."""
    keys = sorted({k for r in history for k, v in r.items() if isinstance(v, (int, float)) and k != "round"})
    out: dict[str, float] = {}
    for k in keys:
        vals = [float(r[k]) for r in history if isinstance(r.get(k), (int, float))]
        if k.endswith("_bytes"):
            out[k] = sum(vals)
            out[k[: -len("_bytes")] + "_MB"] = sum(vals) / 1e6
        else:
            out[k + "_mean"] = sum(vals) / len(vals)
    return out


def run_experiment(
    cfg: RunConfig, run_dir: str | Path | None = None, *, resume: bool = False, progress: bool = True,
    stop_after: int | None = None,
) -> Path:
    """Run ``cfg``; returns the run directory. With ``resume`` an interrupted run continues from its
    checkpoint and ends with the same results as an uninterrupted one."""
    out = Path(run_dir) if run_dir is not None else default_run_dir(cfg)
    ckpt = out / "checkpoint.pt"
    metrics_path = out / "metrics.jsonl"
    if out.exists() and any(out.iterdir()) and not resume:
        raise FileExistsError(
            f"run directory {out} already exists; pass --resume to continue it or --out to choose another."
        )
    if resume and (out / "config.json").exists():
        saved = json.loads((out / "config.json").read_text())
        if saved != json.loads(dump_config(cfg)):
            raise ValueError(f"{out} was run with a different config; resume with the same config and --set values.")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(dump_config(cfg))

    t0 = time.perf_counter()
    setup = build_setup(cfg)
    method = build_method(setup)
    # metrics.jsonl mirrors the loop's history; on resume it is rewritten from the checkpoint's history.
    metrics_path.write_text("")

    def on_round(record: dict[str, Any]) -> None:
        with metrics_path.open("a") as fh:
            fh.write(json.dumps(_jsonable(record)) + "\n")

    if ckpt.exists():
        from fedtailor.fl.loop import load_checkpoint

        for record in load_checkpoint(ckpt, setup.schedule).history:
            on_round(record)
    result = run_federated(
        method, setup.clients, setup.schedule, eval_every=cfg.federation.eval_every, checkpoint=ckpt,
        checkpoint_every=cfg.federation.checkpoint_every, on_round=on_round, progress=progress, stop_after=stop_after,
    )
    if result.state.round < cfg.federation.rounds:
        log.info("stopped after round %d of %d; continue with --resume", result.state.round, cfg.federation.rounds)
    per_client = [
        {"client": cid, "seen": setup.clients[cid].seen, **result.evaluation[cid],
         "num_examples": int(result.evaluation[cid]["num_examples"])}
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
        "method_summary": _jsonable(method.summary(result.state.server)),
        "round_totals": round_totals(result.history),
        "per_client": per_client,
        "wall_seconds": time.perf_counter() - t0,
    }
    (out / "results.json").write_text(json.dumps(_jsonable(results), indent=2))
    for name, text in method.artifacts(result.state.server).items():
        (out / name).write_text(text)
    with (out / "clients.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(per_client[0]))
        writer.writeheader()
        writer.writerows(per_client)
    return out
