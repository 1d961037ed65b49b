"""``fedtailor privacy calibrate`` (the CLI module lives in fedtailor/cli/privacy.py)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from fedtailor.cli import privacy as privacy_cli
from fedtailor.privacy.accountant import CONVERSIONS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedtailor")
    privacy_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    args = _parser().parse_args(argv)
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_calibrate_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = "privacy calibrate --eps 16 --delta 1e-5 --rounds 500 --clients 40 --per-round 2 --seed 41 --json"
    report = json.loads(_run(argv.split(), capsys))
    assert report["t_max"] == 36
    d = 2 / 333
    assert report["context_sensitivity"] == pytest.approx(d) and report["gradient_sensitivity"] == pytest.approx(d)
    rows = {r["calibrated_with"]: r for r in report["calibrations"]}
    assert list(rows) == list(CONVERSIONS)
    # the closed form written out independently of the package: rho* = (sqrt(L + eps) - sqrt(L))^2, L = log(1/delta)
    log_inv = math.log(1e5)
    rho_star = (math.sqrt(log_inv + 16) - math.sqrt(log_inv)) ** 2
    assert rows["closed-form"]["sigma"] == pytest.approx(math.sqrt(37 * d**2 / (2 * rho_star)), rel=1e-9)
    for conv, row in rows.items():
        assert row["eps"][conv] == pytest.approx(16.0, rel=1e-9)
    # At the closed-form sigma the tighter conversions report less; at the exact sigma the looser report more.
    assert rows["closed-form"]["eps"]["exact"] < rows["closed-form"]["eps"]["balle"] < 16.0
    assert rows["exact"]["eps"]["closed-form"] > rows["exact"]["eps"]["balle"] > 16.0


def test_calibrate_table_and_options(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(
        [
            "privacy",
            "calibrate",
            "--eps",
            "4",
            "--seed",
            "43",
            "--context-size",
            "100",
            "--batch-size",
            "200",
            "--clip",
            "0.5",
        ],
        capsys,
    )
    assert "T_max = 34" in out
    assert "| calibrated with | sigma | eps (closed-form) | eps (balle) | eps (exact) |" in out
    # the options must reach the sensitivities: Delta_c = 2/100, Delta_g = 2 * 0.5/200 (closed form by hand)
    log_inv = math.log(1e5)
    rho_star = (math.sqrt(log_inv + 4) - math.sqrt(log_inv)) ** 2
    sigma = math.sqrt((0.02**2 + 34 * 0.005**2) / (2 * rho_star))
    assert f"| closed-form | {sigma:.6f} | 4.0000 |" in out


def test_bad_arguments_exit_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["privacy", "calibrate", "--eps", "-1", "--seed", "1"])
    assert "argument --eps: must be a finite number > 0, got -1" in capsys.readouterr().err
    args = _parser().parse_args(["privacy", "calibrate", "--eps", "1", "--seed", "1", "--per-round", "50"])
    with pytest.raises(ValueError, match="--per-round 50 exceeds --clients 40"):
        args.func(args)
