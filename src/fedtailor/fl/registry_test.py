"""A method is one module: a toy method defined and registered here, in this test module alone, runs through
config validation, the in-process loop (``fedtailor run``), the Flower adapter path and ``fedtailor report``,
with no other file of the project touched. And the registry is the one source of the names."""

from __future__ import annotations

import json
from typing import Any, Literal

import pytest
import torch
from pydantic import Field

from fedtailor.config import ConfigError, load_config
from fedtailor.fl import registry
from fedtailor.fl.records import ClientData
from fedtailor.fl.setup import train_sizes
from fedtailor.methods.pfl.local import ClientBatch, LocalSGDConfig, LocalTraining, Params


class ToyConfig(LocalSGDConfig):
    """The toy's options: every parameter-sharing option plus its own ``shrink``."""

    name: Literal["toy"] = "toy"
    shrink: float = Field(0.9, gt=0, le=1, description="the local model is scaled by this after local training")


class Toy(LocalTraining):
    """FedAvg whose clients scale their trained model by ``shrink`` before replying (weight decay, crudely)."""

    name = "toy"

    def __init__(self, *, shrink: float, **kw: Any) -> None:
        super().__init__(**kw)
        self.shrink = shrink

    def local_program(
        self, theta: Params, extra: Params, received: Params, data: ClientData | ClientBatch, rnd: int
    ) -> tuple[Params, Params, Any]:
        theta, loss = self.sgd(theta, data, rnd)
        return {n: self.shrink * t for n, t in theta.items()}, extra, loss


def build_toy(setup: Any) -> Toy:
    m = setup.cfg.method
    return Toy(
        shrink=m.shrink,
        model_fn=setup.model_fn(m.model),
        lr=m.lr,
        local_epochs=m.local_epochs,
        batch_size=m.batch_size,
        seed=setup.cfg.seed,
        device=setup.device,
        rounds=setup.cfg.federation.rounds,
        train_sizes=train_sizes(setup.clients),
    )


@pytest.fixture()
def toy():
    registry.register_method("toy", config=ToyConfig, build=build_toy, family="toy", data="images")
    yield
    registry.unregister_method("toy")


SETS = [
    'data.dataset="digits"',
    "data.num_clients=4",
    "data.num_unseen=0",
    "data.context_size=0",
    "data.eval_fraction=0.25",
    "federation.rounds=2",
    "federation.clients_per_round=3",
    'method.model="mlp"',
    'method.name="toy"',
    "method.shrink=0.5",
]


def test_the_toy_validates_with_the_errors_every_method_has(toy):
    cfg = load_config(None, SETS)
    assert isinstance(cfg.method, ToyConfig) and cfg.method.shrink == 0.5 and cfg.method.lr == 0.05
    with pytest.raises(ConfigError, match=r"method\.shrink: Input should be less than or equal to 1 \(got 2\)"):
        load_config(None, [*SETS, "method.shrink=2"])
    with pytest.raises(ConfigError, match=r"method\.typo: unknown field"):
        load_config(None, [*SETS, "method.typo=1"])
    with pytest.raises(ConfigError, match=r"method\.name: unknown method 'toyy'; allowed: .*'toy'"):
        load_config(None, [*SETS, 'method.name="toyy"'])
    again = load_config(json.loads(cfg.model_dump_json()))  # a saved config.json loads back the same
    assert again == cfg


def test_the_toy_runs_with_fedtailor_run_and_is_reported(toy, tmp_path, capsys):
    from fedtailor.cli import main

    out, path = tmp_path / "run", tmp_path / "toy.toml"
    path.write_text('name = "toy"\n[method]\nname = "toy"\n')
    assert (
        main(
            [
                "run",
                str(path),
                "--out",
                str(out),
                "--no-progress",
                "--no-plots",
                *[a for s in SETS for a in ("--set", s)],
            ]
        )
        == 0
    )
    results = json.loads((out / "results.json").read_text())
    assert results["rounds_completed"] == 2 and json.loads((out / "config.json").read_text())["method"]["shrink"] == 0.5
    capsys.readouterr()
    assert main(["report", str(out), "--no-plots"]) == 0
    assert "method toy on digits" in capsys.readouterr().out


def test_the_toy_through_the_flower_adapter_ends_where_the_in_process_loop_ends(toy):
    pytest.importorskip("flwr")
    from fedtailor.experiment import build_method, build_setup
    from fedtailor.fl.loop import run_federated

    setup = build_setup(load_config(None, SETS))
    assert isinstance(build_method(setup), Toy)
    local = run_federated(build_method(setup), setup.clients, setup.schedule, progress=False)
    server, history, evaluation = _through_records(build_method(setup), setup)
    assert [h["rejected"] for h in history] == [0, 0] and set(evaluation) == set(local.evaluation)
    for n, t in local.state.server.params.items():
        torch.testing.assert_close(server.params[n], t, rtol=1e-4, atol=1e-5)
    assert not torch.equal(server.params["fc1.weight"], build_method(setup).theta0["fc1.weight"])


def _through_records(method: Any, setup: Any) -> Any:
    from fedtailor.flower.apps import drive_through_records

    return drive_through_records(method, setup)


def test_the_registry_is_the_one_source_of_names(toy):
    names = registry.method_names()
    assert names[0] == registry.DEFAULT_METHOD and "toy" in names
    assert {"lgfedavg", "apfl"} <= set(registry.fedlag_bases()) and "toy" not in registry.fedlag_bases()
    assert {s.data for s in registry.methods()} == {"images", "preferences"}
    with pytest.raises(ValueError, match="registered already"):
        registry.register_method("fedavg", config=ToyConfig, build=build_toy, family="toy")
    from fedtailor.reproduce import EXPERIMENTS

    main = next(b for b in EXPERIMENTS["fedlag-mnist"].blocks if b.name == "main-alpha01")
    assert dict(main.grid)["method.name"] == registry.fedlag_bases()


def test_the_config_module_stays_light_and_lm_and_flower_have_no_back_arrows():
    import ast
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, fedtailor.config; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
    src = Path(__file__).resolve().parents[1]

    def imports(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
        }

    lm = set().union(*(imports(p) for p in (src / "lm").glob("*.py") if not p.name.endswith("_test.py")))
    assert not {m for m in lm if m.startswith("fedtailor.methods")}, lm
    flower = set().union(*(imports(p) for p in (src / "flower").glob("*.py") if not p.name.endswith("_test.py")))
    assert not {m for m in flower if m.startswith("fedtailor.cli")}, flower
    experiment = (src / "experiment.py").read_text()
    assert "DPO" not in experiment and "pfeddpo" not in experiment and "fedavg" not in experiment
