"""The docs' generated regions equal what ``scripts/docs_tables.py`` renders from the committed result files, and
the checker catches a tampered number, a tampered source and malformed markers (pure file reading)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "scripts/docs_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


docs_tables = _load()


@pytest.mark.parametrize("doc", docs_tables.DOCS)
def test_every_generated_region_matches_its_sources(doc: str) -> None:
    assert docs_tables.sync(ROOT / doc, ROOT, write=False) == [], f"run: python scripts/docs_tables.py ({doc})"


def test_the_main_tables_are_generated() -> None:
    keys = {key for doc in docs_tables.DOCS for key, _, _ in docs_tables.regions((ROOT / doc).read_text(), doc)}
    assert keys == set(docs_tables.RENDERERS)  # every renderer is used somewhere


def _copy_tree(tmp_path: Path) -> Path:
    """The committed sources and the docs, copied so that either can be tampered with."""
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", root / "docs", ignore=shutil.ignore_patterns("*.png", "*.html"))
    (root / "benchmarks").mkdir()
    shutil.copy(ROOT / "benchmarks/RESULTS.md", root / "benchmarks/RESULTS.md")
    shutil.copy(ROOT / "README.md", root / "README.md")
    return root


def test_a_tampered_number_in_a_doc_is_caught_and_rewritten(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path)
    doc = root / "docs/RESULTS.md"
    text = doc.read_text()
    assert "| Ours-DG | 88.23 +- 0.87 | 81.40 +- 3.98 |" in text
    doc.write_text(
        text.replace("| Ours-DG | 88.23 +- 0.87 | 81.40 +- 3.98 |", "| Ours-DG | 88.23 +- 0.87 | 81.41 +- 3.98 |")
    )
    assert docs_tables.sync(doc, root, write=False) == ["compact-table1"]
    assert docs_tables.sync(doc, root, write=True) == ["compact-table1"]
    assert doc.read_text() == text  # the rewrite restores the source's number and nothing else


def test_a_tampered_source_makes_the_doc_stale(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path)
    csv_path = root / "docs/results/compact-controls-mnist/table.csv"
    csv_path.write_text(csv_path.read_text().replace("90.10714285714286", "90.2"))
    assert docs_tables.sync(root / "docs/RESULTS.md", root, write=False) == ["compact-controls"]


def test_per_seed_values_must_agree_with_the_table(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path)
    seeds = root / "docs/results/compact-table1-mnist/seeds.csv"
    seeds.write_text(seeds.read_text().replace("ours-dg,42,87.24", "ours-dg,42,87.54"))
    with pytest.raises(docs_tables.SourceError, match="seeds.csv: ours-dg seen_accuracy"):
        docs_tables.sync(root / "docs/RESULTS.md", root, write=False)


def test_malformed_markers_are_errors(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- generated: no-such-table -->\n<!-- end generated -->\n")
    with pytest.raises(docs_tables.RegionError, match="no renderer 'no-such-table'"):
        docs_tables.sync(doc, ROOT, write=False)
    doc.write_text("<!-- generated: compact-controls -->\n| x |\n")
    with pytest.raises(docs_tables.RegionError, match="never closed"):
        docs_tables.sync(doc, ROOT, write=False)


def test_check_mode_names_file_and_region_and_exits_1(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("before\n<!-- generated: pfeddpo-hh-v1 -->\n| stale |\n<!-- end generated -->\nafter\n")
    script = str(ROOT / "scripts/docs_tables.py")
    check = subprocess.run([sys.executable, script, "--check", str(doc)], capture_output=True, text=True)
    assert check.returncode == 1
    assert f"{doc}: region pfeddpo-hh-v1 differs from its sources" in check.stdout
    assert "| stale |" in doc.read_text()  # --check writes nothing
    subprocess.run([sys.executable, script, str(doc)], check=True, capture_output=True)
    assert "| pFedDPO | 1.000 | **0.620** |" in doc.read_text()
    assert doc.read_text().startswith("before\n") and doc.read_text().endswith("after\n")
    assert subprocess.run([sys.executable, script, "--check", str(doc)], capture_output=True).returncode == 0


def test_a_new_ppr_benchmark_run_restates_the_target_verdict(tmp_path: Path) -> None:
    """The PPR region follows the latest run of ``bench_ppr.py``; a slower b = 8 argmin row turns the verdict, and
    a curve without its b = 20 points stops short of the 0.35 stretch."""
    root = _copy_tree(tmp_path)
    results = root / "benchmarks/RESULTS.md"
    text = results.read_text()
    latest = text[text.rindex("## " + docs_tables.PPR_SIDE) :]
    end = latest.find("\n## ", latest.index(docs_tables.PPR_CURVE))
    latest = latest if end < 0 else latest[:end]
    slower = re.sub(r"^(\| 8 \| inf \| 2\.5 \|(?: [\d.]+ \|){6}) [\d.]+ \|", r"\1 15.5 |", latest, flags=re.M)
    slower, cut = re.subn(r"^\| 20 \|.*\n", "", slower, flags=re.M)
    assert slower != latest and cut == 2
    results.write_text(text + "\n" + slower.replace("- date: ", "- date: 2099-01-01 "))
    doc = root / "docs/codecs.md"
    assert docs_tables.sync(doc, root, write=False) == ["bench-ppr"]
    docs_tables.sync(doc, root, write=True)
    assert "15.5 ms: **not met** on this machine; the curve stops short of 0.35 bpc" in doc.read_text()


def test_an_ablation_fills_in_once_its_tables_land(tmp_path: Path) -> None:
    """``pfeddpo-ablations``: an experiment without a folder reads "0 of 3"; once its table.csv and paired.csv are
    committed its points show their means over seeds and each paper claim on them with its verdict."""
    root = _copy_tree(tmp_path)
    shutil.rmtree(root / "docs/results/pfeddpo-rank", ignore_errors=True)
    before = docs_tables.pfeddpo_ablations_seeds(root)
    assert "| rank 2 | pFedDPO | 0 of 3 | - | - | - | - | - |" in before
    folder = root / "docs/results/pfeddpo-rank"
    folder.mkdir()
    cells = {"seen/train_accuracy": (97.5, 1.25), "seen/accuracy": (58.0, 2.0)}
    cells |= {"late/base_grad_norm": (0.5, 0.25), "late/loss": (0.125, 0.0625)}
    header = ["block", "point", "seeds", *(f"{m} ({s})" for m in cells for s in ("mean", "std"))]
    row = ["rank", "lora_rank=2", "3", *(str(v) for pair in cells.values() for v in pair)]
    (folder / "table.csv").write_text(",".join(header) + "\n" + ",".join(row) + "\n")
    paired = "block,point,reference,metric,seeds,mean,seeds ci95,per seed,paper,verdict\n"
    paired += 'rank,lora_rank=2,rank/lora_rank=8,late/base_grad_norm,3,+0.30,"[+0.10, +0.50]",+0.2 +0.3 +0.4,'
    paired += "the norm falls with rank,reproduced\n"
    (folder / "paired.csv").write_text(paired)
    after = docs_tables.pfeddpo_ablations_seeds(root)
    line = "| rank 2 | pFedDPO | 3 | 0.975 +- 0.013 | 0.580 +- 0.020 | 0.500 +- 0.250 | 0.125 +- 0.062 |"
    assert f"{line} the norm falls with rank: reproduced |" in after
    assert "| rank 4 | pFedDPO | 0 of 3 |" in after  # a point of the experiment not landed yet


def test_a_point_still_running_counts_its_seeds_against_what_its_experiment_plans() -> None:
    """The pFedDPO and FedLAG tables read "N of M" seeds: M is the number of seeds the catalogue plans for that
    experiment (five for pFedDPO's main comparison and FedLAG on MNIST, three elsewhere), so no table calls a point
    complete too early."""
    from fedtailor.fl.experiments import EXPERIMENTS

    for name, experiment in EXPERIMENTS.items():
        planned = docs_tables.planned(name)
        assert planned == len(experiment.seeds), name
        assert docs_tables.seeds_of({"seeds": str(planned)}, name) == str(planned)
        assert docs_tables.seeds_of({"seeds": "2"}, name) == f"2 of {planned}"


def test_a_tuned_fedlag_table_shows_each_base_at_its_own_step(tmp_path: Path) -> None:
    """``fedlag-mnist/alpha01``: every base's own chosen step without and with FedLAG (grid-edge choices marked),
    its Seen accuracy over seeds ("N of M" while runs land, no spread from one seed, "-" before), the paired
    interval with the verdict, and a base the tuning record lacks is an error naming the file."""
    folder = tmp_path / "docs/results/fedlag-x"
    folder.mkdir(parents=True)
    choices = {
        "main-alpha01/name=fedavg_top_k=0": {"method.lr": "0.05"},
        "main-alpha01/name=fedavg_top_k=2": {"method.lr": "0.015"},
        "main-alpha01/name=fedprox_top_k=0": {"method.lr": "0.05", "method.mu": "0.01"},
        "main-alpha01/name=fedprox_top_k=2": {"method.lr": "0.05", "method.mu": "0.1"},
        "main-alpha10/name=fedavg_top_k=0": {"method.lr": "0.15"},
    }
    record = {"choices": choices, "at_edge": ["main-alpha01/name=fedprox_top_k=2"]}
    (folder / "choices.json").write_text(json.dumps(record))
    header = "block,point,seeds,fedlag_personal,seen/accuracy (mean),seen/accuracy (std)\n"
    rows = "main-alpha01,name=fedavg_top_k=0,3,,90.0,1.0\nmain-alpha01,name=fedavg_top_k=2,3,fc.weight (3),93.5,0.5\n"
    rows += "main-alpha01,name=fedprox_top_k=0,1,,91.25,0.0\n"  # one seed: no spread yet
    (folder / "table.csv").write_text(header + rows)
    paired = "block,point,reference,metric,seeds,mean,seeds ci95,per seed,paper,verdict\n"
    paired += 'main-alpha01,name=fedavg_top_k=2,main-alpha01/name=fedavg_top_k=0,seen/accuracy,3,+3.50,"[+1.00, +6.00]"'
    paired += ",+3 +3.5 +4,FedLAG above its base,reproduced\n"
    (folder / "paired.csv").write_text(paired)
    text = docs_tables.fedlag_tuned("fedlag-x", "alpha01")(tmp_path)
    fedavg = "| fedavg | 0.05 | 90.00 +- 1.00 | 0.015 | 93.50 +- 0.50 | +3.50 [+1.00, +6.00] |"
    assert f"{fedavg} FedLAG above its base: reproduced | fc.weight (3) |" in text
    fedprox = "| fedprox | 0.05, mu 0.01 | 91.25 (1 of 3) | 0.05, mu 0.1 (grid edge) | - (0 of 3) | - | - | - |"
    assert fedprox in text
    assert "0.15" not in text  # the other alpha's choices stay in their own table
    (folder / "paired.csv").write_text(paired.replace("seen/accuracy,3,", "seen/accuracy,2,"))
    text = docs_tables.fedlag_tuned("fedlag-x", "alpha01")(tmp_path)
    assert "| FedLAG above its base: reproduced so far (2 of 3 seeds) |" in text  # a verdict before every seed
    lost = rows.replace("name=fedavg_top_k=0,3,,", "name=fedavg_top_k=0,2,1,,").replace(",fc.weight", ",,fc.weight")
    (folder / "table.csv").write_text(header.replace("seeds,", "seeds,diverged,") + lost.replace(",1,,91", ",1,,,91"))
    text = docs_tables.fedlag_tuned("fedlag-x", "alpha01")(tmp_path)  # every seed landed; one run diverged
    assert "| 0.05 | 90.00 +- 1.00 (2 of 3; 1 diverged) | 0.015 | 93.50 +- 0.50 |" in text
    assert "| FedLAG above its base: reproduced over 2 of 3 seeds, a run in the others diverged |" in text
    del choices["main-alpha01/name=fedprox_top_k=2"]
    (folder / "choices.json").write_text(json.dumps({"choices": choices, "at_edge": []}))
    with pytest.raises(docs_tables.SourceError, match="fedlag-x/choices.json: no choice for .*fedprox_top_k=2"):
        docs_tables.fedlag_tuned("fedlag-x", "alpha01")(tmp_path)


def test_the_fedlag_variants_table_shows_first_and_middle_k_only_where_asked(tmp_path: Path) -> None:
    """``fedlag_variants``: the scoring variants and fixed Last-K always; First-K and Middle-K, in that order before
    Last-K, with ``fixed=True``; a point not landed reads "- (0 of M)" with M the experiment's planned seeds."""
    folder = tmp_path / "docs/results/fedlag-mnist"
    folder.mkdir(parents=True)
    header = "block,point,seeds,fedlag_personal,seen/accuracy (mean),seen/accuracy (std)\n"
    rows = "fixed-alpha01,choice=first,5,,98.0,0.1\nfixed-alpha01,choice=last,2,fc.weight 2/2,98.5,0.2\n"
    (folder / "table.csv").write_text(header + rows)
    plain = docs_tables.fedlag_variants("fedlag-mnist")(tmp_path)
    assert "First-K" not in plain and "Middle-K" not in plain
    assert "| fixed Last-K (the head; top_k 2) | 98.50 +- 0.20 (2 of 5) (fc.weight 2/2) | - (0 of 5) |" in plain
    full = docs_tables.fedlag_variants("fedlag-mnist", fixed=True)(tmp_path)
    names = [line.split(" | ")[0].removeprefix("| ") for line in full.splitlines()[2:]]
    assert names[-3:] == ["fixed First-K (top_k 2)", "fixed Middle-K (top_k 2)", "fixed Last-K (the head; top_k 2)"]
    assert "| fixed First-K (top_k 2) | 98.00 +- 0.10 | - (0 of 5) |" in full
