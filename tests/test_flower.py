"""The Flower adapters: records round trips, and a run on the real Deployment Engine (a SuperLink and three
SuperNodes as separate processes on loopback) that ends where the in-process loop ends."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")

import contextlib

from conftest import TINY_TOML
from fedtailor.fl.records import Message
from fedtailor.fl.registry import fedlag_bases, methods
from fedtailor.flower.records import from_records, state_from_bytes, state_to_bytes, to_records

REPO = Path(__file__).resolve().parents[1]


def test_messages_and_client_state_survive_the_flower_records():
    msg = Message(
        arrays={"w": torch.randn(3, 4), "i": torch.arange(5), "h": torch.ones(2, dtype=torch.float16)},
        config={"round": 3, "sigma": 0.25, "name": "x", "flag": True, "payload": b"\x00\xffbytes"},
    )
    back = from_records(to_records(msg))
    assert back.config == msg.config
    for k, v in msg.arrays.items():
        assert back.arrays[k].dtype == v.dtype and torch.equal(back.arrays[k], v)
    state = {"adapter": {"a": torch.randn(2)}, "step": 4}
    again = state_from_bytes(state_to_bytes(state))
    assert again["step"] == 4 and torch.equal(again["adapter"]["a"], state["adapter"]["a"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Federation:
    """A SuperLink and N SuperNodes as separate processes on loopback (free ports); stopped on exit, even on
    failure."""

    def __init__(self, tmp_path: Path, nodes: int) -> None:
        self.home, self.nodes = tmp_path / "flwr", nodes
        self.home.mkdir()
        self.link = _free_port()
        (self.home / "config.toml").write_text(
            f'[superlink.deploy]\naddress = "127.0.0.1:{self.link}"\ninsecure = true\n'
        )
        self.bin = Path(sys.executable).parent
        # the SuperLink starts flower-superexec by name: the environment's bin must be on PATH (unactivated venv)
        self.env = {
            **os.environ,
            "FLWR_HOME": str(self.home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "OMP_NUM_THREADS": "1",
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        self.procs: list[subprocess.Popen] = []
        self.node_logs: list[Path] = []

    def __enter__(self) -> Federation:
        self.procs.append(
            subprocess.Popen(
                [
                    self.bin / "flower-superlink",
                    "--insecure",
                    "--disable-runtime-dependency-installation",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.link),
                ],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
        for _ in range(60):
            if (
                subprocess.run(["curl", "-sf", f"http://127.0.0.1:{self.link}/health"], capture_output=True).returncode
                == 0
            ):
                break
            time.sleep(0.5)
        for i in range(self.nodes):
            log = self.home / f"node{i}.log"
            self.node_logs.append(log)
            self.procs.append(
                subprocess.Popen(
                    [
                        self.bin / "flower-supernode",
                        "--insecure",
                        "--superlink",
                        f"127.0.0.1:{self.link}",
                        "--port",
                        str(_free_port()),
                        "--node-config",
                        f"partition-id={i}",
                    ],
                    env=self.env,
                    stdout=log.open("w"),
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        return self

    def run(self, cfg_path: Path, out: Path, *, wait: bool = True, extra: str = ""):
        cmd = [
            self.bin / "flwr",
            "run",
            str(REPO),
            "deploy",
            "--stream",
            "-c",
            f"config='{cfg_path}' out='{out}' {extra}".strip(),
        ]
        if not wait:
            return subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=400)

    def kill(self, proc: subprocess.Popen, sig: int) -> None:
        """Signal a process and its children (each runs in its own session: a SuperNode's SuperExec too)."""
        import signal  # noqa: F401 - sig comes from it

        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    def __exit__(self, *exc) -> None:
        import signal

        for p in self.procs:
            self.kill(p, signal.SIGTERM)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=20)
            self.kill(p, signal.SIGKILL)


def _wait_for(path: Path, seconds: float = 60) -> None:
    for _ in range(int(seconds)):  # the stream can end a moment before the ServerApp has written its files
        if path.exists():
            return
        time.sleep(1)


def _tiny(tmp_path: Path, rounds: int) -> Path:
    cfg_path = tmp_path / "tiny.toml"
    cfg_path.write_text(
        TINY_TOML.replace("num_clients = 6", "num_clients = 3")
        .replace("num_unseen = 1", "num_unseen = 0")
        .replace("rounds = 4", f"rounds = {rounds}")
    )
    return cfg_path


@pytest.mark.slow
def test_fedavg_on_the_deployment_engine_writes_a_run_directory_resumes_and_matches_the_in_process_loop(tmp_path):
    """The ServerApp runs the one federation driver: it stops after round 2 (``stop-after``), a ServerApp
    restarted on the same run directory resumes from its checkpoint, and the run ends with the in-process
    loop's model. The run directory is a `fedtailor run`'s (config, metrics, results, owner-only checkpoint,
    plots) and `fedtailor report` reads it; the log stream shows every round."""
    import json
    import stat

    from fedtailor.config import load_config
    from fedtailor.experiment import build_method, build_setup
    from fedtailor.fl.loop import run_federated
    from fedtailor.report import report

    cfg_path, out = _tiny(tmp_path, 3), tmp_path / "out"
    with Federation(tmp_path, 3) as fed:
        first = fed.run(cfg_path, out, extra="stop-after=2")
        assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
        _wait_for(out / "server_state.pt")
        assert json.loads((out / "results.json").read_text())["rounds_completed"] == 2
        (out / "server_state.pt").unlink()
        second = fed.run(cfg_path, out)  # a new ServerApp on the same directory: resumes at round 3
        assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
        _wait_for(out / "server_state.pt")
    assert "round 1:" in first.stdout + first.stderr and "round 3:" in second.stdout + second.stderr
    assert "round 1:" not in second.stdout + second.stderr  # resumed, not restarted
    results = json.loads((out / "results.json").read_text())
    assert results["rounds_completed"] == 3 and results["method"] == "fedavg"
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    assert stat.S_IMODE((out / "checkpoint.pt").stat().st_mode) == 0o600
    assert "accuracy" in report(out, plots=False)
    assert (out / "learning_curves.png").exists() and (out / "config.json").exists()
    flower = torch.load(out / "server_state.pt", weights_only=False)
    setup = build_setup(load_config(cfg_path))
    local = run_federated(build_method(setup), setup.clients, setup.schedule, progress=False).state.server
    for n, t in local.params.items():  # per-client on the nodes, vectorized in process: float rounding only
        torch.testing.assert_close(flower.params[n], t, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_client_dp_on_the_deployment_engine_ends_with_the_eps_of_the_in_process_run(tmp_path):
    """FedAvg with client-level DP in secure mode (each node draws its own noise) on three SuperNodes: every
    release is in the ServerApp's ledger and the run reports the eps the in-process run reports."""
    import json

    from fedtailor.config import load_config
    from fedtailor.experiment import build_method, build_setup
    from fedtailor.fl.loop import run_federated

    cfg_path, out = _tiny(tmp_path, 2), tmp_path / "out"
    cfg_path.write_text(cfg_path.read_text() + "[method.client_dp]\nclip = 0.5\nepsilon = 500\n")
    with Federation(tmp_path, 3) as fed:
        run = fed.run(cfg_path, out)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        _wait_for(out / "privacy_ledger.json")
    summary = json.loads((out / "results.json").read_text())["method_summary"]
    setup = build_setup(load_config(cfg_path))
    method = build_method(setup)
    local = method.summary(run_federated(method, setup.clients, setup.schedule, progress=False).state.server)
    assert summary["randomness"] == "secure" and summary["releases"] == local["releases"] == setup.schedule.size
    assert (
        summary["epsilon_max"] == local["epsilon_max"] and summary["epsilon_per_client"] == local["epsilon_per_client"]
    )
    assert len(json.loads((out / "privacy_ledger.json").read_text())["releases"]) == setup.schedule.size


@pytest.mark.slow
def test_a_supernode_killed_mid_run_costs_its_client_and_nothing_else(tmp_path):
    """SIGKILL one SuperNode after it answered round 1: the server notices (missed heartbeats), the round
    completes with the two clients that answered, later rounds go on without it, and the results say which
    rounds lost whom."""
    import json
    import signal

    cfg_path, out = _tiny(tmp_path, 4), tmp_path / "out"
    with Federation(tmp_path, 3) as fed:
        run = fed.run(cfg_path, out, wait=False)
        victim, log = fed.procs[3], fed.node_logs[2]
        deadline = time.time() + 200  # round 1 is over for it once the round-2 request arrives
        while log.read_text().count("Receiving: train message") < 2 and time.time() < deadline:
            time.sleep(0.5)
        fed.kill(victim, signal.SIGKILL)
        output, _ = run.communicate(timeout=400)
        assert run.returncode == 0, output[-2000:]
        _wait_for(out / "results.json")
    results, history = json.loads((out / "results.json").read_text()), _history(out)
    lost = [h["lost"] for h in history]
    assert lost[0] == [] and all(entry == [2] for entry in lost[1:]), lost  # round 2 on: client 2 lost
    assert all("loss" in h for h in history)  # every round aggregated the clients that answered
    assert sorted(r["client"] for r in results["per_client"]) == [0, 1]  # the lost client is not evaluated


def _history(run_dir: Path) -> list[dict]:
    """The per-round records of a run directory (its metrics.jsonl)."""
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _through_records(method, setup):
    """The adapter's server and client logic with an in-process transport: every message and reply crosses
    the Flower records, and every client state crosses bytes, as on real nodes."""
    from fedtailor.flower.apps import drive_through_records

    return drive_through_records(method, setup)


IMAGE = [
    'data.dataset="digits"',
    "data.num_clients=4",
    "data.num_unseen=0",
    "data.context_size=0",
    "data.eval_fraction=0.25",
    "federation.rounds=2",
    "federation.clients_per_round=4",
    'method.model="mlp"',
]
BASES = fedlag_bases()  # every registered base FedLAG wraps
FLOWER_PATHS = {
    **{name: [*IMAGE, f'method.name="{name}"', "method.fedlag.top_k=1", "method.fedlag.warmup=1"] for name in BASES},
    **{f"{name} (no FedLAG)": [*IMAGE, f'method.name="{name}"'] for name in BASES},
    "compact": [
        'data.dataset="mnist-5k"',
        "data.num_clients=6",
        "data.num_unseen=1",
        "data.context_size=60",
        "federation.rounds=2",
        "federation.clients_per_round=2",
        "method.coef_dim=256",
        "method.hidden_dim=8",
        "method.privacy.batch_size=60",
        'method.privacy.randomness="simulation"',
        'method.variant="ours-lrsuq"',
    ],
}
# unseen clients, evaluated as they are and after fine-tuning on their own records (docs/pfl.md)
UNSEEN = [*IMAGE, "data.num_unseen=1", "data.context_size=20", "federation.clients_per_round=3"]
FLOWER_PATHS["fedrep (unseen clients)"] = [*UNSEEN, 'method.name="fedrep"']
FLOWER_PATHS["ditto under FedLAG (unseen clients)"] = [
    *UNSEEN,
    'method.name="ditto"',
    "method.fedlag.top_k=1",
    "method.fedlag.warmup=1",
]
# client-level DP around a base, and under FedLAG (simulation noise: the two paths draw the same noise)
DP = ['method.client_dp.randomness="simulation"', "method.client_dp.clip=0.5", "method.client_dp.epsilon=2000"]
FLOWER_PATHS["fedavg with client DP"] = [*IMAGE, 'method.name="fedavg"', *DP]
FLOWER_PATHS["fedper under FedLAG with client DP"] = [*FLOWER_PATHS["fedper"], *DP]
FLOWER_PATHS["fedavg with client DP over LRSUQ"] = [
    *FLOWER_PATHS["fedavg with client DP"],
    'method.client_dp.codec="lrsuq"',
]
FLOWER_PATHS["fedavg with a trusted server's noise"] = [
    *IMAGE,
    'method.name="fedavg"',
    'method.server_dp.randomness="simulation"',
    "method.server_dp.epsilon=50",
]
# the clip follows the noisy count of updates within it; the next clip lives in the server state the adapter keeps
FLOWER_PATHS["fedavg with a trusted server's adaptive clip"] = [
    *FLOWER_PATHS["fedavg with a trusted server's noise"],
    "method.server_dp.adaptive_clip=true",
    "method.server_dp.count_noise=4",
]
FLOWER_PATHS["compact over PPR"] = [*FLOWER_PATHS["compact"][:-1], 'method.variant="ours-ppr"']
RECORD_DP = ['method.record_dp.randomness="simulation"', "method.record_dp.epsilon=8"]
FLOWER_PATHS["ditto under FedLAG with record DP-SGD"] = [*FLOWER_PATHS["ditto"], *RECORD_DP]
# need the language model: covered by their own tests and test_flower_dpo
LM = tuple(s.name for s in methods() if s.data == "preferences")


def test_every_registered_method_has_a_flower_path():
    from fedtailor.experiment import METHOD_BUILDERS

    missing = sorted(set(METHOD_BUILDERS) - set(FLOWER_PATHS) - set(LM))
    assert not missing, f"add a Flower path check for {missing} to FLOWER_PATHS"


@pytest.mark.parametrize("name", sorted(FLOWER_PATHS))
def test_the_adapter_logic_ends_where_the_in_process_loop_ends(name):
    from fedtailor.config import load_config
    from fedtailor.experiment import build_method, build_setup
    from fedtailor.fl.loop import run_federated

    cfg = load_config(None, FLOWER_PATHS[name])
    setup = build_setup(cfg)
    server, history, evaluation = _through_records(build_method(setup), setup)
    local = run_federated(build_method(setup), setup.clients, setup.schedule, progress=False)
    assert [h["lost"] for h in history] == [[], []] and all(h["rejected"] == 0 for h in history)
    assert set(evaluation) == set(local.evaluation)
    for cid, m in local.evaluation.items():
        assert set(evaluation[cid]) == set(m)  # unseen clients: their fine-tuned metrics too
        for k in {"accuracy", "finetuned_accuracy"} & set(m):
            assert evaluation[cid][k] == pytest.approx(m[k], abs=0.05)
    flat = lambda s: torch.cat([t.reshape(-1).float() for t in _tensors(s)])
    torch.testing.assert_close(flat(server), flat(local.state.server), rtol=1e-4, atol=1e-5)


def test_client_dp_through_the_flower_records_ends_with_the_in_process_ledger():
    from fedtailor.config import load_config
    from fedtailor.experiment import build_method, build_setup
    from fedtailor.fl.loop import run_federated

    setup = build_setup(load_config(None, FLOWER_PATHS["fedavg with client DP"]))
    method = build_method(setup)
    server, _, _ = _through_records(method, setup)
    local = run_federated(build_method(setup), setup.clients, setup.schedule, progress=False).state.server
    assert server.ledger.to_json() == local.ledger.to_json() and len(local.ledger.releases) == setup.schedule.size
    assert method.summary(server)["epsilon_max"] == method.summary(local)["epsilon_max"] > 0


def _tensors(server):
    """The server state's tensors in a fixed order (any of the methods' state dataclasses)."""
    import dataclasses

    out = []
    for f in dataclasses.fields(server):
        v = getattr(server, f.name)
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict) and v and all(isinstance(t, torch.Tensor) for t in v.values()):
            out += [v[k] for k in sorted(v)]
        elif dataclasses.is_dataclass(v):
            out += _tensors(v)
    return out


def test_pfeddpo_through_the_flower_records_keeps_adapters_on_the_nodes():
    pytest.importorskip("peft")
    from types import SimpleNamespace

    import numpy as np

    from fedtailor.lm.model import tiny_llama
    from fedtailor.methods.dpo.pfeddpo import PFedDPO
    from fedtailor.methods.dpo.pfeddpo_test import _clients

    method = PFedDPO(
        model=tiny_llama(seed=3),
        personal=True,
        beta=0.5,
        lr=3e-3,
        local_steps=2,
        batch_size=4,
        grad_clip=1.0,
        seed=0,
        rounds=2,
        lora_rank=2,
        lora_alpha=4,
    )
    setup = SimpleNamespace(clients=_clients(), schedule=np.tile(np.arange(3), (2, 1)))
    server, history, evaluation = _through_records(method, setup)
    assert all(not h["lost"] and h["rejected"] == 0 for h in history) and set(evaluation) == {0, 1, 2}
    assert not [n for n in server.base if "lora_" in n]


def test_private_pfeddpo_through_the_flower_records_ends_with_the_in_process_eps_and_bases():
    """pFedDPO under record_dp (simulation randomness) through the Flower records: the server's ledger holds one
    release per participation, its eps per client equal the in-process run's, and the bases are bit for bit the
    same; every reply carried the base and the pair count only."""
    pytest.importorskip("peft")
    from types import SimpleNamespace

    import numpy as np

    from fedtailor.fl.loop import run_federated
    from fedtailor.methods.dpo.pfeddpo_test import _clients, _private

    schedule = np.tile(np.arange(3), (2, 1))
    setup = SimpleNamespace(clients=_clients(), schedule=schedule)
    method = _private(schedule=schedule)
    server, history, _ = _through_records(method, setup)
    local = run_federated(_private(schedule=schedule), _clients(), schedule, progress=False)
    assert all(not h["lost"] and h["rejected"] == 0 for h in history)
    assert len(server.ledger.releases) == 6
    assert server.ledger.epsilons() == local.state.server.ledger.epsilons()
    assert all(torch.equal(server.base[n], local.state.server.base[n]) for n in method.base_names)


def test_secure_mode_through_the_adapter_draws_fresh_noise_on_every_node():
    """Compact adaptation in secure mode (the default outside simulation) through the Flower path: two runs of the
    same config end in different generators (each node draws its noise and codec secret from OS entropy, kept
    in its own state), while two simulation runs end in the same one."""
    from fedtailor.config import load_config
    from fedtailor.experiment import build_method, build_setup

    def generator(randomness: str):
        sets = [s for s in FLOWER_PATHS["compact"] if "randomness" not in s] + [
            f'method.privacy.randomness="{randomness}"'
        ]
        setup = build_setup(load_config(None, sets))
        server, _, _ = _through_records(build_method(setup), setup)
        return torch.cat([t.reshape(-1) for t in server.omega.values()])

    assert not torch.equal(generator("secure"), generator("secure"))
    assert torch.equal(generator("simulation"), generator("simulation"))


@pytest.mark.slow
def test_the_same_apps_run_on_the_simulation_engine(tmp_path):
    """`flwr run . local` with 3 virtual SuperNodes on Ray ends where the in-process loop ends; its detached local
    SuperLink is started with runtime dependency installation off and stopped at the end."""
    pytest.importorskip("ray")
    from fedtailor.config import load_config
    from fedtailor.experiment import build_method, build_setup
    from fedtailor.fl.loop import run_federated

    cfg_path, out, home = _tiny(tmp_path, 3), tmp_path / "out", tmp_path / "flwr"
    home.mkdir()
    (home / "config.toml").write_text('[superlink.local]\naddress = ":local:"\n')
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    try:
        run = subprocess.run(
            [
                Path(sys.executable).parent / "flwr",
                "run",
                str(REPO),
                "local",
                "--stream",
                "--federation-config",
                "num-supernodes=3 client-resources-num-cpus=1",
                "-c",
                f"config='{cfg_path}' out='{out}'",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        assert "uv sync" not in run.stdout + run.stderr  # nothing was installed at run time
        _wait_for(out / "server_state.pt")
    finally:
        subprocess.run(["pkill", "-f", str(home / "local-superlink")], check=False)
    flower = torch.load(out / "server_state.pt", weights_only=False)
    setup = build_setup(load_config(cfg_path))
    local = run_federated(build_method(setup), setup.clients, setup.schedule, progress=False).state.server
    for n, t in local.params.items():
        torch.testing.assert_close(flower.params[n], t, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_compact_adaptation_deployed_in_secure_mode_cannot_be_regenerated_from_its_config(tmp_path):
    """Private compact adaptation on the Deployment Engine (4 SuperNodes, secure randomness: each node draws its
    noise and codec secret from its own OS entropy): the trained generator differs from what the config's seed
    would give (the in-process run in simulation mode), so whoever holds the config cannot regenerate the noise;
    the run itself completes with every release decoded and charged."""
    import json

    from fedtailor.config import load_config
    from fedtailor.experiment import build_method, build_setup
    from fedtailor.fl.loop import run_federated

    sets = [
        'method.name="compact"',
        'data.dataset="mnist-5k"',
        "data.num_clients=4",
        "data.num_unseen=1",
        "data.context_size=60",
        "federation.rounds=2",
        "federation.clients_per_round=2",
        "method.coef_dim=256",
        "method.hidden_dim=8",
        "method.privacy.batch_size=60",
        'method.variant="ours-lrsuq"',
    ]
    cfg_path, out = tmp_path / "compact.toml", tmp_path / "out"
    cfg_path.write_text("\n")  # the defaults; the run is set by the overrides below (secure is the default)
    with Federation(tmp_path, 4) as fed:
        run = subprocess.run(
            [
                fed.bin / "flwr",
                "run",
                str(REPO),
                "deploy",
                "--stream",
                "-c",
                f"config='{cfg_path}' set='{';'.join(sets)}' out='{out}'",
            ],
            env=fed.env,
            capture_output=True,
            text=True,
            timeout=500,
        )
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        _wait_for(out / "server_state.pt")
    results = json.loads((out / "results.json").read_text())
    assert all(h["lost"] == [] and h["rejected"] == 0 for h in _history(out))
    assert results["method_summary"]["randomness"].startswith("secure")
    deployed = torch.load(out / "server_state.pt", weights_only=False)
    setup = build_setup(load_config(None, [*sets, 'method.privacy.randomness="simulation"']))
    seeded = run_federated(build_method(setup), setup.clients, setup.schedule, progress=False).state.server
    assert not any(torch.allclose(deployed.omega[k], seeded.omega[k]) for k in ("W",))
    assert deployed.ledger.to_json() != "" and len(json.loads(deployed.ledger.to_json())["releases"]) > 0


class _Boom:  # what a hostile stored state carries: unpickling it would call os.system
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_stored_client_state_is_loaded_only_when_it_is_state(tmp_path, monkeypatch):
    """Bytes in a node's context.state that would run code are refused before unpickling; the client states of
    the methods (pFL, compact adaptation, pFedDPO with its adapter and AdamW moments) come back equal."""
    from fedtailor.fl.loop import run_federated
    from fedtailor.flower.records import UnsafeClientState
    from fedtailor.methods.compact.adaptation import CompactClient
    from fedtailor.methods.dpo.pfeddpo import DPOClient
    from fedtailor.methods.pfl.local import PersonalState

    personal = PersonalState(params={"w": torch.randn(3, 2)}, extra={"head": torch.randn(2)})
    back = state_from_bytes(state_to_bytes(personal))
    assert isinstance(back, PersonalState) and torch.equal(back.params["w"], personal.params["w"])
    assert torch.equal(back.extra["head"], personal.extra["head"])
    secret = 2**255 + 12345  # a 256-bit codec secret
    assert state_from_bytes(state_to_bytes(CompactClient(secret))) == CompactClient(codec_secret=secret)
    dpo = DPOClient(
        adapter={"lora_A": torch.randn(2, 4)},
        ref_train=torch.randn(5, 2),
        moments={"lora_A": {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 4)}},
    )
    back = state_from_bytes(state_to_bytes(dpo))
    assert isinstance(back, DPOClient) and back.ref_eval == {}
    assert torch.equal(back.ref_train, dpo.ref_train)
    assert torch.equal(back.moments["lora_A"]["exp_avg"], dpo.moments["lora_A"]["exp_avg"])
    assert state_from_bytes(state_to_bytes(None)) is None
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsafeClientState, match=r"refers to 'posix.system'.*not loaded"):
        state_from_bytes(state_to_bytes({"adapter": _Boom()}))
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(UnsafeClientState, match="run_federated"):  # a fedtailor function is code, not state
        state_from_bytes(state_to_bytes({"step": run_federated}))
