"""Round time of Flower's Simulation Engine (``flwr run . local``, N virtual SuperNodes on Ray) against the
in-process loop, same config, measured in one run. A round's time is taken as (T(R2) - T(R1)) / (R2 - R1)
over two run lengths after a warm-up run (which starts the local SuperLink and Ray), so that start-up costs cancel.

    python benchmarks/bench_flower_sim.py [--clients 3] [--rounds 3,13]

Needs ``flwr[simulation]``. The local SuperLink is started with runtime dependency installation disabled (else
it runs ``uv sync``, which pulled a CUDA torch here) and stopped at the end.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from harness import report

REPO = Path(__file__).resolve().parents[1]
TINY = """name = "tiny"
seed = 41
[data]
dataset = "digits"
num_clients = {n}
num_unseen = 0
context_size = 0
eval_fraction = 0.25
[federation]
rounds = {r}
clients_per_round = {n}
[method]
name = "fedavg"
model = "mlp"
lr = 0.1
batch_size = 16
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--rounds", default="3,13")
    args = ap.parse_args()
    r1, r2 = (int(v) for v in args.rounds.split(","))
    from fedtailor.config import load_config
    from fedtailor.experiment import build_method, build_setup
    from fedtailor.fl.loop import run_federated

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        home = tmp / "flwr"
        home.mkdir()
        (home / "config.toml").write_text('[superlink.local]\naddress = ":local:"\n')
        env = {
            **os.environ,
            "FLWR_HOME": str(home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "OMP_NUM_THREADS": "1",
        }
        sim, local = {}, {}
        try:
            for r in (1, r1, r2):  # the first run starts the local SuperLink and Ray: a warm-up, not measured
                cfg = tmp / f"r{r}.toml"
                cfg.write_text(TINY.format(n=args.clients, r=r))
                t0 = time.perf_counter()
                subprocess.run(
                    [
                        Path(sys.executable).parent / "flwr",
                        "run",
                        str(REPO),
                        "local",
                        "--stream",
                        "--federation-config",
                        f"num-supernodes={args.clients} client-resources-num-cpus=1",
                        "-c",
                        f"config='{cfg}' out='{tmp / f'out{r}'}'",
                    ],
                    env=env,
                    check=True,
                    capture_output=True,
                    timeout=900,
                )
                sim[r] = time.perf_counter() - t0
                setup = build_setup(load_config(cfg))
                t0 = time.perf_counter()
                run_federated(build_method(setup), setup.clients, setup.schedule, progress=False)
                local[r] = time.perf_counter() - t0
        finally:
            subprocess.run(["pkill", "-f", "flower-superlink --insecure --simulation"], check=False)
    per_sim, per_local = (sim[r2] - sim[r1]) / (r2 - r1), (local[r2] - local[r1]) / (r2 - r1)
    rows = [
        {
            "path": "Flower Simulation Engine",
            "seconds per round": per_sim,
            f"wall of {r1} rounds (s)": sim[r1],
            "ratio vs in-process": per_sim / per_local,
        },
        {
            "path": "fedtailor in-process loop",
            "seconds per round": per_local,
            f"wall of {r1} rounds (s)": local[r1],
            "ratio vs in-process": 1.0,
        },
    ]
    report(f"FedAvg round: Flower Simulation Engine vs the in-process loop, {args.clients} digits clients", rows)


if __name__ == "__main__":
    main()
