"""The run-directory module: its schema, slugs, what it writes reads back, and the finished check's rounds rule
(its config rule: tests/test_reproduce.py)."""

from __future__ import annotations

import json

import pytest

from fedtailor import rundir


def _results(**change) -> rundir.Results:
    results: rundir.Results = {
        "name": "r",
        "method": "fedavg",
        "dataset": "digits",
        "seed": 1,
        "rounds_completed": 2,
        "rounds": 2,
        "summary": {"seen/accuracy": float("nan")},
        "per_client": [{"client": 0, "seen": True, "accuracy": 0.5, "num_examples": 4}],
    }
    return {**results, **change}


def test_the_required_keys_are_the_schemas():
    assert set(rundir.REQUIRED) == rundir.Results.__required_keys__


def test_slugs_are_one_path_component():
    assert rundir.slug(()) == "base"
    assert rundir.slug((("method.lr", "0.1"), ("method.variant", '"ours-dg"'))) == "lr=0.1_variant=ours-dg"
    odd = rundir.slug((("out_dir", "../../x"),))
    assert "/" not in odd and odd.startswith("out_dir=.._.._x-") and odd != rundir.slug((("out_dir", ".._.._x"),))
    assert rundir.point_dir(rundir.Path("o"), (("method.lr", "1"),), 41) == rundir.Path("o/lr=1/seed41")


def test_what_is_written_reads_back(tmp_path):
    rundir.write_results(tmp_path, _results())
    rundir.write_metrics(tmp_path, [{"round": 1, "loss": float("inf")}])
    rundir.append_metrics(tmp_path, {"round": 2, "loss": 0.5})
    got = rundir.read_results(tmp_path)
    assert got["summary"] == {"seen/accuracy": None}  # NaN is no JSON: written as null
    assert rundir.read_metrics(tmp_path) == [{"round": 1, "loss": None}, {"round": 2, "loss": 0.5}]
    assert rundir.read_clients(tmp_path) == [{"client": "0", "seen": "True", "accuracy": "0.5", "num_examples": "4"}]
    assert rundir.completed(tmp_path)
    with pytest.raises(ValueError, match="lack seed"):
        rundir.write_results(tmp_path, {k: v for k, v in _results().items() if k != "seed"})


def test_a_reader_names_what_a_file_lacks(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no results.json"):
        rundir.read_results(tmp_path)
    (tmp_path / rundir.RESULTS).write_text(json.dumps({"rounds": 2, "rounds_completed": 1}))
    with pytest.raises(ValueError, match="lacks name, method, dataset, seed, summary, per_client"):
        rundir.read_results(tmp_path)
    assert rundir.read_results(tmp_path, require=("rounds",))["rounds"] == 2  # a reader that needs less
    assert not rundir.completed(tmp_path)  # one round of two
    (tmp_path / rundir.METRICS).write_text('{"round": 1}\n{trunc')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        rundir.read_metrics(tmp_path)
