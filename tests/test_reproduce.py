"""`fedtailor reproduce`: every point validated before any run, finished runs skipped, parallel jobs, tables
(mean +- std over seeds), plots, and an HTML report that headless Chromium renders with its tables and images."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess

import pytest
from conftest import TINY_TOML

import fedtailor.reproduce as rp


@pytest.fixture()
def registry(tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_TOML)
    exp = rp.Experiment("tiny", "FedAvg on digits at two learning rates", (
        rp.Block("lr", str(cfg), (("method.lr", ("0.05", "0.2")),)),), quick=("federation.rounds=2",), seeds=(1, 2))
    return {"tiny": exp}


def test_a_reproduction_runs_resumes_and_reports(tmp_path, registry, monkeypatch):
    monkeypatch.setattr(rp, "EXPERIMENTS", registry)
    out = tmp_path / "out"
    lines: list[str] = []
    runs = rp.plan(["tiny"], out=out, seeds=None, quick=True, registry=registry)
    assert len(runs) == 4 and not any(r.done for r in runs)
    assert rp.execute(runs, jobs=2, progress=lines.append) == []
    assert all(r.done for r in runs) and "4 done, 0 running, 0 waiting" in lines[-1] and "min left" in lines[-1]
    folders = rp.tables(runs, out=out, registry=registry)
    rows = list(csv.DictReader((folders[0] / "table.csv").open()))
    assert [r["point"] for r in rows] == ["lr=0.05", "lr=0.2"] and all(r["seeds"] == "2" for r in rows)
    accs = [100 * json.loads((out / "tiny" / "lr" / "lr=0.05" / f"seed{s}" / "results.json").read_text())
            ["summary"]["seen/accuracy"] for s in (1, 2)]
    assert float(rows[0]["seen/accuracy (mean)"]) == pytest.approx(sum(accs) / 2)
    report = rp.html_report(folders, out=out, registry=registry)
    assert (folders[0] / "table.md").exists() and (folders[0] / "accuracy.png").exists()
    # a second call skips every finished run
    assert rp.execute(runs, jobs=2, progress=lines.append,
                      command=lambda run: pytest.fail("finished runs must be skipped")) == []
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium not installed (scripts/install.sh --test installs it)")
    dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                          "--dump-dom", report.as_uri()], capture_output=True, text=True, timeout=120).stdout
    assert dom.count("<tr>") >= 3 and "lr=0.2" in dom  # the table rendered with its rows
    assert 'data-images-loaded="1"' in dom  # and its plot decoded


def test_a_bad_point_fails_before_any_run(tmp_path, registry):
    bad = rp.Experiment("bad", "x", (rp.Block("b", registry["tiny"].blocks[0].config, (("method.lr", ("0.1", "-1")),)),))
    with pytest.raises(ValueError, match="bad/b/lr=-1 seed 41: invalid config"):
        rp.plan(["bad"], out=tmp_path, seeds=None, quick=False, registry={"bad": bad})
    with pytest.raises(ValueError, match="unknown experiment"):
        rp.plan(["nope"], out=tmp_path, seeds=None, quick=False, registry={"bad": bad})


def test_every_shipped_experiment_plans(tmp_path):
    for name in rp.EXPERIMENTS:
        assert rp.plan([name], out=tmp_path, seeds=[41], quick=True)
