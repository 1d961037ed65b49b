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
