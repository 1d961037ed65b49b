"""`fedtailor reproduce`: every point validated before any run, finished runs skipped, parallel jobs, tables
(mean +- std over seeds), plots, and an HTML report that headless Chromium renders with its tables and images."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import fedtailor.reproduce as rp
from conftest import TINY_TOML
from fedtailor.config import dump_config
from fedtailor.methods.compact.catalogue import COMPACT_VARIANTS
from fedtailor.reproduce.report import _reference_of, _trend_plot
from fedtailor.rundir import read_metrics, slug


@pytest.fixture()
def registry(tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_TOML)
    exp = rp.Experiment(
        "tiny",
        "FedAvg on digits at two learning rates",
        (rp.Block("lr", str(cfg), (("method.lr", ("0.05", "0.2")),)),),
        quick=("federation.rounds=2",),
        seeds=(1, 2),
        x_axis="lr",
        reference=(("method.lr", "0.05"),),
        claims=(rp.Claim((("method.lr", "0.2"),), "seen/accuracy", "above", "a larger step learns more"),),
    )
    return {"tiny": exp}


def test_a_reproduction_runs_resumes_and_reports(tmp_path, registry, monkeypatch):
    monkeypatch.setattr(rp, "EXPERIMENTS", registry)
    out = tmp_path / "out"
    lines: list[str] = []
    assert len(rp.plan(["tiny"], out=out, seeds=None, quick=True, registry=registry)) == 2  # --quick: first seed
    runs = rp.plan(["tiny"], out=out, seeds=[1, 2], quick=True, registry=registry)
    assert len(runs) == 4 and not any(r.done for r in runs)
    assert rp.execute(runs, jobs=2, progress=lines.append) == []
    assert all(r.done for r in runs) and "4 done, 0 running, 0 waiting" in lines[-1] and "min left" in lines[-1]
    folders = rp.tables(runs, out=out, registry=registry)
    rows = list(csv.DictReader((folders[0] / "table.csv").open()))
    assert [r["point"] for r in rows] == ["lr=0.05", "lr=0.2"] and all(r["seeds"] == "2" for r in rows)
    accs = [
        100
        * json.loads((out / "tiny" / "lr" / "lr=0.05" / f"seed{s}" / "results.json").read_text())["summary"][
            "seen/accuracy"
        ]
        for s in (1, 2)
    ]
    assert float(rows[0]["seen/accuracy (mean)"]) == pytest.approx(sum(accs) / 2)
    # beside the final mean: each run's 10th percentile over clients and its best round, mean +- std over seeds
    header = (folders[0] / "table.md").read_text().splitlines()[4]
    assert "| seen/accuracy | seen/accuracy/p10 | best/seen/accuracy |" in header
    p10 = [
        100
        * json.loads((out / "tiny" / "lr" / "lr=0.05" / f"seed{s}" / "results.json").read_text())["summary"][
            "seen/accuracy/p10"
        ]
        for s in (1, 2)
    ]
    assert rows[0]["seen/accuracy/p10"].startswith(f"{sum(p10) / 2:.2f} +- ")
    # the paired difference from the reference point, by seed and by (seed, client), from the run files
    (paired,) = [r for r in csv.DictReader((folders[0] / "paired.csv").open()) if r["metric"] == "seen/accuracy"]
    runs_of = {
        lr: [out / "tiny" / "lr" / f"lr={lr}" / f"seed{s}" / "results.json" for s in (1, 2)] for lr in ("0.05", "0.2")
    }
    res = {lr: [json.loads(f.read_text()) for f in files] for lr, files in runs_of.items()}
    per_seed = [
        100 * (b["summary"]["seen/accuracy"] - a["summary"]["seen/accuracy"]) for a, b in zip(res["0.05"], res["0.2"])
    ]
    assert paired["point"] == "lr=0.2" and paired["reference"] == "lr/lr=0.05" and paired["seeds"] == "2"
    assert float(paired["mean"]) == pytest.approx(sum(per_seed) / 2, abs=0.006)
    assert paired["per seed"] == " ".join(f"{d:+.2f}" for d in per_seed)
    lo, hi = (float(x) for x in paired["seeds ci95"].strip("[]").split(","))
    expected = "reproduced" if lo > 0 else "not reproduced" if hi < 0 else "not settled (interval spans the claim)"
    assert paired["paper"] == "a larger step learns more" and paired["verdict"] == expected
    client_diffs = [
        100 * (cb["accuracy"] - ca["accuracy"])
        for a, b in zip(res["0.05"], res["0.2"])
        for ca, cb in zip(a["per_client"], b["per_client"])
        if ca["seen"]
    ]
    lo, hi = (float(x) for x in paired["clients ci95"].strip("[]").split(","))
    assert int(paired["client pairs"]) == len(client_diffs) and lo <= sum(client_diffs) / len(client_diffs) <= hi
    report = rp.html_report(folders, out=out, registry=registry)
    assert all((folders[0] / f).exists() for f in ("table.md", "accuracy.png", "trend.png"))
    # a second call skips every finished run
    assert (
        rp.execute(
            runs, jobs=2, progress=lines.append, command=lambda run: pytest.fail("finished runs must be skipped")
        )
        == []
    )
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium not installed (scripts/install.sh --test installs it)")
    dom = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=5000",
            "--dump-dom",
            report.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert dom.count("<tr>") >= 3 and "lr=0.2" in dom  # the table rendered with its rows
    assert 'data-images-loaded="2"' in dom  # and its plots decoded


def test_a_bad_point_fails_before_any_run(tmp_path, registry):
    bad = rp.Experiment(
        "bad", "x", (rp.Block("b", registry["tiny"].blocks[0].config, (("method.lr", ("0.1", "-1")),)),)
    )
    with pytest.raises(ValueError, match="bad/b/lr=-1 seed 41: invalid config"):
        rp.plan(["bad"], out=tmp_path, seeds=None, quick=False, registry={"bad": bad})
    with pytest.raises(ValueError, match="unknown experiment"):
        rp.plan(["nope"], out=tmp_path, seeds=None, quick=False, registry={"bad": bad})


def test_shipped_experiments_plan_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = rp.plan(["compact-comm-mnist"], out=tmp_path, seeds=[41], quick=True)
    assert all(Path(r.config).is_absolute() and Path(r.config).exists() for r in runs)


def test_blocks_of_an_experiment_can_be_run_alone(tmp_path):
    runs = rp.plan(["compact-table1-mnist/eps16,eps4"], out=tmp_path, seeds=None, quick=False)
    assert {r.block for r in runs} == {"eps16", "eps4"} and len(runs) == 2 * len(COMPACT_VARIANTS) * 3
    full = rp.plan(["compact-table1-mnist"], out=tmp_path, seeds=None, quick=False)
    assert {r.out for r in runs} <= {r.out for r in full}  # the same folders: the rest can be added later
    with pytest.raises(ValueError, match="has the blocks eps4, eps8, eps16, eps32"):
        rp.plan(["compact-table1-mnist/eps17"], out=tmp_path, seeds=None, quick=False)


def test_a_run_that_needs_another_waits_for_it(tmp_path, registry):
    """Replay's shape: a block reads the run directory of another block's run of the same seed; it starts only
    once that run has finished, and is not run at all when that run fails."""
    cfg = registry["tiny"].blocks[0].config
    exp = rp.Experiment(
        "dep",
        "x",
        (
            rp.Block("late", cfg, sets=('out_dir="{needs}"', "method.lr=0.05"), needs="early/lr=0.1"),
            rp.Block("early", cfg, (("method.lr", ("0.1",)),)),
        ),
        seeds=(1, 2),
    )
    runs = rp.plan(["dep"], out=tmp_path, seeds=None, quick=False, registry={"dep": exp})
    late = [r for r in runs if r.block == "late"]
    assert [str(r.after) for r in late] == [str(tmp_path / "dep/early/lr=0.1" / f"seed{s}") for s in (1, 2)]
    assert f'out_dir="{late[0].after}"' in late[0].sets
    log = tmp_path / "order.txt"

    def fake(run):  # logs its start, writes a finished results.json, logs its end (seed 2's early fails)
        fail = run.block == "early" and run.seed == 2
        code = (
            f"import json, pathlib, time; open({str(log)!r}, 'a').write('start {run.out}\\n'); time.sleep(0.3); "
            f"p = pathlib.Path({str(run.out)!r}); p.mkdir(parents=True, exist_ok=True); "
            + (
                "raise SystemExit(1)"
                if fail
                else "(p / 'results.json').write_text(json.dumps({'rounds': 1, 'rounds_completed': 1})); "
                f"(p / 'config.json').write_text({dump_config(run.cfg)!r}); "
                f"open({str(log)!r}, 'a').write('end {run.out}\\n')"
            )
        )
        return [sys.executable, "-c", code]

    lines: list[str] = []
    failed = rp.execute(runs, jobs=2, progress=lines.append, command=fake)
    order = log.read_text().splitlines()
    assert order.index(f"start {late[0].out}") > order.index(f"end {late[0].after}")  # waited, though planned first
    assert f"start {late[1].out}" not in order  # its prerequisite failed: not run
    assert {(r.block, r.seed) for r in failed} == {("early", 2), ("late", 2)}
    assert any("did not finish" in ln for ln in lines)
    with pytest.raises(ValueError, match="include its block too"):
        rp.plan(["dep/late"], out=tmp_path / "fresh", seeds=None, quick=False, registry={"dep": exp})
    assert rp.plan(["dep/late"], out=tmp_path, seeds=[1], quick=False, registry={"dep": exp})  # early seed 1 done


def test_runs_start_seed_by_seed_within_each_experiment(tmp_path, registry):
    """Every point of an experiment's first seed starts before any of its second seed, and experiments keep their
    order: a reproduction stopped part-way leaves whole comparisons over fewer seeds."""
    cfg = registry["tiny"].blocks[0].config
    lrs = (("method.lr", ("0.1", "0.2")),)

    def exp(name: str, rounds: int) -> rp.Experiment:
        own = f"federation.rounds={rounds}"  # a config of its own (not linked to the other experiment's runs)
        blocks = (rp.Block("a", cfg, lrs, sets=(own,)), rp.Block("b", cfg, sets=(own, "method.lr=0.3")))
        return rp.Experiment(name, "x", blocks, seeds=(1, 2))

    exps = {"e1": exp("e1", 2), "e2": exp("e2", 3)}
    runs = rp.plan(["e1", "e2"], out=tmp_path, seeds=None, quick=False, registry=exps)
    assert [(r.experiment, r.seed) for r in runs][:3] == [("e1", 1), ("e1", 2), ("e1", 1)]  # planned point by point
    started = []

    def fake(run):
        started.append((run.experiment, run.block, run.seed))
        return [sys.executable, "-c", "raise SystemExit(1)"]

    rp.execute(runs, jobs=1, progress=lambda _: None, command=fake)
    assert [(e, s) for e, _, s in started] == [(e, s) for e in ("e1", "e2") for s in (1, 2) for _ in range(3)]
    assert started[:3] == [("e1", "a", 1), ("e1", "a", 1), ("e1", "b", 1)]  # within a seed, the planned order


def test_the_same_resolved_config_runs_once_and_is_linked(tmp_path, registry):
    """Two points that resolve to one config (the rank ablation's rank 8 is the participation ablation's S = 5;
    Factorized+ctx is Ours-DG) run once: the second is a link to the first, made when the first finishes, and it
    is in the tables like any run. A run directory already there under the second name is kept as its own."""
    cfg = registry["tiny"].blocks[0].config
    exps = {
        "a": rp.Experiment("a", "x", (rp.Block("lr", cfg, (("method.lr", ("0.1", "0.2")),)),), seeds=(1,)),
        "b": rp.Experiment("b", "x", (rp.Block("fixed", cfg, sets=("method.lr=0.1", 'name="other"')),), seeds=(1,)),
    }
    runs = rp.plan(["a", "b"], out=tmp_path, seeds=None, quick=False, registry=exps)
    alias = runs[-1]
    assert alias.same_as == alias.after == tmp_path / "a/lr/lr=0.1/seed1" and runs[0].same_as is None
    started = []

    def fake(run):
        started.append(run.out)
        return [
            sys.executable,
            "-c",
            f"import json, pathlib; p = pathlib.Path({str(run.out)!r}); "
            "p.mkdir(parents=True); (p / 'results.json').write_text(json.dumps({'rounds': 1, 'name': 'r', "
            "'method': 'fedavg', 'dataset': 'digits', 'seed': 1, 'rounds_completed': 1, "
            "'summary': {'seen/accuracy': 0.5}, 'per_client': []})); "
            f"(p / 'config.json').write_text({dump_config(run.cfg)!r})",
        ]

    lines: list[str] = []
    assert rp.execute(runs, jobs=2, progress=lines.append, command=fake) == []
    assert alias.out not in started and len(started) == 2 and "3 done, 0 running, 0 waiting" in lines[-1]
    assert alias.out.is_symlink() and alias.done and (alias.out / "results.json").exists()
    assert rp.tables([alias], out=tmp_path / "t", registry=exps)
    again = rp.plan(["a", "b"], out=tmp_path, seeds=None, quick=False, registry=exps)
    assert all(r.done for r in again) and again[-1].same_as is not None  # a link stays a link
    other = tmp_path / "fresh"
    (other / "b/fixed/base/seed1").mkdir(parents=True)  # run before this rule existed: its own run
    assert rp.plan(["a", "b"], out=other, seeds=None, quick=False, registry=exps)[-1].same_as is None


@pytest.mark.slow
def test_quick_reproduction_of_shipped_experiments(tmp_path):
    """What CI exercises of ``--quick``: the communication table (compact adaptation with LRSUQ and PPR on MNIST) and
    FedLAG's fixed-K block, through the CLI, to the report."""
    out = tmp_path / "repro"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedtailor",
            "reproduce",
            "compact-comm-mnist",
            "fedlag-mnist/fixed-alpha10",
            "--quick",
            "--jobs",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "7 done, 0 running, 0 waiting" in proc.stderr
    comm = list(csv.DictReader((out / "compact-comm-mnist" / "table.csv").open()))
    assert [r["point"] for r in comm] == ["variant=ours-dg", "variant=dg-q12", "variant=ours-lrsuq", "variant=ours-ppr"]
    bits = {r["point"]: float(r["bits_per_coefficient_mean (mean)"]) for r in comm}
    assert bits["variant=ours-dg"] > 31 and bits["variant=dg-q12"] == pytest.approx(12, abs=0.5)
    # --quick's 10 rounds calibrate a small sigma: a high signal-to-noise release, where PPR's padded rate (2.57)
    # is above LRSUQ's (1.97); at the full scale's eps 16 it is below (docs/codecs.md)
    assert bits["variant=ours-lrsuq"] < 2 and bits["variant=ours-ppr"] < 3
    lag = list(csv.DictReader((out / "fedlag-mnist" / "table.csv").open()))
    assert len(lag) == 3 and all(float(r["seen/accuracy (mean)"]) > 30 for r in lag)  # 10 classes: chance is 10
    assert "compact-comm-mnist" in (out / "report.html").read_text()


def test_every_shipped_experiment_plans(tmp_path):
    from fedtailor.config import load_config
    from fedtailor.data.setup import partition_of
    from fedtailor.lm.preference import PairSplit, hold_out_validation

    every = rp.plan(["all", "compact-comm-mnist"], out=tmp_path, seeds=None, quick=True)  # each run once
    in_all = [e for e in rp.EXPERIMENTS.values() if not e.outside_all]  # CIFAR-10 needs files users fetch
    assert len(every) == sum(len(b.points()) for e in in_all for b in e.blocks)  # one seed each
    assert {"compact-table1-cifar10"} == {e.name for e in rp.EXPERIMENTS.values() if e.outside_all}

    for name, exp in rp.EXPERIMENTS.items():
        for claim in exp.claims:  # each claim names a metric of the table and points the experiment has
            points = [p for b in exp.blocks if claim.block in (None, b.name) for p in b.points()]
            assert claim.metric in exp.metrics and any(set(claim.point) <= set(p) for p in points), (name, claim)
        if exp.x_axis not in (None, "block"):  # trend.png needs the axis in every point
            assert all(any(k.split(".")[-1] == exp.x_axis for k, _ in b.grid) for b in exp.blocks), name
        runs = rp.plan([name], out=tmp_path, seeds=[41], quick=True)
        assert runs
        for run in runs:  # the reduced data still gives every client what an equal-split scheme needs
            d = load_config(run.config, run.sets).data
            if d.scheme == "dirichlet-equal" and d.limit:
                assert d.limit // d.num_clients >= d.context_size / (1 - d.eval_fraction), run.out
        for run in rp.plan_tuning([name], out=tmp_path, quick=True):  # the validation split fits the quick data
            cfg = run.cfg
            assert cfg.data.validation > 0, run.out
            if cfg.data.dataset.startswith(("hh-rlhf", "shp")):
                train = [np.arange(cfg.data.pairs_per_client)] * cfg.data.num_clients
                hold_out_validation(PairSplit(train=train, heldout=train), cfg.data.validation, seed=41)
            elif cfg.data.scheme == "dirichlet-equal" and cfg.data.limit:  # outside each client's context set
                partition_of(cfg, np.arange(cfg.data.limit) % 10)  # raises where it does not fit


def test_trend_plot_reads_grid_keys_that_contain_the_slug_separator(tmp_path):
    """Slugs join ``key=value`` pairs with ``_``, so ``coef_dim=4096_top_k=2`` cannot be split back; the plot
    takes each row's grid values as they were planned (this once failed the whole ``all --quick`` report)."""
    exp = rp.Experiment("k", "x", (), x_axis="coef_dim", metrics=("seen/accuracy",))
    points = [{"coef_dim": str(d), "top_k": str(t)} for d in (4096, 8192) for t in (0, 2)]
    rows = [
        {
            "block": "b",
            "point": slug(tuple(p.items())),
            "seeds": 1,
            "seen/accuracy (mean)": 50.0 + i,
            "seen/accuracy (std)": 0.0,
        }
        for i, p in enumerate(points)
    ]
    assert rows[0]["point"] == "coef_dim=4096_top_k=0"
    _trend_plot(rows, points, exp, tmp_path / "trend.png")
    assert (tmp_path / "trend.png").stat().st_size > 1000


def test_a_finished_run_counts_only_for_the_config_it_ran(tmp_path):
    """A finished run is done for a planned point only when its resolved config is the planned one: a run with
    another --set (or a --quick one) in the same folder is not reused, and running the point there refuses,
    naming the key that differs."""
    from fedtailor.config import load_config
    from fedtailor.rundir import finished
    from fedtailor.runner import run_experiment
    from fedtailor.sweep import run_sweep

    cfg_path = tmp_path / "tiny.toml"
    cfg_path.write_text(TINY_TOML)
    out = tmp_path / "sweep"
    run_sweep(str(cfg_path), seeds=[1], grid=[], out=out, progress=False)
    run_dir = next(out.glob("*/seed1"))
    assert finished(run_dir, load_config(str(cfg_path), ["seed=1"]))
    assert not finished(run_dir, load_config(str(cfg_path), ["seed=1", "method.lr=0.2"]))
    assert finished(run_dir, load_config(str(cfg_path), ["seed=1", 'name="other"']))  # the name is the folder's
    with pytest.raises(ValueError, match=r"method.lr \(was 0.1, now 0.2\)"):
        run_sweep(str(cfg_path), seeds=[1], grid=[], overrides=["method.lr=0.2"], out=out, progress=False)
    with pytest.raises(ValueError, match="different config"):
        run_experiment(
            load_config(str(cfg_path), ["seed=1", "federation.rounds=2"]), run_dir, resume=True, progress=False
        )


def test_a_point_whose_folder_holds_a_run_of_another_config_is_named_before_anything_runs(tmp_path, tiny):
    """A point whose config changed since its folder was run (a new tuning choice) is not started, to fail in its
    log: the reproduction says at once which key changed and what to do; the other points run."""
    grid = (("method.lr", ("0.05", "0.2")),)
    before = rp.Experiment("e", "x", (rp.Block("b", tiny[0], grid),), quick=("federation.rounds=1",), seeds=(1,))
    assert rp.execute(rp.plan(["e"], out=tmp_path, seeds=None, quick=True, registry={"e": before})) == []
    changed = rp.Block("b", tiny[0], grid, ("federation.clients_per_round=2",))
    after = rp.Experiment("e", "x", (changed,), quick=("federation.rounds=1",), seeds=(1,))
    runs = rp.plan(["e"], out=tmp_path, seeds=None, quick=True, registry={"e": after})
    (tmp_path / "e" / "b" / "lr=0.2" / "seed1").rename(tmp_path / "aside")  # moved aside: this one runs
    lines: list[str] = []
    started: list[str] = []
    command = lambda run: started.append(run.label) or [sys.executable, "-c", "pass"]
    failed = rp.execute(runs, progress=lines.append, command=command)
    assert [r.label for r in failed] == ["e/b/lr=0.05 seed 1"] and started == ["e/b/lr=0.2 seed 1"]
    (line,) = [x for x in lines if "not run" in x]
    assert "e/b/lr=0.05 seed 1 not run" in line and "clients_per_round (was 3, now 2)" in line
    assert line.endswith("move it aside or delete it to run this one")


def test_a_repeated_seed_or_grid_value_is_refused(tmp_path, registry):
    """A seed or grid value given twice would count twice in the mean: refused in one line, before any run."""
    with pytest.raises(ValueError, match="--seeds gives seed 1 more than once"):
        rp.plan(["tiny"], out=tmp_path, seeds=[1, 2, 1], quick=False, registry=registry)
    cfg = registry["tiny"].blocks[0].config
    twice = rp.Experiment("twice", "x", (rp.Block("lr", cfg, (("method.lr", ("0.1", "0.2", "0.1")),)),))
    with pytest.raises(ValueError, match="twice/lr: the grid of method.lr gives value 0.1 more than once"):
        rp.plan(["twice"], out=tmp_path, seeds=None, quick=False, registry={"twice": twice})


def test_a_reproduction_of_one_block_adds_its_rows_to_the_tables_of_the_others(tmp_path, tiny):
    """``NAME/BLOCK`` runs add to the table and paired table the earlier blocks wrote in the same folder, in the
    experiment's block order, and a block run again replaces its own rows only."""
    grid = (("method.lr", ("0.05", "0.2")),)
    blocks = (rp.Block("a", tiny[0], grid), rp.Block("b", tiny[0], grid, ("federation.clients_per_round=2",)))
    exp = rp.Experiment(
        "two", "two blocks", blocks, quick=("federation.rounds=2",), seeds=(1,), reference=(("method.lr", "0.05"),)
    )
    registry, out = {"two": exp}, tmp_path / "out"

    def tables(spec: str) -> tuple[list[dict[str, str]], list[tuple[str, str]]]:
        runs = rp.plan([spec], out=out, seeds=None, quick=True, registry=registry)
        assert rp.execute(runs) == []
        folder = rp.tables(runs, out=out, registry=registry)[0]
        paired = [(r["block"], r["point"]) for r in csv.DictReader((folder / "paired.csv").open())]
        return list(csv.DictReader((folder / "table.csv").open())), paired

    first_b, _ = tables("two/b")
    assert [(r["block"], r["point"]) for r in first_b] == [("b", "lr=0.05"), ("b", "lr=0.2")]
    with (out / "two" / "table.csv").open("a") as f:  # a row of a block the experiment no longer has
        f.write("gone," + ",".join(["x"] * (len(first_b[0]) - 1)) + "\n")
    rows, paired = tables("two/a")
    assert [r["block"] for r in rows] == ["a", "a", "b", "b"] and rows[2:] == first_b  # b's rows as they were
    assert sorted({p for p in paired if p[1] == "lr=0.2"}) == [("a", "lr=0.2"), ("b", "lr=0.2")]
    rows, _ = tables("two/a")  # again: a's rows replaced, not added twice
    assert [r["block"] for r in rows] == ["a", "a", "b", "b"]


def test_a_table_counts_over_seeds_the_layers_fedlag_made_personal(tmp_path, tiny):
    """A metric each run reports as a list of names (``fedlag_personal``) becomes a cell counting, for each name,
    the seeds that chose it."""
    block = rp.Block("lag", tiny[0], sets=("method.fedlag.top_k=1", "method.fedlag.warmup=1"))
    metrics = ("seen/accuracy", "fedlag_personal")
    exp = rp.Experiment("lag", "FedLAG", (block,), quick=("federation.rounds=2",), metrics=metrics)
    runs = rp.plan(["lag"], out=tmp_path, seeds=[1, 2, 3], quick=True, registry={"lag": exp})
    assert rp.execute(runs) == []
    chosen = [json.loads((r.out / "results.json").read_text())["method_summary"]["fedlag_personal"] for r in runs]
    assert all(len(c) == 1 for c in chosen)
    folder = rp.tables(runs, out=tmp_path, registry={"lag": exp})[0]
    cell = next(csv.DictReader((folder / "table.csv").open()))["fedlag_personal"]
    counts = {name: f"{sum(name in c for c in chosen)}/3" for c in chosen for name in c}
    assert cell == ", ".join(f"{n} {k}" for n, k in sorted(counts.items()))


def test_the_round_table_gives_each_per_round_metric_over_seeds_at_the_rounds_logged(tmp_path, tiny):
    """``round_metrics`` (pFedDPO's kappa^2 every 10 rounds): rounds.csv holds, per point and round, the mean +- std
    over the seeds that logged it; a metric logged at some rounds only (the evaluation every 2 of 3 rounds) is empty
    elsewhere."""
    block = rp.Block("b", tiny[0], (("method.lr", ("0.2",)),))
    exp = rp.Experiment(
        "r", "rounds", (block,), quick=("federation.rounds=3",), seeds=(1, 2), round_metrics=("loss", "seen/accuracy")
    )
    runs = rp.plan(["r"], out=tmp_path, seeds=[1, 2], quick=True, registry={"r": exp})
    assert rp.execute(runs) == []
    log = runs[1].out / "metrics.jsonl"  # a value that is not finite (kappa2_rel of a zero mean gradient) is left out
    records = [json.loads(line) for line in log.read_text().splitlines()]
    records[0]["loss"] = float("nan")
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    folder = rp.tables(runs, out=tmp_path, registry={"r": exp})[0]
    rows = list(csv.DictReader((folder / "rounds.csv").open()))
    assert [(r["point"], r["round"]) for r in rows] == [("lr=0.2", str(k)) for k in (1, 2, 3)]
    for row in rows:
        records = [next(m for m in read_metrics(r.out) if m["round"] == int(row["round"])) for r in runs]
        for metric in exp.round_metrics:
            values = [m[metric] for m in records if metric in m and np.isfinite(m[metric])]
            std = np.std(values, ddof=1) if len(values) > 1 else 0.0
            expected = f"{np.mean(values):.3g} +- {std:.2g} ({len(values)})" if values else ""
            assert row[metric] == expected and (metric == "loss" or bool(values) == (row["round"] != "1"))
    assert rows[0]["loss"].endswith("+- 0 (1)")
    md = (folder / "rounds.md").read_text()
    assert "| b | lr=0.2 | 1 | " in md and " (1) | - |" in md  # "-": not logged at that round


def test_a_late_metric_is_the_per_round_metric_over_the_second_half_and_is_paired_by_seed(tmp_path, tiny):
    """``late/loss``: each run's training loss averaged over rounds 3-4 of 4 (a non-finite value left out), mean +-
    std over seeds in table.csv, and in paired.csv the per-seed differences with their t interval and a claim's
    verdict, without a (seed, client) interval (a whole-run figure has no per-client values)."""
    block = rp.Block("b", tiny[0], (("method.lr", ("0.05", "0.2")),))
    claim = rp.Claim((("method.lr", "0.2"),), "late/loss", "below", "a larger step ends lower")
    exp = rp.Experiment(
        "late",
        "late loss",
        (block,),
        quick=("federation.rounds=4",),
        seeds=(1, 2),
        metrics=("seen/accuracy", "late/loss"),
        reference=(("method.lr", "0.05"),),
        claims=(claim,),
    )
    runs = rp.plan(["late"], out=tmp_path, seeds=[1, 2], quick=True, registry={"late": exp})
    assert rp.execute(runs, jobs=2) == []
    log = runs[0].out / "metrics.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    records[2]["loss"] = float("nan")
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    late = {}
    for r in runs:
        values = [m["loss"] for m in read_metrics(r.out) if m["round"] > 2 and np.isfinite(m["loss"])]
        assert len(values) == (1 if r is runs[0] else 2)
        late[(r.point, r.seed)] = float(np.mean(values))
    folder = rp.tables(runs, out=tmp_path, registry={"late": exp})[0]
    rows = {r["point"]: r for r in csv.DictReader((folder / "table.csv").open())}
    for point in {r.point for r in runs}:
        values = [late[(point, s)] for s in (1, 2)]
        assert float(rows[slug(point)]["late/loss (mean)"]) == pytest.approx(np.mean(values))
        assert float(rows[slug(point)]["late/loss (std)"]) == pytest.approx(np.std(values, ddof=1))
    (paired,) = [r for r in csv.DictReader((folder / "paired.csv").open()) if r["metric"] == "late/loss"]
    small, large = sorted({r.point for r in runs}, key=lambda p: float(dict(p)["method.lr"]))
    diffs = [late[(large, s)] - late[(small, s)] for s in (1, 2)]
    assert paired["per seed"] == " ".join(f"{d:+.2f}" for d in diffs) and paired["clients ci95"] == ""
    lo, hi = (float(x) for x in paired["seeds ci95"].strip("[]").split(","))
    assert lo <= np.mean(diffs) <= hi
    expected = "reproduced" if hi < 0 else "not reproduced" if lo > 0 else "not settled (interval spans the claim)"
    assert paired["paper"] == claim.paper and paired["verdict"] == expected


def test_each_point_runs_with_the_step_size_chosen_for_it_on_the_validation_split(tmp_path, tiny):
    """The tuning stage runs every (point, step size) on a validation split, chooses per point the step with the
    best validation accuracy, and the experiment's runs then use it; a failed tuning run is never chosen."""
    block = rp.Block("per-round", tiny[0], (("federation.clients_per_round", ("2", "3")),))
    exp = rp.Experiment(
        "tuned",
        "FedAvg at two participation levels, each with its own step",
        (block,),
        quick=("federation.rounds=2",),
        seeds=(1,),
        tuning=rp.Tuning(grid=(("method.lr", ("0.01", "0.5")),), seeds=(1,)),
    )
    registry, out = {"tuned": exp}, tmp_path / "out"
    assert "+ 4 to tune" in rp.listing(registry)
    tuning = rp.plan_tuning(["tuned"], out=out, quick=True, registry=registry)
    assert len(tuning) == 4 and all(r.cfg.data.validation == 0.2 for r in tuning)
    assert rp.execute(tuning, jobs=2) == []
    rp.choose(tuning, out=out, quick=True, registry=registry)
    record = json.loads((out / "tuned" / "tuning" / "choices.json").read_text())
    for n in ("2", "3"):
        scores = {
            lr: json.loads(
                (
                    out / "tuned" / "tuning" / "per-round" / f"clients_per_round={n}_lr={lr}" / "seed1" / "results.json"
                ).read_text()
            )["summary"]["seen/accuracy"]
            for lr in ("0.01", "0.5")
        }
        best = max(scores, key=scores.__getitem__)
        assert record["choices"][f"per-round/clients_per_round={n}"] == {"method.lr": best}
    assert record["at_edge"] == sorted(record["choices"])  # a two-value grid: every choice is at an edge
    runs = rp.plan(["tuned"], out=out, seeds=None, quick=True, registry=registry)
    for r in runs:
        chosen = record["choices"][f"per-round/{slug(r.point)}"]["method.lr"]
        assert r.cfg.method.lr == float(chosen) and r.cfg.data.validation == 0.0
    # choices made at the --quick scale are not used at full scale
    assert all(r.cfg.method.lr == 0.1 for r in rp.plan(["tuned"], out=out, seeds=None, quick=False, registry=registry))
    # a failed tuning run scores nothing: the other step is chosen
    winner = record["choices"]["per-round/clients_per_round=2"]["method.lr"]
    failed = next(r for r in tuning if dict(r.point) == {"federation.clients_per_round": "2", "method.lr": winner})
    (failed.out / "results.json").unlink()
    rp.choose(tuning, out=out, quick=True, registry=registry)
    again = json.loads((out / "tuned" / "tuning" / "choices.json").read_text())["choices"]
    assert again["per-round/clients_per_round=2"] == {"method.lr": "0.5" if winner == "0.01" else "0.01"}
    rows = list(csv.DictReader((out / "tuned" / "tuning" / "tuning.csv").open()))
    assert sum(r["chosen"] == "True" for r in rows) == 2 and len(rows) == 4


def test_a_run_that_diverges_is_an_outcome_recorded_once_and_never_run_again(tmp_path, tiny, monkeypatch):
    """A tuning run whose step diverges (``fedtailor run`` exits 3) is marked with its error, recorded, restored
    from the records on another machine and not run again there; its values score nothing, so the point takes the
    other step, and the reproduction has not failed. A run of the experiment itself that diverges is a failure,
    reported again, not rerun."""
    from fedtailor.fl import experiments as registry
    from fedtailor.reproduce.records import read_records, records_path
    from fedtailor.rundir import read_diverged, read_results

    block = rp.Block("b", tiny[0], (("federation.clients_per_round", ("3",)),))
    exp = rp.Experiment("edge", "a grid whose largest step diverges", (block,), quick=("federation.rounds=2",))
    exp = replace(exp, seeds=(1,), tuning=rp.Tuning(grid=(("method.lr", ("0.05", "1e12")),)))
    monkeypatch.setitem(registry._EXPERIMENTS, "edge", ("tests", exp))
    records = tmp_path / "records"

    def reproduce(name: str, where: str) -> tuple[rp.Outcome, list[str]]:
        lines: list[str] = []
        outcome = rp.reproduce(
            [name], out=tmp_path / where, quick=True, tune=True, records=records, progress=lines.append
        )
        return outcome, lines

    outcome, lines = reproduce("edge", "first")
    assert outcome.failed == [] and any("lr=1e12 seed 41 diverged" in ln for ln in lines)
    edge = tmp_path / "first/edge/tuning/b/clients_per_round=3_lr=1e12/seed41"
    assert (
        not (edge / "results.json").exists() and "round 1" in read_diverged(edge) and "method.lr" in read_diverged(edge)
    )
    with pytest.raises(FileNotFoundError, match="holds a run that diverged, without results"):
        read_results(edge)  # what `fedtailor report` of that folder says
    choice = json.loads((tmp_path / "first/edge/tuning/choices.json").read_text())["choices"]
    assert choice == {"b/clients_per_round=3": {"method.lr": "0.05"}}
    saved = read_records(records_path(records, "edge"))
    assert saved["edge/tuning/b/clients_per_round=3_lr=1e12/seed41"]["diverged"] == read_diverged(edge)
    assert saved["edge/tuning/b/clients_per_round=3_lr=1e12/seed41"]["results"] == {}
    outcome, lines = reproduce("edge", "second")  # a fresh machine: everything restored, nothing run
    assert outcome.failed == [] and lines[0] == "reproduce: 3 of 3 finished run(s) of edge restored from " + str(
        records_path(records, "edge")
    )
    assert lines[1:3] == [
        "reproduce: 1 run(s) diverged before and are not run again (diverged.json in each)",
        "reproduce: 1 done, 0 running, 0 waiting",
    ]
    assert json.loads((tmp_path / "second/edge/tuning/choices.json").read_text())["choices"] == choice
    # the experiment's own run at a diverging step: a failure, every time, without running it again
    bad = replace(exp, name="edge-run", tuning=None, blocks=(replace(block, sets=("method.lr=1e12",)),))
    monkeypatch.setitem(registry._EXPERIMENTS, "edge-run", ("tests", bad))
    for _ in range(2):
        outcome, lines = reproduce("edge-run", "third")
        assert [r.diverged for r in outcome.failed] == [True]
    assert "reproduce: 1 run(s) diverged before and are not run again (diverged.json in each)" in lines
    assert lines[1] == "reproduce: nothing to tune: edge-run has no tuning stage; its runs use their configs"
    table = (tmp_path / "third/edge-run/table.md").read_text().splitlines()  # the table says so, not "0 of 1 so far"
    header = ["| block | point | seeds | diverged |", "|---|---|---|---|"]
    assert table[4:7] == [*header, "| b | clients_per_round=3 | 0 | 1 |"]


def test_a_tuning_stage_on_one_block_serves_every_block(tmp_path, tiny):
    """``Tuning.on``: only that block is tuned, and each point of every block runs with that block's choice for
    the same point (a reduced budget); a block name that is not the experiment's is refused."""
    grid = (("federation.clients_per_round", ("2", "3")),)
    blocks = (rp.Block("a", tiny[0], grid), rp.Block("b", tiny[0], grid, ("federation.rounds=3",)))
    tuning = rp.Tuning(grid=(("method.lr", ("0.01", "0.5")),), seeds=(1,), on="a")
    exp = rp.Experiment("on-a", "two blocks tuned on the first", blocks, seeds=(1,), tuning=tuning)
    registry, out = {"on-a": exp}, tmp_path / "out"
    assert "+ 4 to tune" in rp.listing(registry)  # block b is not tuned
    runs = rp.plan_tuning(["on-a"], out=out, quick=True, registry=registry)
    assert len(runs) == 4 and {r.block for r in runs} == {"tuning/a"}
    folder = out / "on-a" / "tuning"
    folder.mkdir(parents=True)
    choices = {"a/clients_per_round=2": {"method.lr": "0.5"}, "a/clients_per_round=3": {"method.lr": "0.01"}}
    (folder / "choices.json").write_text(json.dumps({"quick": True, "choices": choices}))
    for r in rp.plan(["on-a"], out=out, seeds=None, quick=True, registry=registry):
        assert r.cfg.method.lr == float(choices[f"a/{slug(r.point)}"]["method.lr"])
    # tuning one point again keeps the other's choice (a block or a session at a time)
    again = [r for r in runs if dict(r.point)["federation.clients_per_round"] == "2"]
    assert rp.execute(again) == []
    rp.choose(again, out=out, quick=True, registry=registry)
    record = json.loads((folder / "choices.json").read_text())
    assert record["choices"]["a/clients_per_round=3"] == {"method.lr": "0.01"}  # kept as it was
    assert set(record["choices"]) == set(choices) and set(record["scores"]) == {"a/clients_per_round=2"}
    # a block named with --tune is tuned even so, and its own choices come before the fallback
    assert {r.block for r in rp.plan_tuning(["on-a/b"], out=out, quick=True, registry=registry)} == {"tuning/b"}
    own = {**record["choices"], "b/clients_per_round=3": {"method.lr": "0.5"}}
    (folder / "choices.json").write_text(json.dumps({"quick": True, "choices": own}))
    lrs = {
        (r.block, slug(r.point)): r.cfg.method.lr
        for r in rp.plan(["on-a"], out=out, seeds=None, quick=True, registry=registry)
    }
    assert lrs[("b", "clients_per_round=3")] == 0.5 and lrs[("a", "clients_per_round=3")] == 0.01
    assert lrs[("b", "clients_per_round=2")] == float(own["a/clients_per_round=2"]["method.lr"])
    with pytest.raises(ValueError, match="on-c: its tuning stage is on block 'c', which is not a block of it"):
        rp.Experiment("on-c", "x", blocks, tuning=rp.Tuning(grid=tuning.grid, on="c"))


def test_an_ablation_takes_the_choice_of_the_tuned_point_its_config_agrees_with(tmp_path, tiny):
    """``Experiment.tuned_as``: each point runs with the choice of the other experiment's tuned point whose grid
    values its own config already has (the participation ablation at the compared methods' steps), its config's own
    values where none agrees; naming an experiment without a tuning stage, or having both, is refused."""
    tuning = rp.Tuning(grid=(("method.lr", ("0.01", "0.5")),), seeds=(1,))
    main = rp.Experiment(
        "main",
        "two methods at 3 clients a round, each its own step",
        (rp.Block("m", tiny[0], (("method.name", ("fedavg", "fedprox")),), ("federation.clients_per_round=3",)),),
        seeds=(1,),
        tuning=tuning,
    )
    grid = (("method.name", ("fedavg", "fedprox", "ditto")), ("federation.clients_per_round", ("2", "3")))
    ablation = rp.Experiment(
        "abl", "each method at 2 and 3 clients a round", (rp.Block("a", tiny[0], grid),), seeds=(1,), tuned_as="main"
    )
    registry, out = {"main": main, "abl": ablation}, tmp_path / "out"
    assert "(at main's tuned steps)" in rp.listing(registry)
    folder = out / "main" / "tuning"
    folder.mkdir(parents=True)
    choices = {"m/name=fedavg": {"method.lr": "0.5"}, "m/name=fedprox": {"method.lr": "0.01"}}
    (folder / "choices.json").write_text(json.dumps({"quick": True, "choices": choices}))
    lrs = {slug(r.point): r.cfg.method.lr for r in rp.plan(["abl"], out=out, seeds=None, quick=True, registry=registry)}
    default = rp.plan(["main"], out=tmp_path / "none", seeds=None, quick=True, registry=registry)[0].cfg.method.lr
    assert default not in (0.5, 0.01)
    assert lrs == {
        "name=fedavg_clients_per_round=2": 0.5,
        "name=fedavg_clients_per_round=3": 0.5,
        "name=fedprox_clients_per_round=2": 0.01,
        "name=fedprox_clients_per_round=3": 0.01,
        "name=ditto_clients_per_round=2": default,  # no tuned point agrees with Ditto
        "name=ditto_clients_per_round=3": default,
    }
    with pytest.raises(ValueError, match="abl takes the tuning choices of 'm', which is not an experiment with"):
        rp.plan(["abl"], out=out, seeds=None, quick=True, registry={"abl": replace(ablation, tuned_as="m")})
    with pytest.raises(ValueError, match="x: an experiment has a tuning stage or takes another's choices, not both"):
        rp.Experiment("x", "x", main.blocks, tuning=tuning, tuned_as="main")


def test_a_block_that_fixes_a_tuned_key_is_refused(tmp_path, tiny):
    exp = rp.Experiment(
        "clash",
        "a block fixing the step the tuning stage tunes",
        (rp.Block("fixed", tiny[0], sets=("method.lr=0.2",)),),
        tuning=rp.Tuning(grid=(("method.lr", ("0.01", "0.5")),)),
    )
    with pytest.raises(ValueError, match="clash/fixed sets method.lr, which its tuning stage tunes"):
        rp.plan_tuning(["clash"], out=tmp_path, quick=True, registry={"clash": exp})


def test_the_cifar10_entry_runs_end_to_end_on_batches_in_the_real_format(tmp_path):
    """CIFAR-10 is not on these machines: its shipped config runs (the 3x32x32 LeNet) on batches written in
    the real ``cifar-10-batches-py`` format, at a tiny scale."""
    from fedtailor.config import load_config
    from fedtailor.data.datasets_test import _write_cifar
    from fedtailor.runner import run_experiment

    _write_cifar(tmp_path / "cifar-10-batches-py", np.random.default_rng(0), per_batch=40)
    exp = rp.EXPERIMENTS["compact-table1-cifar10"]
    config = next(b.config for b in exp.blocks if b.name == "eps16")
    small = ["data.num_clients=6", "data.num_unseen=1", "data.context_size=20", "method.privacy.batch_size=16"]
    cfg = load_config(
        str(Path(__file__).parents[1] / config),
        [*small, f'data.root="{tmp_path / "cifar-10-batches-py"}"', "federation.rounds=2", "method.coef_dim=256"],
    )
    results = json.loads((run_experiment(cfg, tmp_path / "run", progress=False) / "results.json").read_text())
    assert results["dataset"] == "cifar10" and results["rounds_completed"] == 2
    assert {"seen/accuracy", "future/accuracy"} <= set(results["summary"])


@pytest.mark.parametrize(
    ("expect", "interval", "verdict"),
    [
        ("above", "[+0.10, +2.00]", "reproduced"),
        ("above", "[-2.00, -0.10]", "not reproduced"),
        ("above", "[-0.50, +1.00]", "not settled (interval spans the claim)"),
        ("below", "[-2.00, -0.10]", "reproduced"),
        ("below", "[+0.10, +2.00]", "not reproduced"),
        ("within", "[-0.30, +0.40]", "reproduced"),
        ("within", "[+0.60, +1.50]", "not reproduced"),
        ("within", "[-0.20, +0.90]", "not settled (interval spans the claim)"),
    ],
)
def test_a_claims_verdict_reads_the_interval_over_seeds(expect, interval, verdict):
    from fedtailor.reproduce.report import verdict as judge

    claim = rp.Claim((("method.variant", "x"),), "seen/accuracy", expect, "paper", bound=0.5)
    assert judge(claim, {"mean": "+0.00", "seeds ci95": interval}) == verdict
    assert judge(claim, {"mean": "+5.00"}) == "not settled (one seed)"


def test_a_tuning_key_applies_only_to_the_methods_that_have_it(tmp_path):
    """FedProx's mu and Ditto's lambda are tuned with the step where those bases have them, never elsewhere."""
    runs = rp.plan_tuning(["fedlag-fmnist-reduced/main-alpha01"], out=tmp_path, quick=True)
    keys: dict[str, set[frozenset[str]]] = {}
    for r in runs:
        point = dict(r.point)
        keys.setdefault(point["method.name"], set()).add(frozenset(k for k in point if k not in ("method.name",)))
    assert keys["fedprox"] == {frozenset({"method.fedlag.top_k", "method.lr", "method.mu"})}
    assert keys["ditto"] == {frozenset({"method.fedlag.top_k", "method.lr", "method.lam"})}
    assert keys["fedavg"] == {frozenset({"method.fedlag.top_k", "method.lr"})}
    per_base = {name: sum(dict(r.point)["method.name"] == name for r in runs) for name in keys}
    steps = 5  # the FedAvgCNN's lr grid on Fashion-MNIST: MNIST's four and 0.5
    assert per_base["fedprox"] == per_base["ditto"] == 2 * steps * 3 and per_base["fedavg"] == 2 * steps
    fedprox = next(r for r in runs if dict(r.point).get("method.mu") == "0.1")
    assert fedprox.cfg.method.mu == 0.1 and fedprox.cfg.data.validation == 0.2
    # the reduced Fashion-MNIST scale tunes at half its 40 rounds (its declared reduced tuning budget), runs at 40
    full = rp.plan_tuning(["fedlag-fmnist-reduced/main-alpha01"], out=tmp_path, quick=False)
    assert {r.cfg.federation.rounds for r in full} == {20} and len(full) == len(runs)
    main = rp.plan(["fedlag-fmnist-reduced/main-alpha01"], out=tmp_path, seeds=[41], quick=False)
    assert {r.cfg.federation.rounds for r in main} == {40}


def test_runs_get_threads_from_the_cores_this_process_may_use(tmp_path, registry, monkeypatch):
    """Under ``taskset -c 1`` (or a scheduler's allocation of one core) on a many-core machine, a run gets one
    thread, not ``os.cpu_count()`` of them."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    runs = rp.plan(["tiny"], out=tmp_path, seeds=[1], quick=False, registry=registry)[:1]
    log = tmp_path / "threads.txt"

    def fake(run):
        code = f"import os; open({str(log)!r}, 'w').write(os.environ['OMP_NUM_THREADS'])"
        return [sys.executable, "-c", code]

    rp.execute(runs, jobs=4, progress=lambda line: None, command=fake)
    assert log.read_text() == "1"


def test_blocks_that_sweep_different_keys_each_pair_with_their_own_reference():
    xi = "method.fedlag.xi"
    k = "method.fedlag.top_k"
    points = [("xi", ((xi, v),)) for v in ("-0.1", "0.0", "0.1")] + [("k", ((k, v),)) for v in ("0", "2")]
    refs = ((xi, "0.0"), (k, "0"))
    assert _reference_of("xi", ((xi, "-0.1"),), points, refs) == ("xi", ((xi, "0.0"),))
    assert _reference_of("k", ((k, "2"),), points, refs) == ("k", ((k, "0"),))
    assert _reference_of("xi", ((xi, "0.0"),), points, refs) is None  # the references themselves
    assert _reference_of("k", ((k, "0"),), points, refs) is None
    assert _reference_of("k", ((k, "2"),), points, refs[:1]) is None  # no xi in the top_k block: no pair


def test_run_records_carry_a_reproduction_to_machines_that_do_not_keep_their_run_directories(
    tmp_path, tiny, monkeypatch
):
    """``--records``: a machine runs seed 1 and leaves only the records file; a fresh one restores those runs as
    finished and runs seed 2 alone; a third rebuilds the same tables from the records without running anything. A
    restored run counts only for its own config, an unfinished run directory keeps its checkpoint, and a records
    file whose path climbs out of the output folder is refused before anything is written."""
    import gzip

    from fedtailor.fl import experiments as registry
    from fedtailor.reproduce.records import read_records, records_path, restore, save

    exp = rp.Experiment("carried", "two steps", (rp.Block("lr", tiny[0], (("method.lr", ("0.05", "0.2")),)),))
    exp = replace(exp, quick=("federation.rounds=2",), seeds=(1, 2), reference=(("method.lr", "0.05"),))
    monkeypatch.setitem(registry._EXPERIMENTS, "carried", ("tests", exp))
    records = tmp_path / "records"
    path = records_path(records, "carried")

    def machine(name: str, seeds: list[int]) -> tuple[Path, list[str]]:
        lines: list[str] = []
        out = tmp_path / name
        outcome = rp.reproduce(["carried"], out=out, seeds=seeds, quick=True, records=records, progress=lines.append)
        assert outcome.failed == []
        return out, lines

    first, _ = machine("first", [1])
    assert sorted(read_records(path)) == [f"carried/lr/lr={lr}/seed1" for lr in ("0.05", "0.2")]
    # part-way: the tables of the finished seed from the records alone, nothing run, the seeds counted
    lines = []
    early = tmp_path / "early"
    outcome = rp.reproduce(
        ["carried"], out=early, seeds=[1, 2], quick=True, records=records, report_only=True, progress=lines.append
    )
    assert lines[1] == "reproduce: report only: 2 of 4 run(s) finished, none run" and outcome.failed == []
    assert not (early / "carried/lr/lr=0.05/seed2").exists()
    assert (early / "carried/table.csv").read_text() == (first / "carried/table.csv").read_text()
    assert [r["seeds"] for r in csv.DictReader((early / "carried/table.csv").open())] == ["1", "1"]
    with pytest.raises(ValueError, match="cannot tune"):
        rp.reproduce(["carried"], out=early, quick=True, tune=True, report_only=True)
    second, lines = machine("second", [1, 2])
    assert lines[0] == f"reproduce: 2 of 2 finished run(s) of carried restored from {path}"
    assert lines[1] == "reproduce: 2 done, 0 running, 2 waiting"  # seed 1 is not run again
    assert json.loads((second / "carried/lr/lr=0.2/seed1/results.json").read_text()) == json.loads(
        (first / "carried/lr/lr=0.2/seed1/results.json").read_text()
    )
    for name in ("clients.csv", "metrics.jsonl"):  # what `fedtailor report` reads of a run, as the run wrote it
        assert (second / "carried/lr/lr=0.2/seed1" / name).read_text() == (
            first / "carried/lr/lr=0.2/seed1" / name
        ).read_text()
    third, lines = machine("third", [1, 2])
    assert lines[1] == "reproduce: 4 done, 0 running, 0 waiting"
    for table in ("table.csv", "paired.csv"):
        assert (third / "carried" / table).read_text() == (second / "carried" / table).read_text()
    _, lines = machine("third", [1, 2])  # a restart: the folder already holds every record's run
    assert lines[:2] == [
        f"reproduce: 0 of 4 finished run(s) of carried restored from {path} (4 already in {third})",
        "reproduce: 4 done, 0 running, 0 waiting",
    ]
    saved = path.read_bytes()
    assert len(read_records(path)) == 4
    assert save(path, third, "carried") == 4 and path.read_bytes() == saved  # the same runs, the same bytes
    # a restored run is finished for its own config only: the full scale (4 rounds) is not done
    assert not any(r.done for r in rp.plan(["carried"], out=third, seeds=[1], quick=False))
    # an unfinished run directory is left as it is
    begun = tmp_path / "fourth" / "carried/lr/lr=0.05/seed1"
    begun.mkdir(parents=True)
    (begun / "checkpoint.pt").write_bytes(b"begun")
    assert restore(path, tmp_path / "fourth") == (3, 4) and sorted(p.name for p in begun.iterdir()) == ["checkpoint.pt"]
    # hostile or damaged files: one line naming the file and line, nothing written
    lines_in = gzip.decompress(saved).decode().splitlines()
    for bad, why in (
        (json.dumps({**json.loads(lines_in[0]), "run": "../escape/seed1"}), "path"),
        (json.dumps({**json.loads(lines_in[0]), "results": []}), "results"),
        (json.dumps({**json.loads(lines_in[0]), "results": {"seed": 1}}), "results"),
        (json.dumps({**json.loads(lines_in[0]), "results": {}, "diverged": 3}), "diverged"),  # why, as text
        (json.dumps({**json.loads(lines_in[0]), "diverged": "round 1"}), "diverged"),  # and no results beside it
    ):
        path.write_bytes(gzip.compress(("\n".join([lines_in[1], bad]) + "\n").encode()))
        with pytest.raises(ValueError, match=rf"runs.jsonl.gz, line 2: not a run record \(its {why} is wrong\)"):
            restore(path, tmp_path / "fifth")
        assert not (tmp_path / "fifth").exists() and not (tmp_path / "escape").exists()
    path.write_bytes(saved[:-20])
    with pytest.raises(ValueError, match="not a gzip file of run records"):
        restore(path, tmp_path / "fifth")


COMMITTED_RECORDS = sorted((Path(__file__).parents[1] / "docs" / "results").glob("*/runs.jsonl.gz"))


@pytest.mark.parametrize("path", COMMITTED_RECORDS, ids=lambda p: p.parent.name)
def test_every_committed_record_is_a_finished_run_its_experiment_plans_now(tmp_path, path):
    """A committed record (``docs/results/NAME/runs.jsonl.gz``) restores to the run directory of a run that
    ``fedtailor reproduce NAME --tune`` plans today, with that run's resolved config: no record is stale (a grid,
    a default or a tuned choice changed since it ran) or of another experiment."""
    from fedtailor.reproduce.records import read_records, restore

    name = path.parent.name
    records = read_records(path)
    assert restore(path, tmp_path) == (len(records), len(records)) and records
    planned = {
        r.out: r
        for r in [
            *rp.plan_tuning([name], out=tmp_path, quick=False),
            *rp.plan([name], out=tmp_path, seeds=None, quick=False),
        ]
    }
    for run in records:
        assert run.startswith(f"{name}/"), f"{path}: {run} is not a run of {name}"
        match = planned.get(tmp_path / run)
        assert match is not None, f"{path}: {run} is not a run {name} plans"
        assert match.done or match.diverged, f"{path}: {run} ran another config than {name} plans now; rerun it"


TUNED_DIR = Path(__file__).parents[1] / "configs" / "tuned"
TUNED_FROM_RECORDS = [p for p in COMMITTED_RECORDS if (TUNED_DIR / f"{p.parent.name}.json").is_file()]


@pytest.mark.parametrize("path", TUNED_FROM_RECORDS, ids=lambda p: p.parent.name)
def test_committed_tuning_choices_are_what_the_committed_records_choose(tmp_path, path):
    """``configs/tuned/NAME.json`` is what the tuning stage chooses from the committed tuning runs of NAME: every
    tuning run is recorded, and the choices, their scores and the points at the grid's edge are the same."""
    from fedtailor.reproduce.records import restore

    name = path.parent.name
    restore(path, tmp_path)
    runs = rp.plan_tuning([name], out=tmp_path, quick=False)
    missing = [str(r.out.relative_to(tmp_path)) for r in runs if not (r.done or r.diverged)]
    assert not missing, f"{path}: tuning runs not recorded: {missing}"
    rp.choose(runs, out=tmp_path, quick=False)
    made = json.loads((tmp_path / name / "tuning" / "choices.json").read_text())
    committed = json.loads((TUNED_DIR / f"{name}.json").read_text())
    for key in ("choices", "scores", "at_edge", "grid", "seeds", "metric"):
        assert made[key] == committed[key], f"configs/tuned/{name}.json: {key} differs from its records"


TABLES = ("table.csv", "paired.csv", "rounds.csv")
TABLED_RECORDS = [p for p in COMMITTED_RECORDS if (p.parent / "table.csv").is_file()]


@pytest.mark.parametrize("path", TABLED_RECORDS, ids=lambda p: p.parent.name)
def test_committed_tables_are_what_the_committed_records_make(tmp_path, path):
    """``docs/results/NAME/table.csv`` (and ``paired.csv``, ``rounds.csv``) of an experiment with committed records
    is, byte for byte, what ``fedtailor reproduce NAME --records docs/results --report-only`` makes from them: no
    table number without its runs, and no committed run left out of the tables."""
    name = path.parent.name
    (tmp_path / "records" / name).mkdir(parents=True)
    shutil.copy(path, tmp_path / "records" / name / path.name)
    rp.reproduce([name], out=tmp_path / "out", records=tmp_path / "records", report_only=True, progress=lambda _: None)
    for table in TABLES:
        committed = path.parent / table
        if committed.is_file():
            made = tmp_path / "out" / name / table
            assert made.read_text() == committed.read_text(), f"{committed}: not what its records make (--report-only)"
