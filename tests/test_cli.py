"""The command line end to end on a small real dataset (digits): run, report, resume, errors."""

import json

import numpy as np
import pytest
import scipy.stats

from fedtailor.cli import main


def test_run_writes_a_complete_run_directory_and_report(tmp_path, capsys, tiny):
    out = tmp_path / "run"
    assert main(["run", *tiny, "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "Seen   accuracy" in text and "Future accuracy" in text and "per-client results" in text
    for name in (
        "config.json",
        "metrics.jsonl",
        "results.json",
        "clients.csv",
        "checkpoint.pt",
        "learning_curves.png",
        "per_client_accuracy.png",
    ):
        assert (out / name).exists(), name
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    results = json.loads((out / "results.json").read_text())
    assert len(results["per_client"]) == 6
    assert json.loads((out / "config.json").read_text())["federation"]["rounds"] == 4
    assert main(["report", str(out), "--no-plots"]) == 0
    assert "per-client results" in capsys.readouterr().out


def test_results_and_report_carry_the_distribution_and_the_final_best_and_chosen_rounds(tmp_path, capsys, tiny):
    """Validation beside the test split: every round evaluated on both; the summary holds the final round's
    distribution over clients, the best round (on test) and the round chosen on validation, read back from the
    run's own per-round records; the report prints them."""
    out = tmp_path / "run"
    sets = ["data.validation=0.3", 'data.validation_mode="alongside"', "federation.eval_every=1"]
    args = ["run", *tiny, "--out", str(out), "--no-progress", "--no-plots"]
    assert main([*args, *(x for s in sets for x in ("--set", s))]) == 0
    capsys.readouterr()
    results = json.loads((out / "results.json").read_text())
    s, clients = results["summary"], results["per_client"]
    seen = [c for c in clients if c["seen"]]
    assert len(clients) == 6 and all("val_accuracy" in c for c in seen)  # the unseen client is still evaluated
    assert not any("val_accuracy" in c for c in clients if not c["seen"])
    acc = np.array([c["accuracy"] for c in seen])
    assert s["seen/accuracy"] == pytest.approx(acc.mean()) and s["seen/accuracy/n"] == 5
    assert s["seen/accuracy/std"] == pytest.approx(acc.std(ddof=1))
    assert s["seen/accuracy/p10"] == pytest.approx(np.percentile(acc, 10))
    half = scipy.stats.t.ppf(0.975, 4) * acc.std(ddof=1) / np.sqrt(5)
    assert (s["seen/accuracy/ci95_lo"], s["seen/accuracy/ci95_hi"]) == pytest.approx(
        (acc.mean() - half, acc.mean() + half)
    )
    assert s["all/accuracy/n"] == 6 and "future/accuracy/std" not in s  # one unseen client: no spread
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    best = max(history, key=lambda r: r["seen/accuracy"])
    chosen = max(history, key=lambda r: r["seen/val_accuracy"])
    assert s["best_round"] == best["round"] and s["best/seen/accuracy"] == pytest.approx(best["seen/accuracy"])
    assert s["chosen_round"] == chosen["round"]
    assert s["chosen/seen/accuracy"] == pytest.approx(chosen["seen/accuracy"])
    assert s["chosen/future/accuracy"] == pytest.approx(chosen["future/accuracy"])
    assert history[-1]["seen/accuracy"] == pytest.approx(s["seen/accuracy"])  # the final round's evaluation
    assert not any(k.startswith("seen/") for k in results["round_totals"])
    assert main(["report", str(out), "--no-plots"]) == 0
    text = capsys.readouterr().out
    assert f"p10 {100 * s['seen/accuracy/p10']:.2f}%" in text and "95% interval of the mean" in text
    assert "val_accuracy" in text and "ci95_lo" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()[:1] in (["best"], ["chosen"])}
    assert rows["best"][1] == str(s["best_round"]) and rows["chosen"][1] == str(s["chosen_round"])
    assert rows["chosen"][2] == f"{100 * s['chosen/seen/accuracy']:.2f}%"


def test_a_validation_split_for_tuning_still_replaces_the_test_split(tmp_path, tiny):
    out = tmp_path / "run"
    assert main(["run", *tiny, "--out", str(out), "--no-progress", "--no-plots", "--set", "data.validation=0.3"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [c["seen"] for c in results["per_client"]] == [True] * 5  # no test or query record is evaluated
    assert "chosen_round" not in results["summary"] and "future/accuracy" not in results["summary"]
    assert not any("val_" in k for k in results["per_client"][0])


def test_interrupted_run_resumes_to_the_same_result(tmp_path, tiny):
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(["run", *tiny, "--out", str(full), "--no-progress", "--no-plots"]) == 0
    assert main(["run", *tiny, "--out", str(part), "--no-progress", "--no-plots", "--stop-after", "2"]) == 0
    assert json.loads((part / "results.json").read_text())["rounds_completed"] == 2
    assert main(["run", *tiny, "--out", str(part), "--no-progress", "--no-plots", "--resume"]) == 0
    a, b = (json.loads((d / "results.json").read_text()) for d in (full, part))
    assert a["per_client"] == b["per_client"] and a["summary"] == b["summary"]
    strip = lambda d: [
        {k: v for k, v in json.loads(x).items() if k != "seconds"}
        for x in (d / "metrics.jsonl").read_text().splitlines()
    ]
    assert strip(full) == strip(part)


def test_user_errors_are_one_clear_line(tmp_path, capsys, tiny):
    assert main(["run", "--set", "data.alpha=-2", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "data.alpha" in err and "greater than 0" in err and "Traceback" not in err
    out = tmp_path / "run"
    assert main(["run", *tiny, "--out", str(out), "--no-progress", "--no-plots", "--stop-after", "1"]) == 0
    assert main(["run", *tiny, "--out", str(out), "--no-progress"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "nothing")]) == 2


@pytest.mark.parametrize("cmd", [["datasets"], ["run", "--help"]])
def test_commands_exist(cmd, capsys):
    try:
        assert main(cmd) == 0
    except SystemExit as e:  # argparse --help
        assert e.code == 0


def test_sweep_aggregates_over_seeds_and_resumes(tmp_path, tiny, capsys, monkeypatch):
    out = tmp_path / "sweep"
    args = ["sweep", *tiny, "--seeds", "1,2", "--grid", "method.lr=0.05,0.2", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    rows = json.loads((out / "sweep.json").read_text())
    assert [r["method.lr"] for r in rows] == ["0.05", "0.2"]
    per_seed = [
        json.loads((out / "lr=0.05" / f"seed{s}" / "results.json").read_text())["summary"]["seen/accuracy"]
        for s in (1, 2)
    ]
    mean = 100 * sum(per_seed) / 2
    assert rows[0]["seen/accuracy"].startswith(f"{mean:.2f} +- ")  # mean over seeds of per-client means
    assert {"seen/accuracy/p10", "best/seen/accuracy", "future/accuracy"} <= set(rows[0])
    import fedtailor.sweep as sweep

    monkeypatch.setattr(sweep, "run_experiment", lambda *a, **k: pytest.fail("finished runs must be skipped"))
    assert main(args) == 0


def test_resume_with_a_changed_config_is_refused(tmp_path, capsys, tiny):
    out = tmp_path / "run"
    assert main(["run", *tiny, "--out", str(out), "--no-progress", "--no-plots", "--stop-after", "1"]) == 0
    capsys.readouterr()
    assert main(["run", *tiny, "--out", str(out), "--no-progress", "--resume", "--set", "method.lr=0.2"]) == 2
    err = capsys.readouterr().err
    assert "different config" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert json.loads((out / "results.json").read_text())["rounds_completed"] == 1  # untouched


def test_a_privacy_budget_refusal_is_one_clear_line(tmp_path, capsys):
    """A fixed sigma too small for the schedule: the budget guard refuses before any release, and the CLI says
    which client would exceed the target and how to fix it."""
    args = [
        "run",
        "configs/compact/mnist-eps16.toml",
        "--set",
        "method.privacy.sigma=0.001",
        "--set",
        "federation.rounds=20",
        "--out",
        str(tmp_path / "run"),
        "--no-progress",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "would reach eps" in err and "above the target eps = 16" in err and "Raise sigma" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "dp", ["method.client_dp.sigma=0.001", "method.record_dp.noise_multiplier=0.05"], ids=["client", "record"]
)
def test_a_dp_wrapper_budget_refusal_is_one_clear_line(tmp_path, capsys, dp):
    """The DP wrappers of the parameter-sharing methods refuse a plan over budget before any release: one line."""
    args = ["run", "configs/fedlag/mnist-dnn-alpha10.toml", "--set", dp, "--set", "data.limit=4000"]
    assert main([*args, "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "would reach eps" in err and "above the target eps = 8" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_every_shipped_config_loads():
    from pathlib import Path

    from fedtailor.cli.run import default_config
    from fedtailor.config import COMPACT_VARIANTS, load_config

    paths = sorted(Path("configs").rglob("*.toml")) + [default_config()]
    assert len(paths) >= 13
    for path in paths:
        cfg = load_config(path)
        if cfg.method.name == "pfeddpo":  # the paper's hh-rlhf setting
            assert cfg.data.dataset == "hh-rlhf" and cfg.federation.rounds == 80 and cfg.method.beta == 0.2, path
            assert (cfg.data.num_clients, cfg.data.pairs_per_client, cfg.method.local_steps) == (5, 120, 3), path
            continue
        assert cfg.data.dataset in ("mnist", "fashion-mnist", "cifar10"), path
        if cfg.data.dataset == "cifar10":  # the paper's second task, read from the files a user fetched
            assert cfg.data.root and cfg.method.lr == 0.2, path
        if cfg.method.name == "compact":
            assert cfg.method.privacy.randomness == "simulation", path
            assert cfg.method.variant in COMPACT_VARIANTS, path
        else:  # the FedLAG paper's setup
            assert cfg.method.fedlag is not None and cfg.data.num_clients == 20 and cfg.federation.rounds == 100, path
            assert cfg.method.batch_size == 16 and cfg.method.lr == 0.005 and cfg.data.eval_fraction == 0.25, path


def test_the_core_never_imports_the_language_model_stack():
    """Checking a config (even a pFedDPO one) and building an image run import neither the language-model stack
    nor Flower."""
    import subprocess
    import sys

    code = (
        "import sys; from fedtailor.cli import build_parser; from fedtailor.config import load_config; "
        "from fedtailor.experiment import build_method, build_setup; build_parser(); "
        "load_config('configs/pfeddpo/hh-rlhf.toml'); "
        "cfg = load_config(None, ['data.dataset=\"digits\"', 'method.name=\"fedavg\"', 'method.model=\"mlp\"', "
        "'data.context_size=20', 'data.num_clients=6', 'data.num_unseen=1']); build_method(build_setup(cfg)); "
        "bad = [m for m in ('transformers', 'peft', 'gguf', 'flwr') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
