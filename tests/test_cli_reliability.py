"""Ordinary mistakes and accidents through the CLI: one line naming the problem and the fix, the right exit
code, and the run directory left in a state a fixed command can use (never stuck, never truncated)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TINY_TOML
from fedtailor.cli import main

COMPACT_SMALL = [
    'method.name="compact"',
    'data.dataset="mnist-5k"',
    "data.num_clients=10",
    "data.num_unseen=2",
    "data.context_size=60",
    "federation.rounds=3",
    "method.coef_dim=512",
    "method.hidden_dim=8",
    "method.privacy.batch_size=60",
    'method.privacy.randomness="simulation"',
]


def _fails(capsys, argv: list[str], *, code: int = 2) -> str:
    """Run the CLI, expect ``code`` and exactly one line on stderr without a traceback; return that line."""
    capsys.readouterr()
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_a_failed_start_leaves_no_directory_and_the_fixed_command_runs(tmp_path, capsys, tiny):
    out = tmp_path / "run"
    err = _fails(capsys, ["run", *tiny, "--out", str(out), "--set", 'data.dataset="mnits"'])
    assert "unknown dataset 'mnits'" in err and not out.exists()
    err = _fails(capsys, ["run", *tiny, "--out", str(out), "--set", "data.num_clients=900"])
    assert "client" in err and not out.exists()
    assert main(["run", *tiny, "--out", str(out), "--no-progress", "--no-plots"]) == 0


def test_a_method_failing_in_its_first_round_removes_what_the_call_created(tmp_path, capsys):
    """An m_g larger than a client's training records only shows when the client trains (round 1)."""
    out = tmp_path / "run"
    err = _fails(
        capsys,
        [
            "run",
            "--out",
            str(out),
            "--no-progress",
            *[f"--set={s}" for s in COMPACT_SMALL],
            "--set",
            "method.privacy.batch_size=5000",
        ],
    )
    assert "m_g=5000" in err and not out.exists()


def test_resume_names_the_changed_keys_and_refuses_a_directory_without_config(tmp_path, capsys, tiny):
    out = tmp_path / "run"
    assert main(["run", *tiny, "--out", str(out), "--no-progress", "--no-plots", "--stop-after", "1"]) == 0
    err = _fails(capsys, ["run", *tiny, "--out", str(out), "--resume", "--set", "method.lr=0.2", "--set", "seed=7"])
    assert "method.lr (was 0.1, now 0.2)" in err and "seed (was 41, now 7)" in err
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    err = _fails(capsys, ["run", *tiny, "--out", str(other), "--resume"])
    assert "no config.json" in err and (other / "notes.txt").read_text() == "mine"
    err = _fails(capsys, ["run", *tiny, "--out", str(tmp_path / "never"), "--resume"])
    assert "drop --resume" in err


def test_a_run_written_before_a_field_existed_still_resumes(tmp_path, capsys, tiny):
    """A config saved by an older fedtailor lacks the fields added since; at their defaults they are no
    difference, given another value they are."""
    out = tmp_path / "run"
    assert main(["run", *tiny, "--out", str(out), "--no-progress", "--no-plots", "--stop-after", "1"]) == 0
    saved = json.loads((out / "config.json").read_text())
    del saved["data"]["max_length"], saved["method"]["momentum"]  # as if written before these fields existed
    (out / "config.json").write_text(json.dumps(saved))
    err = _fails(capsys, ["run", *tiny, "--out", str(out), "--resume", "--set", "data.max_length=32"])
    assert "data.max_length (was None, now 32)" in err and "momentum" not in err
    assert main(["run", *tiny, "--out", str(out), "--no-progress", "--no-plots", "--resume"]) == 0
    assert json.loads((out / "results.json").read_text())["rounds_completed"] == 4


def test_divergence_is_an_error_not_a_result(tmp_path, capsys, tiny):
    """A diverging run writes no results and exits with its own status, 3 (a usage error's is 2), so that
    ``fedtailor reproduce`` can record it as the run's outcome."""
    out = tmp_path / "run"
    err = _fails(capsys, ["run", *tiny, "--out", str(out), "--no-progress", "--set", "method.lr=1e12"], code=3)
    assert "diverged" in err and "round 1" in err and "method.lr" in err
    assert not (out / "results.json").exists()


def test_a_private_run_with_a_huge_sigma_is_stopped_and_files_stay_valid_json(tmp_path, capsys):
    out = tmp_path / "run"  # round 1 has no evaluation, so it is recorded; round 2's evaluation diverges
    err = _fails(
        capsys,
        [
            "run",
            "--out",
            str(out),
            "--no-progress",
            *[f"--set={s}" for s in COMPACT_SMALL],
            "--set",
            "method.privacy.epsilon=0.0001",
            "--set",
            "federation.eval_every=2",
            "--set",
            "federation.checkpoint_every=1",
        ],
        code=3,
    )
    assert "diverged" in err and "epsilon" in err and "round 2" in err
    for line in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # strict JSON (no bare NaN)
    assert not (out / "results.json").exists()


@pytest.mark.parametrize("damage", [b"", b"garbage" * 10, "truncate"])
def test_a_damaged_checkpoint_is_named_and_the_history_is_kept(tmp_path, capsys, tiny, damage):
    out = tmp_path / "run"
    assert main(["run", *tiny, "--out", str(out), "--no-progress", "--no-plots", "--stop-after", "2"]) == 0
    ckpt, metrics = out / "checkpoint.pt", out / "metrics.jsonl"
    before = metrics.read_text()
    ckpt.write_bytes(ckpt.read_bytes()[:100] if damage == "truncate" else damage)
    err = _fails(capsys, ["run", *tiny, "--out", str(out), "--no-progress", "--resume"])
    assert "checkpoint.pt" in err and "unreadable" in err and "Delete it" in err
    assert metrics.read_text() == before  # nothing was truncated before the checkpoint was read
    ckpt.unlink()  # the documented way out: restart from round 0 in the same directory
    assert main(["run", *tiny, "--out", str(out), "--no-progress", "--no-plots", "--resume"]) == 0


def test_ctrl_c_says_where_to_resume_and_the_resumed_run_matches(tmp_path, capsys, tiny, monkeypatch):
    import fedtailor.fl.loop as loop

    full, part = tmp_path / "full", tmp_path / "part"
    assert main(["run", *tiny, "--out", str(full), "--no-progress", "--no-plots"]) == 0
    real = loop._fit_round

    def interrupt_at_3(method, state, clients, rnd, selected):
        if rnd == 3:
            raise KeyboardInterrupt
        return real(method, state, clients, rnd, selected)

    monkeypatch.setattr(loop, "_fit_round", interrupt_at_3)
    err = _fails(capsys, ["run", *tiny, "--out", str(part), "--no-progress"], code=130)
    assert "round 3" in err and "checkpoint is at round 2" in err and f"--resume --out {part}" in err
    monkeypatch.setattr(loop, "_fit_round", real)
    assert main(["run", *tiny, "--out", str(part), "--no-progress", "--no-plots", "--resume"]) == 0
    a, b = (json.loads((d / "results.json").read_text()) for d in (full, part))
    assert a["per_client"] == b["per_client"]


def test_ordinary_mistakes_are_one_line(tmp_path, capsys, tiny):
    (tmp_path / "adir").mkdir()
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    (tmp_path / "bad.json").write_text("{nope")
    (tmp_path / "afile").write_text("x")
    np.save(tmp_path / "empty.npy", np.array([]))
    np.save(tmp_path / "scalar.npy", np.array(3.0))
    np.save(tmp_path / "text.npy", np.array(["a", "b"]))
    np.save(tmp_path / "big.npy", np.ones((1, 1000)))
    codec = [
        "codec",
        "roundtrip",
        "--codec",
        "lrsuq",
        "--sigma",
        "0.1",
        "--seed",
        "1",
        "--out",
        str(tmp_path / "o.npz"),
    ]
    cases = {
        "is a directory": ["run", str(tmp_path / "adir")],
        "not valid YAML (line 2": ["run", str(tmp_path / "bad.yaml")],
        "not valid JSON": ["run", str(tmp_path / "bad.json")],
        "is a file, not a directory": ["run", *tiny, "--out", str(tmp_path / "afile")],
        "cannot create the run directory": ["run", *tiny, "--out", str(tmp_path / "afile" / "run")],
        "unknown device 'tpu'": ["run", *tiny, "--set", 'device="tpu"', "--out", str(tmp_path / "d")],
        "shape (0,)": [*codec, "--input", str(tmp_path / "empty.npy")],
        "shape ()": [*codec, "--input", str(tmp_path / "scalar.npy")],
        "expected real numbers": [*codec, "--input", str(tmp_path / "text.npy")],
        "clip u to the codec's clip": [*codec[:3], "ppr", *codec[4:], "--input", str(tmp_path / "big.npy")],
        "no values": ["sweep", *tiny, "--grid", "method.lr=", "--out", str(tmp_path / "sw"), "--seeds", "1"],
    }
    for expected, argv in cases.items():
        assert expected in _fails(capsys, argv), expected
    assert not (tmp_path / "d").exists()
    with pytest.raises(SystemExit) as exc:  # argparse's own check of a numeric option
        main(["codec", "bench", "--releases", "0"])
    assert exc.value.code == 2 and "--releases: must be >= 1" in capsys.readouterr().err


def test_report_on_a_run_without_evaluated_clients(tmp_path, capsys, tiny):
    out = tmp_path / "run"
    assert main(["run", *tiny, "--out", str(out), "--no-progress", "--no-plots"]) == 0
    results = json.loads((out / "results.json").read_text())
    results["per_client"], results["summary"] = [], {}
    (out / "results.json").write_text(json.dumps(results))
    capsys.readouterr()
    assert main(["report", str(out), "--no-plots"]) == 0
    assert "no client was evaluated" in capsys.readouterr().out
    (out / "results.json").write_text("{truncated")
    assert "not valid JSON" in _fails(capsys, ["report", str(out)])


def test_a_sweep_validates_every_point_before_running_any(tmp_path, capsys, tiny):
    out = tmp_path / "sw"
    err = _fails(capsys, ["sweep", *tiny, "--grid", "method.lr=0.1,-1", "--out", str(out), "--seeds", "1,2"])
    assert "lr=-1" in err and "method.lr" in err
    assert not any(out.rglob("results.json"))
    err = _fails(capsys, ["sweep", *tiny, "--grid", "data.dataset=digits,nope", "--out", str(out), "--seeds", "1"])
    assert "unknown dataset 'nope'" in err and not any(out.rglob("config.json"))


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("prop")
    cfg = base / "tiny.toml"
    cfg.write_text(TINY_TOML)
    out = base / "run"
    assert main(["run", str(cfg), "--out", str(out), "--no-progress", "--no-plots", "--stop-after", "1"]) == 0
    return cfg, out


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blob=st.binary(max_size=300))
def test_random_bytes_never_produce_a_traceback(blob, stopped_run, tmp_path_factory, capsys):
    """Random bytes as a checkpoint, a config file (TOML, YAML, JSON) or a codec input: exit code 2, one line."""
    cfg, src = stopped_run
    work = tmp_path_factory.mktemp("case")
    run = work / "run"
    shutil.copytree(src, run)
    (run / "checkpoint.pt").write_bytes(blob)
    _fails(capsys, ["run", str(cfg), "--out", str(run), "--no-progress", "--resume"])
    for suffix in (".toml", ".yaml", ".json"):
        path = work / f"c{suffix}"
        path.write_bytes(blob)
        # a blob that happens to be a valid config still fails fast on the unknown dataset: nothing is trained
        _fails(capsys, ["run", str(path), "--set", 'data.dataset="nope"', "--out", str(work / "x")])
    (work / "u.npy").write_bytes(blob)
    _fails(
        capsys,
        [
            "codec",
            "roundtrip",
            "--sigma",
            "0.1",
            "--seed",
            "1",
            "--input",
            str(work / "u.npy"),
            "--out",
            str(work / "o.npz"),
        ],
    )


@pytest.mark.parametrize("name", ["../../etc", "a/b", "..", ".hidden", ""])
def test_a_run_name_that_is_not_one_plain_path_component_is_refused(tmp_path, capsys, tiny, monkeypatch, name):
    """``name`` becomes the run directory OUT_DIR/NAME-seedSEED: it must not climb out of OUT_DIR."""
    monkeypatch.chdir(tmp_path)
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    err = _fails(capsys, ["run", *tiny, "--no-progress", "--set", f'name="{name}"', "--set", f'out_dir="{work}"'])
    assert err.startswith("fedtailor run: error: invalid config: name: must be a plain name")
    assert repr(name) in err
    assert not any(tmp_path.rglob("config.json"))


def test_a_sweep_grid_value_with_a_path_in_it_stays_inside_the_sweep_directory(tmp_path, capsys, tiny):
    out = tmp_path / "a" / "b" / "sw"
    assert (
        main(
            ["sweep", *tiny, "--grid", "out_dir=../../../escaped,x", "--out", str(out), "--seeds", "1", "--no-progress"]
        )
        == 0
    )
    results = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("results.json"))
    assert len(results) == 2 and all(p.parts[:3] == ("a", "b", "sw") and len(p.parts) == 6 for p in results)
    assert not (tmp_path / "a" / "b" / "escaped").exists()


def _refused(capsys, argv: list[str]) -> str:
    """Like :func:`_fails` for argparse's own checks too (they raise SystemExit(2))."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, (code, err)
    return err


CALIBRATE = ["privacy", "calibrate", "--eps", "16", "--seed", "41"]
PARTITION = ["partition", "--dataset", "digits", "--seed", "1", "--clients", "5", "--context-size", "10"]
IMPOSSIBLE = {  # argv (TINY stands for the tiny config) -> what the one line must say
    "jobs 0": (["reproduce", "--jobs", "0", "--list"], "argument --jobs: must be >= 1, got 0"),
    "jobs -2": (["reproduce", "--jobs", "-2", "--list"], "argument --jobs: must be >= 1, got -2"),
    "stop-after 0": (["run", "TINY", "--stop-after", "0"], "argument --stop-after: must be >= 1, got 0"),
    "seeds reversed": (["sweep", "TINY", "--seeds", "45-41", "--out", "OUT"], "--seeds: the range '45-41' is empty"),
    "seeds twice": (["sweep", "TINY", "--seeds", "41,42,41", "--out", "OUT"], "gives seed 41 more than once"),
    "grid value twice": (
        ["sweep", "TINY", "--grid", "method.lr=0.1,0.1", "--out", "OUT", "--seeds", "1"],
        "lists 0.1 more than once",
    ),
    "grid key twice": (
        ["sweep", "TINY", "--grid", "method.lr=0.1", "--grid", "method.lr=0.2", "--out", "OUT", "--seeds", "1"],
        "--grid method.lr is given twice",
    ),
    "grid seed": (["sweep", "TINY", "--grid", "seed=1,2", "--out", "OUT"], "--grid seed=...: a sweep takes its seeds"),
    "set seed": (["sweep", "TINY", "--set", "seed=3", "--out", "OUT"], "--set seed=...: a sweep takes"),
    "rounds -5": ([*CALIBRATE, "--rounds", "-5"], "argument --rounds: must be >= 1, got -5"),
    "rounds 0": ([*CALIBRATE, "--rounds", "0"], "argument --rounds: must be >= 1, got 0"),
    "clients 0": ([*CALIBRATE, "--clients", "0"], "argument --clients: must be >= 1"),
    "eps 0": (["privacy", "calibrate", "--eps", "0", "--seed", "1"], "argument --eps: must be a finite"),
    "eps -1": (["privacy", "calibrate", "--eps", "-1", "--seed", "1"], "argument --eps: must be a finite"),
    "eps inf": (["privacy", "calibrate", "--eps", "inf", "--seed", "1"], "argument --eps: must be a finite"),
    "delta 1": ([*CALIBRATE, "--delta", "1"], "argument --delta: must lie strictly between 0 and 1, got 1"),
    "delta 0": ([*CALIBRATE, "--delta", "0"], "argument --delta: must lie strictly between 0 and 1, got 0"),
    "per-round > clients": ([*CALIBRATE, "--per-round", "50"], "--per-round 50 exceeds --clients 40"),
    "context-size 0": ([*CALIBRATE, "--context-size", "0"], "argument --context-size: must be >= 1"),
    "batch-size 0": ([*CALIBRATE, "--batch-size", "0"], "argument --batch-size: must be >= 1"),
    "clip inf": ([*CALIBRATE, "--clip", "inf"], "argument --clip: must be a finite number > 0"),
    "unseen = clients": ([*PARTITION, "--unseen", "5"], "--unseen 5 must be smaller than --clients 5"),
    "alpha 0": ([*PARTITION, "--alpha", "0"], "argument --alpha: must be a finite number > 0"),
    "eval-fraction 1.5": (
        [*PARTITION, "--eval-fraction", "1.5"],
        "argument --eval-fraction: must lie strictly between 0 and 1",
    ),
    "max-rows 0": ([*PARTITION, "--max-rows", "0"], "argument --max-rows: must be >= 1, got 0"),
    "partition clients 0": ([*PARTITION, "--clients", "0"], "argument --clients: must be >= 1, got 0"),
    "sigma inf": (
        ["codec", "roundtrip", "--sigma", "inf", "--seed", "1", "--input", "u.npy", "--out", "o.npz"],
        "argument --sigma: must be a finite number > 0",
    ),
    "norm inf": (["codec", "bench", "--norm", "inf"], "argument --norm: must be a finite number > 0"),
}


@pytest.mark.parametrize("case", sorted(IMPOSSIBLE))
def test_an_impossible_flag_value_is_one_line_naming_the_flag(tmp_path, capsys, tiny, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    argv, expected = IMPOSSIBLE[case]
    argv = [tiny[0] if a == "TINY" else str(tmp_path / "out") if a == "OUT" else a for a in argv]
    assert expected in _refused(capsys, argv)
    assert not (tmp_path / "out").exists()


_INTERRUPT_WHILE_IMPORTING = """
import importlib.abc, os, signal, sys, time

MODULE = sys.argv[1]
# a terminal's Ctrl-C: a test run started as a background job inherits SIGINT ignored, and Python then keeps it so
signal.signal(signal.SIGINT, signal.default_int_handler)


class Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == MODULE:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C arrives while this module is being imported
            time.sleep(60)
        return None


sys.meta_path.insert(0, Interrupt())
sys.argv = ["fedtailor", *sys.argv[2:]]
from fedtailor.cli import main  # what the console script runs
sys.exit(main())
"""


@pytest.mark.parametrize("module", ["numpy", "torch", "fedtailor.fl.loop"])
def test_ctrl_c_while_fedtailor_is_still_importing_is_one_line(tmp_path, tiny, module):
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _INTERRUPT_WHILE_IMPORTING, module, "run", *tiny, "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 130 and re.fullmatch(r"fedtailor( run)?: interrupted\.", run.stderr.strip()), (
        run.returncode,
        run.stderr,
    )
    assert not (tmp_path / "run").exists()


def test_calibrating_a_hundred_million_rounds_finishes(tmp_path):
    """The schedule's counts are exact without sampling it round by round in Python (that took half an hour
    and 1.6 GB); a run long enough to notice says how long it takes."""
    import subprocess
    import sys

    argv = ["privacy", "calibrate", "--eps", "16", "--seed", "41", "--rounds", "100000000", "--json"]
    run = subprocess.run(
        [sys.executable, "-m", "fedtailor", *argv], capture_output=True, text=True, check=False, timeout=600
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert report["t_mean"] == 5_000_000 and report["t_min"] < 5_000_000 < report["t_max"] < 5_020_000
    assert all(
        line.startswith("fedtailor privacy calibrate: sampling the 100,000,000-round schedule")
        for line in run.stderr.splitlines()
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("hub", ["offline flag", "no answer", "hub error"])
def test_the_shipped_pfeddpo_config_without_its_data_file_names_the_file_and_the_fix(
    tmp_path, capsys, monkeypatch, hub
):
    """No local HH-RLHF file and no hub (no network here): one line naming the local path, data.dataset and
    where the file comes from, at once (the hub's retries are not waited for)."""
    datasets = pytest.importorskip("datasets")
    import fedtailor.lm.setup as lm_setup

    monkeypatch.setattr(lm_setup, "shared_data_file", lambda *parts: None)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    calls = []

    def hub_load(*args, **kwargs):  # what datasets raises offline, after its retries
        calls.append(args)
        raise ConnectionError("Couldn't reach 'Anthropic/hh-rlhf' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", hub_load)
    if hub == "offline flag":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    elif hub == "no answer":  # a hub endpoint that refuses the connection
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_free_port()}")
    else:
        monkeypatch.setattr(lm_setup, "_hub_unreachable", lambda: None)
    config = str(Path(__file__).resolve().parents[1] / "configs" / "pfeddpo" / "hh-rlhf.toml")
    err = _fails(capsys, ["run", config, "--out", str(tmp_path / "run"), "--no-progress"])
    local = f"{lm_setup.shared_data_roots()[0] / 'hh-rlhf-harmless-base' / 'test.jsonl.gz'}"
    assert err.startswith("fedtailor run: error: data.dataset 'hh-rlhf': no local copy at " + local)
    assert "Anthropic/hh-rlhf" in err and "harmless-base/test.jsonl.gz" in err
    assert "--set 'data.dataset=\"hh-rlhf:/path/to/test.jsonl.gz\"'" in err
    assert {
        "offline flag": "HF_HUB_OFFLINE is set",
        "no answer": "did not answer",
        "hub error": "ConnectionError: Couldn't reach",
    }[hub] in err
    assert len(calls) == (hub == "hub error") and not (tmp_path / "run").exists()
    err = _fails(
        capsys,
        [
            "run",
            config,
            "--out",
            str(tmp_path / "run"),
            "--set",
            f'data.dataset="hh-rlhf:{tmp_path / "nope.jsonl.gz"}"',
        ],
    )
    assert "data.dataset 'hh-rlhf:" in err and "nope.jsonl.gz is not a file" in err


def test_a_finite_but_absurd_loss_is_divergence_too(tmp_path, capsys, tiny):
    """FedPer at lr 1e6 (the issue's case): its first round's loss is about 8e24, finite; the run stops as
    diverged, with no results and no directory (no checkpoint had been written)."""
    out = tmp_path / "run"
    sets = ['method.name="fedper"', "method.lr=1e6", 'method.model="dnn"', 'data.dataset="mnist-5k"', "data.limit=600"]
    err = _fails(capsys, ["run", *tiny, "--out", str(out), "--no-progress", *[f"--set={s}" for s in sets]], code=3)
    assert "round 1" in err and "loss" in err and "diverged" in err and "method.lr" in err
    assert not out.exists()


def test_the_divergence_rule_stops_at_a_loss_past_the_limit_and_nowhere_else():
    from fedtailor.fl.records import LOSS_LIMIT, TrainingDiverged, check_diverged, diverged_keys

    sane = {
        "round": 3,
        "loss": 41.7,
        "seen/loss": 0.5 * LOSS_LIMIT,
        "kappa2": 10 * LOSS_LIMIT,
        "uplink_bytes": 10**12,
        "clients": [1, 2],
        "rejected": 0,
    }
    assert diverged_keys(sane) == []
    check_diverged(sane, 3, "training")
    assert diverged_keys({**sane, "loss": 2.4e24, "seen/loss": float("nan")}) == ["loss", "seen/loss"]
    with pytest.raises(TrainingDiverged, match=r"round 3: evaluation gave future/loss = 2e\+06 \(a loss"):
        check_diverged({"future/loss": 2 * LOSS_LIMIT, "future/accuracy": 0.1}, 3, "evaluation")


def test_a_run_directory_made_from_the_config_is_not_called_out(tmp_path, capsys, tiny):
    """Without --out the run directory comes from out_dir and name: the message says so, not '--out'."""
    (tmp_path / "tiny-seed41").write_text("mine")
    err = _fails(capsys, ["run", *tiny, "--set", f'out_dir="{tmp_path}"', "--no-progress"])
    where = tmp_path / "tiny-seed41"
    assert f"the run directory {where} (the config's out_dir/NAME-seedSEED) is a file" in err
    assert (tmp_path / "tiny-seed41").read_text() == "mine"
