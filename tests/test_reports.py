"""The report scripts on small run directories written in the format the runner writes: the figures are drawn
and the tables carry the numbers of the runs (averages over the last rounds, kappa^2 change)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_dir(path: Path, method: str, kappa: list[float] | None) -> Path:
    path.mkdir(parents=True)
    hist = []
    for r in range(1, 21):
        h = {"round": r, "loss": 0.7 - 0.01 * r, "base_grad_norm": 30.0 - r}
        if kappa and r in (1, 10, 20):
            h.update(kappa2=kappa[(1, 10, 20).index(r)], kappa2_eff=0.9 * kappa[(1, 10, 20).index(r)],
                     kappa2_adapted=1.0, kappa2_other=2.0, adapter_grad_sq_mean=3.0)
        if r % 10 == 0:
            h["seen/train_accuracy"] = 0.5 + 0.02 * r
        hist.append(h)
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(h) for h in hist) + "\n")
    (path / "results.json").write_text(json.dumps({
        "method": method, "rounds_completed": 20,
        "summary": {"seen/train_accuracy": 0.9, "seen/accuracy": 0.6, "seen/loss": 0.65},
        "per_client": [{"client": c, "train_accuracy": 0.8 + 0.05 * c} for c in range(3)]}))
    return path


def test_dpo_report_draws_the_figure_and_tabulates_the_runs(tmp_path):
    runs = [_run_dir(tmp_path / "p", "pfeddpo", [600.0, 400.0, 300.0]), _run_dir(tmp_path / "c", "dpo-central", None)]
    png, table = tmp_path / "f.png", tmp_path / "t.md"
    subprocess.run([sys.executable, str(ROOT / "scripts/dpo_report.py"), *map(str, runs), "--png", str(png),
                    "--table", str(table)], check=True, capture_output=True)
    text = table.read_text()
    assert png.stat().st_size > 10_000
    # rounds 11-20: loss 0.7 - 0.01 * 15.5 = 0.545, norm 30 - 15.5 = 14.5 (also the median of the last ten)
    assert "| pfeddpo | 20 | 0.900 | 0.600 | 0.650 | 0.545 | 14.5 | 14.5 |" in text
    assert "| pfeddpo | 10 | 400 | 360 | 1 | 2 | 3 |" in text
    assert "kappa^2 600 -> 300 (-50%)" in text


def test_dpo_report_names_unfinished_runs(tmp_path):
    (tmp_path / "r").mkdir()
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/dpo_report.py"), str(tmp_path / "r"), "--png",
                           str(tmp_path / "f.png")], capture_output=True, text=True)
    assert proc.returncode == 2 and "not finished runs" in proc.stderr and "Traceback" not in proc.stderr
