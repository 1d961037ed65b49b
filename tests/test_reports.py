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
            h.update(
                kappa2=kappa[(1, 10, 20).index(r)],
                kappa2_eff=0.9 * kappa[(1, 10, 20).index(r)],
                kappa2_adapted=1.0,
                kappa2_other=2.0,
                adapter_grad_sq_mean=3.0,
            )
        if r % 10 == 0:
            h["seen/train_accuracy"] = 0.5 + 0.02 * r
        hist.append(h)
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(h) for h in hist) + "\n")
    (path / "results.json").write_text(
        json.dumps(
            {
                "method": method,
                "rounds_completed": 20,
                "summary": {"seen/train_accuracy": 0.9, "seen/accuracy": 0.6, "seen/loss": 0.65},
                "per_client": [{"client": c, "train_accuracy": 0.8 + 0.05 * c} for c in range(3)],
            }
        )
    )
    return path


def test_dpo_report_draws_the_figure_and_tabulates_the_runs(tmp_path):
    runs = [_run_dir(tmp_path / "p", "pfeddpo", [600.0, 400.0, 300.0]), _run_dir(tmp_path / "c", "dpo-central", None)]
    png, table = tmp_path / "f.png", tmp_path / "t.md"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/dpo_report.py"),
            *map(str, runs),
            "--png",
            str(png),
            "--table",
            str(table),
        ],
        check=True,
        capture_output=True,
    )
    text = table.read_text()
    assert png.stat().st_size > 10_000
    # rounds 11-20: loss 0.7 - 0.01 * 15.5 = 0.545, norm 30 - 15.5 = 14.5 (also the median of the last ten)
    assert "| pfeddpo | 20 | 0.900 | 0.600 | 0.650 | 0.545 | 14.5 | 14.5 |" in text
    assert "| pfeddpo | 10 | 400 | 360 | 1 | 2 | 3 |" in text
    assert "kappa^2 600 -> 300 (-50%)" in text


def test_dpo_report_names_unfinished_runs(tmp_path):
    (tmp_path / "r").mkdir()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/dpo_report.py"), str(tmp_path / "r"), "--png", str(tmp_path / "f.png")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "not finished runs" in proc.stderr and "Traceback" not in proc.stderr


def _fedlag_run(path: Path, acc: float, personal: list[str] | None = None) -> None:
    path.mkdir(parents=True)
    summary = {}
    if personal is not None:
        summary = {
            "fedlag_candidates": ["a.weight", "a.bias", "b.weight"],
            "fedlag_personal": personal,
            "fedlag_conflicts_per_round": [[3, 1, 0], [2, 2, 1]],
        }
    (path / "results.json").write_text(
        json.dumps({"rounds_completed": 4, "rounds": 4, "method_summary": summary, "summary": {"seen/accuracy": acc}})
    )


def test_fedlag_report_reads_reproduce_folders_pairs_seeds_and_skips_what_was_not_run(tmp_path):
    exp = tmp_path / "fedlag-x"
    for seed, (off, on) in {41: (0.80, 0.85), 42: (0.82, 0.86)}.items():
        _fedlag_run(exp / "main-alpha01" / "name=fedavg_top_k=0" / f"seed{seed}", off)
        _fedlag_run(exp / "main-alpha01" / "name=fedavg_top_k=2" / f"seed{seed}", on, ["a.bias", "b.weight"])
        _fedlag_run(exp / "fixed-alpha01" / "choice=last" / f"seed{seed}", 0.9, ["b.weight", "b.bias"])
        _fedlag_run(
            exp / "unit-alpha01" / "unit=module" / f"seed{seed}",
            0.88,
            ["b.weight", "b.bias"] if seed == 41 else ["a.weight", "a.bias"],
        )
    _fedlag_run(exp / "main-alpha01" / "name=ditto_top_k=0" / "seed41", 0.7)  # its top_k = 2 run not finished
    (exp / "main-alpha01" / "name=ditto_top_k=2" / "seed41").mkdir(parents=True)
    png, table = tmp_path / "gc.png", tmp_path / "t.md"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/fedlag_report.py"), str(exp), "--table", str(table), "--png", str(png)],
        check=True,
        capture_output=True,
    )
    text = table.read_text()
    assert "### fedlag-x alpha01" in text
    # means 81 / 85.5, std (ddof 1) 1.41 / 0.71; paired differences 5 and 4: 4.50 +- 0.71
    assert "| fedavg | 81.00 +- 1.41 | 85.50 +- 0.71 | 4.50 +- 0.71 | 2 | a.bias, b.weight |" in text
    assert "| ditto | 70.00 | - | - | 0 | - |" in text
    assert "fedper" not in text and "Middle-K" not in text
    assert "| fixed Last-K | 90.00 +- 0.00 | 2 | b.weight, b.bias (2) |" in text
    assert (
        "| conflict score over modules (weight + bias), top_k = 1 | 88.00 +- 0.00 | 2 | b.weight, b.bias (1); "
        "a.weight, a.bias (1) |" in text
    )
    assert png.stat().st_size > 5_000


def test_fedlag_report_names_a_folder_it_cannot_read(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/fedlag_report.py"), str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode == 1 and "neither main/ nor main-<tag>/" in proc.stderr and "Traceback" not in proc.stderr
