"""FedAvg round time on real MNIST: fedtailor's loop against a hand-written PyTorch FedAvg round (the same
clients, model, batches and arithmetic, no framework) measured in the same run. The ratio is the framework's
overhead (messages, validation, bookkeeping).

    python benchmarks/bench_fedavg_round.py [--threads 2] [--clients 10] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from harness import report

from fedtailor.config import load_config
from fedtailor.experiment import build_method, build_setup
from fedtailor.fl.loop import run_federated
from fedtailor.models import build_model, get_flat, set_flat
from fedtailor.rng import torch_generator


def plain_round(setup, params: torch.Tensor, selected: np.ndarray, lr: float, batch_size: int) -> torch.Tensor:
    """One FedAvg round written directly in PyTorch (batch order keys of round 1, like the loop's first round)."""
    model = build_model("lenet", input_shape=(1, 28, 28), num_classes=10)
    new, weights = [], []
    for cid in (int(c) for c in selected):
        set_flat(model, params)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        x, y = setup.clients[cid].train
        order = torch.randperm(len(x), generator=torch_generator(setup.cfg.seed, "batches", 1, cid))
        for s in range(0, len(x), batch_size):
            idx = order[s : s + batch_size]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        new.append(get_flat(model))
        weights.append(len(x))
    w = torch.tensor(weights, dtype=torch.float32)
    return (w[:, None] * torch.stack(new)).sum(0) / w.sum()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(
        None,
        [
            'method.name="fedavg"',
            f"federation.rounds={args.repeat + 1}",
            f"federation.clients_per_round={args.clients}",
        ],
    )
    setup = build_setup(cfg)
    ours, plain = [], []
    for rnd in range(1, args.repeat + 2):
        method = build_method(setup)
        t0 = time.perf_counter()
        res = run_federated(method, setup.clients, setup.schedule[rnd - 1 : rnd], progress=False)
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ref = plain_round(
            setup,
            torch.cat([t.reshape(-1) for t in method.init_server().params.values()]),
            setup.schedule[rnd - 1],
            cfg.method.lr,
            cfg.method.batch_size,
        )
        plain.append(time.perf_counter() - t0)
        # same clients, keys and arithmetic: the two rounds must give the same model
        got = torch.cat([t.reshape(-1) for t in res.state.server.params.values()])
        assert np.allclose(got.numpy(), ref.numpy(), atol=1e-5)
    # the loop's run also evaluates all 50 clients once at the end; time that separately
    method = build_method(setup)
    from fedtailor.fl.loop import LoopState, evaluate_clients

    t0 = time.perf_counter()
    evaluate_clients(method, LoopState(round=0, server=method.init_server()), setup.clients)
    eval_s = time.perf_counter() - t0
    o = statistics.median(ours[1:]) - eval_s
    p = statistics.median(plain[1:])
    n = sum(len(setup.clients[int(c)].train[0]) for c in setup.schedule[0])
    rows = [
        {"path": "fedtailor loop (FedAvg)", "seconds per round": o, "ratio vs plain": o / p},
        {"path": "plain PyTorch FedAvg round", "seconds per round": p, "ratio vs plain": 1.0},
    ]
    report(
        f"FedAvg round on real MNIST: {args.clients} clients x ~{n // args.clients} records, LeNet, "
        f"{args.threads} threads",
        rows,
        notes=f"Evaluation of all 50 clients (subtracted from the loop's time): {eval_s:.2f} s.",
    )


if __name__ == "__main__":
    main()
