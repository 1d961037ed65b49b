"""The Flower adapters: records round trips, and a run on the real Deployment Engine (a SuperLink and three
SuperNodes as separate processes on loopback) that ends where the in-process loop ends."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")

from conftest import TINY_TOML  # noqa: E402

from fedtailor.fl.records import Message  # noqa: E402
from fedtailor.flower.records import from_records, state_from_bytes, state_to_bytes, to_records  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_messages_and_client_state_survive_the_flower_records():
    msg = Message(arrays={"w": torch.randn(3, 4), "i": torch.arange(5), "h": torch.ones(2, dtype=torch.float16)},
                  config={"round": 3, "sigma": 0.25, "name": "x", "flag": True, "payload": b"\x00\xffbytes"})
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


@pytest.mark.slow
def test_fedavg_on_the_deployment_engine_matches_the_in_process_loop(tmp_path):
    from fedtailor.config import load_config
    from fedtailor.experiment import build_method, build_setup
    from fedtailor.fl.loop import run_federated

    cfg_path = tmp_path / "tiny.toml"
    cfg_path.write_text(TINY_TOML.replace("num_clients = 6", "num_clients = 3").replace("num_unseen = 1", "num_unseen = 0")
                        .replace("clients_per_round = 3", "clients_per_round = 3").replace("rounds = 4", "rounds = 3"))
    home, out = tmp_path / "flwr", tmp_path / "out"
    home.mkdir()
    link = _free_port()
    (home / "config.toml").write_text(f'[superlink.deploy]\naddress = "127.0.0.1:{link}"\ninsecure = true\n')
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "OMP_NUM_THREADS": "1"}
    bin_dir = Path(sys.executable).parent
    procs = []
    try:
        procs.append(subprocess.Popen([bin_dir / "flower-superlink", "--insecure", "--disable-runtime-dependency-installation",
                                       "--host", "127.0.0.1", "--port", str(link)], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        for _ in range(60):
            if subprocess.run(["curl", "-sf", f"http://127.0.0.1:{link}/health"], capture_output=True).returncode == 0:
                break
            time.sleep(0.5)
        for i in range(3):
            procs.append(subprocess.Popen([bin_dir / "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{link}",
                                           "--port", str(_free_port()), "--node-config", f"partition-id={i}"],
                                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        run = subprocess.run([bin_dir / "flwr", "run", str(REPO), "deploy", "--stream", "-c",
                              f"config='{cfg_path}' out='{out}'"], env=env, capture_output=True, text=True, timeout=400)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        for _ in range(60):  # the stream can end a moment before the ServerApp has written its files
            if (out / "server_state.pt").exists():
                break
            time.sleep(1)
        flower = torch.load(out / "server_state.pt", weights_only=False)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(home, ignore_errors=True)
    setup = build_setup(load_config(cfg_path))
    local = run_federated(build_method(setup), setup.clients, setup.schedule, progress=False).state.server
    for n, t in local.params.items():  # per-client on the nodes, vectorized in process: float rounding only
        torch.testing.assert_close(flower.params[n], t, rtol=1e-5, atol=1e-6)


def _through_records(method, setup):
    """The adapter's server and client logic with an in-process transport: every message and reply crosses
    the Flower records, and every client state crosses bytes, as on real nodes."""
    from fedtailor.flower.apps import drive, handle

    states: dict[int, bytes] = {}

    def exchange(kind, msgs):
        out = {}
        for cid, msg in msgs.items():
            state = state_from_bytes(states[cid]) if cid in states else method.init_client(cid)
            reply, state = handle(kind, from_records(to_records(msg)), state, method, setup.clients[cid])
            states[cid] = state_to_bytes(state)
            out[cid] = reply if kind == "evaluate" else from_records(to_records(reply))
        return out

    return drive(method, setup, exchange)


IMAGE = ['data.dataset="digits"', "data.num_clients=4", "data.num_unseen=0", "data.context_size=0",
         "data.eval_fraction=0.25", "federation.rounds=2", "federation.clients_per_round=4", 'method.model="mlp"']
FLOWER_PATHS = {
    **{name: [*IMAGE, f'method.name="{name}"', "method.fedlag.top_k=1", "method.fedlag.warmup=1"]
       for name in ("fedavg", "fedprox", "fedper", "fedrep", "fedbabu", "ditto", "fedrod")},
    "compact": ['data.dataset="mnist-5k"', "data.num_clients=6", "data.num_unseen=1", "data.context_size=60",
                "federation.rounds=2", "federation.clients_per_round=2", "method.coef_dim=256", "method.hidden_dim=8",
                "method.privacy.batch_size=60", 'method.privacy.randomness="simulation"', 'method.variant="ours-lrsuq"'],
}
LM = ("pfeddpo", "feddpo", "dpo-central")  # need the language model: covered by their own tests and test_flower_dpo


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
        assert evaluation[cid]["accuracy"] == pytest.approx(m["accuracy"], abs=0.05)
    flat = lambda s: torch.cat([t.reshape(-1).float() for t in _tensors(s)])  # noqa: E731
    torch.testing.assert_close(flat(server), flat(local.state.server), rtol=1e-4, atol=1e-5)


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

    from fedtailor.methods.pfeddpo import PFedDPO
    from fedtailor.methods.pfeddpo_test import _clients
    from fedtailor.lm.model import tiny_llama

    method = PFedDPO(model=tiny_llama(seed=3), personal=True, beta=0.5, lr=3e-3, local_steps=2, batch_size=4,
                     grad_clip=1.0, seed=0, rounds=2, lora_rank=2, lora_alpha=4)
    setup = SimpleNamespace(clients=_clients(), schedule=np.tile(np.arange(3), (2, 1)))
    server, history, evaluation = _through_records(method, setup)
    assert all(not h["lost"] and h["rejected"] == 0 for h in history) and set(evaluation) == {0, 1, 2}
    assert not [n for n in server.base if "lora_" in n]
