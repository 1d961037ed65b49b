"""Why executing clients together has a ceiling on this CPU: the matmul rate of one large product (the arithmetic
floor of a round), and one SGD step of 20 clients x 16 records done as one torch.func.vmap step against 20
single-client steps, on the DNN and the FedAvgCNN, measured side by side in one run.

    python benchmarks/bench_vmap_floor.py [--threads 2] [--repeat 50]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value, vmap

sys.path.insert(0, str(Path(__file__).parent))
from harness import report  # noqa: E402

from fedtailor.models.pflnets import DNN, FedAvgCNN  # noqa: E402


def _time(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x, w = torch.randn(52_500, 784), torch.randn(784, 100)
    big = _time(lambda: x @ w, 5)
    gflops = 52_500 * 784 * 100 * 2 / big / 1e9
    rows = [{"what": "one large matmul (52,500 x 784 @ 784 x 100)", "ms": 1e3 * big, "GFLOP/s": gflops}]
    for model_cls in (DNN, FedAvgCNN):
        model, clients = model_cls(), 20
        stacked = {n: p.detach().unsqueeze(0).repeat(clients, *[1] * p.ndim) for n, p in model.named_parameters()}
        xs, ys = torch.rand(clients, 16, 1, 28, 28), torch.randint(0, 10, (clients, 16))
        step = vmap(grad_and_value(lambda p, x, y: F.cross_entropy(functional_call(model, p, (x,)), y)))
        opt = torch.optim.SGD(model.parameters(), lr=0.005)

        def loop() -> None:
            for c in range(clients):
                opt.zero_grad()
                F.cross_entropy(model(xs[c]), ys[c]).backward()
                opt.step()

        repeat = args.repeat if model_cls is DNN else max(3, args.repeat // 10)
        t_vmap, t_loop = _time(lambda: step(stacked, xs, ys), repeat), _time(loop, repeat)
        rows.append({"what": f"{model_cls.__name__}: one vmap step of 20 clients", "ms": 1e3 * t_vmap,
                     "vs 20 single-client steps": t_loop / t_vmap})
        rows.append({"what": f"{model_cls.__name__}: 20 single-client steps (torch.optim.SGD)", "ms": 1e3 * t_loop,
                     "vs 20 single-client steps": 1.0})
    dnn_floor = 52_500 * 784 * 100 * 2 * 2 / (gflops * 1e9)
    report(f"Executing clients together: the CPU's ceiling, {args.threads} threads", rows,
           notes=f"Arithmetic floor of a DNN round (52,500 records x first layer forward + weight gradient): "
                 f"{dnn_floor:.3f} s at the measured rate.")


if __name__ == "__main__":
    main()
