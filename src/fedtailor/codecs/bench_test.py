"""The shared measuring function behind benchmarks/bench_codecs.py and ``fedtailor codec bench``."""

from __future__ import annotations

import math

import pytest

from fedtailor.codecs.bench import DEFAULT_SPECS, bench_codecs, bench_notes, gaussian_floor_bpc, markdown


def test_floor_formula() -> None:
    # 0.5 log2(1 + 1 / (16384 * 0.01468^2)) = 0.180 bpc (expected: about 0.18).
    assert gaussian_floor_bpc(norm=1.0, k=16384, sigma=0.01468) == pytest.approx(0.1800, abs=5e-4)
    assert gaussian_floor_bpc(norm=0.0, k=10, sigma=1.0) == 0.0


def test_bench_rows_cover_every_codec_with_sane_figures() -> None:
    # Per-coordinate scale of the eps = 16 regime (||u|| = 1 at k = 16,384) at a smaller k.
    rows = bench_codecs(k=2048, norm=math.sqrt(2048 / 16384), releases=2, seed=1)
    assert [r["codec"] for r in rows] == [label for label, _, _ in DEFAULT_SPECS]
    by = {r["codec"]: r for r in rows}
    frame_bpc = 8 * 26 / 2048
    assert by["DG FP32"]["bpc"] == pytest.approx(32 + frame_bpc)
    assert by["DG+Q12"]["bpc"] == pytest.approx(12 + frame_bpc + 8 * 16 / 2048, abs=0.01)
    for label in ("LRSUQ Z^4 (elias)", "LRSUQ Z^4 (ans)", "layered b=1 (ans)", "LRSUQ D4 (ans)", "PPR b=4 (default)"):
        assert by[label]["bpc"] < 2.0 + frame_bpc
    for r in rows:  # every codec releases u + noise of scale sigma (Q12 adds a little quantisation error)
        assert abs(float(r["rms error / sigma"]) - 1.0) < 0.1
    table = markdown(rows)
    assert table.count("\n") == len(rows) + 2 and "| codec | bpc |" in table
    assert "0.180 bpc" in bench_notes()
    ans = by["LRSUQ Z^4 (ans)"]
    assert float(ans["bits vs first"]) == pytest.approx(ans["bpc"] / rows[0]["bpc"], rel=1e-3)
    assert float(ans["bits vs first"]) < 0.07
    assert by["DG FP32"]["target"] == "encode <= 1 ms" and by["LRSUQ Z^4 (ans)"]["target"] == "enc+dec <= 5 ms"
    assert by["DG FP32 (simulation noise)"]["target"] == "" and by["DG+Q12"]["meets target"] == ""
    assert by["DG FP32"]["meets target"] in ("yes", "no")
    assert by["PPR b=4 (default)"]["target"] == "enc+dec <= 13.97 ms"
