"""``fedtailor codec roundtrip`` and ``fedtailor codec bench`` end to end through the CLI entry point."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedtailor.cli import main
from fedtailor.codecs import get_codec, release_key


def test_roundtrip_writes_decoded_rows_and_bit_lengths(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    u = np.random.default_rng(0).normal(0, 0.01, (4, 130))
    np.save(tmp_path / "u.npy", u)
    out = tmp_path / "out.npz"
    rc = main(
        [
            "codec",
            "roundtrip",
            "--codec",
            "lrsuq",
            "--coder",
            "ans",
            "--sigma",
            "0.02",
            "--input",
            str(tmp_path / "u.npy"),
            "--seed",
            "7",
            "--client",
            "3",
            "--out",
            str(out),
        ]
    )
    assert rc == 0 and "bits per coefficient" in capsys.readouterr().out
    z = np.load(out)
    codec = get_codec("lrsuq", coder="ans")
    for r in range(4):
        key = release_key(7, 3, r)
        msg = codec.encode(u[r], key=key, sigma=0.02)
        np.testing.assert_array_equal(z["decoded"][r], codec.decode(msg, key=key, sigma=0.02, dim=130))
        assert z["bits"][r] == 8 * len(msg) and int(str(z["keys"][r]), 16) == key
    assert str(z["codec"]) == "lrsuq" and float(z["sigma"]) == 0.02


@pytest.mark.parametrize("coder", [None, "elias"])
def test_ppr_roundtrip_uses_the_index_code_asked_for(tmp_path: Path, coder: str | None) -> None:
    """PPR's index code: ans unless --coder says otherwise (the messages equal the codec's own, bit for bit)."""
    u = np.random.default_rng(1).normal(0, 0.01, (2, 64))
    np.save(tmp_path / "u.npy", u)
    out = tmp_path / "out.npz"
    args = ["codec", "roundtrip", "--codec", "ppr", "--sigma", "0.05", "--input", str(tmp_path / "u.npy")]
    args += ["--seed", "7", "--out", str(out)] + (["--coder", coder] if coder else [])
    assert main(args) == 0
    z = np.load(out)
    codec = get_codec("ppr", coder=coder or "ans")
    for r in range(2):
        key = release_key(7, 0, r)
        msg = codec.encode(u[r], key=key, sigma=0.05)
        assert z["bits"][r] == 8 * len(msg)
        np.testing.assert_array_equal(z["decoded"][r], codec.decode(msg, key=key, sigma=0.05, dim=64))


def test_roundtrip_reports_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    np.save(tmp_path / "bad.npy", np.zeros((2, 3, 4)))
    rc = main(
        [
            "codec",
            "roundtrip",
            "--codec",
            "dg-fp32",
            "--sigma",
            "1",
            "--input",
            str(tmp_path / "bad.npy"),
            "--seed",
            "1",
            "--out",
            str(tmp_path / "o.npz"),
        ]
    )
    assert rc == 2 and "shape (n, d)" in capsys.readouterr().err
    rc = main(
        [
            "codec",
            "roundtrip",
            "--sigma",
            "1",
            "--input",
            str(tmp_path / "missing.npy"),
            "--seed",
            "1",
            "--out",
            str(tmp_path / "o.npz"),
        ]
    )
    assert rc == 2 and "not found" in capsys.readouterr().err


def test_bench_prints_the_table(capsys: pytest.CaptureFixture) -> None:
    assert main(["codec", "bench", "--k", "1024", "--releases", "2"]) == 0
    text = capsys.readouterr().out
    for label in ("DG FP32", "DG+Q12", "layered b=1 (elias)", "LRSUQ Z^4 (elias)", "LRSUQ Z^4 (ans)"):
        assert f"| {label} |" in text
    assert "Floor I(u; u+e)" in text
