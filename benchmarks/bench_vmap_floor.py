"""Why executing clients together has a ceiling on this CPU: the matmul rate of one large product (the arithmetic
floor of a round), and one SGD step of 20 clients x 16 records done as one torch.func.vmap step against 20
single-client steps, on the DNN and the FedAvgCNN, measured side by side in one run; for the CNN also the two
other batched forms (grouped convolution, unfold + batched matmul).

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
from harness import report

from fedtailor.models.pflnets import DNN, FedAvgCNN


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
        rows.append(
            {
                "what": f"{model_cls.__name__}: one vmap step of 20 clients",
                "ms": 1e3 * t_vmap,
                "vs 20 single-client steps": t_loop / t_vmap,
            }
        )
        rows.append(
            {
                "what": f"{model_cls.__name__}: 20 single-client steps (torch.optim.SGD)",
                "ms": 1e3 * t_loop,
                "vs 20 single-client steps": 1.0,
            }
        )
    rows += _cnn_alternatives(args.repeat)
    dnn_floor = 52_500 * 784 * 100 * 2 * 2 / (gflops * 1e9)
    report(
        f"Executing clients together: the CPU's ceiling, {args.threads} threads",
        rows,
        notes=f"Arithmetic floor of a DNN round (52,500 records x first layer forward + weight gradient): "
        f"{dnn_floor:.3f} s at the measured rate.",
    )


def _cnn_alternatives(repeat: int) -> list[dict]:
    """Two other ways to run 20 FedAvgCNN clients' step at once (forward and parameter gradients): per-client
    weights as one grouped convolution, and each convolution as unfold + one batched matmul over the clients;
    against 20 single-client functional steps. Same shapes as the model (conv 1->32 5x5, pool, conv 32->64 5x5,
    pool, fc 1024->512, fc 512->10), batch 16."""
    c, b = 20, 16
    g = torch.Generator().manual_seed(0)
    shapes = {
        "w1": (32, 1, 5, 5),
        "b1": (32,),
        "w2": (64, 32, 5, 5),
        "b2": (64,),
        "w3": (512, 1024),
        "b3": (512,),
        "w4": (10, 512),
        "b4": (10,),
    }
    params = {n: 0.05 * torch.randn(c, *s, generator=g) for n, s in shapes.items()}
    x, y = torch.rand(c, b, 1, 28, 28, generator=g), torch.randint(0, 10, (c, b), generator=g)

    def head(p: dict, h: torch.Tensor) -> torch.Tensor:  # h: (c, b, 1024) -> summed loss over clients
        h = F.relu(torch.baddbmm(p["b3"][:, None], h, p["w3"].transpose(1, 2)))
        out = torch.baddbmm(p["b4"][:, None], h, p["w4"].transpose(1, 2))
        return F.cross_entropy(out.reshape(c * b, 10), y.reshape(-1), reduction="sum") / b

    def per_client() -> None:
        for i in range(c):
            p = {n: t[i].clone().requires_grad_() for n, t in params.items()}
            h = F.max_pool2d(F.relu(F.conv2d(x[i], p["w1"], p["b1"])), 2)
            h = F.max_pool2d(F.relu(F.conv2d(h, p["w2"], p["b2"])), 2)
            h = F.relu(F.linear(h.flatten(1), p["w3"], p["b3"]))
            torch.autograd.grad(F.cross_entropy(F.linear(h, p["w4"], p["b4"]), y[i]), list(p.values()))

    def grouped() -> None:
        p = {n: t.clone().requires_grad_() for n, t in params.items()}
        h = x.transpose(0, 1).reshape(b, c, 28, 28)
        h = F.max_pool2d(F.relu(F.conv2d(h, p["w1"].reshape(c * 32, 1, 5, 5), p["b1"].reshape(-1), groups=c)), 2)
        h = F.max_pool2d(F.relu(F.conv2d(h, p["w2"].reshape(c * 64, 32, 5, 5), p["b2"].reshape(-1), groups=c)), 2)
        torch.autograd.grad(head(p, h.reshape(b, c, 1024).transpose(0, 1)), list(p.values()))

    def unfold_bmm() -> None:
        p = {n: t.clone().requires_grad_() for n, t in params.items()}

        def conv(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # h: (c*b, cin, s, s)
            out_ch, side = w.shape[1], h.shape[-1] - 4
            u = F.unfold(h, 5)  # (c*b, cin*25, side^2)
            u = u.reshape(c, b, u.shape[1], -1).permute(0, 2, 1, 3).reshape(c, u.shape[1], -1)
            o = torch.bmm(w.reshape(c, out_ch, -1), u) + bias[:, :, None]
            return o.reshape(c, out_ch, b, side, side).transpose(1, 2).reshape(c * b, out_ch, side, side)

        h = F.max_pool2d(F.relu(conv(x.reshape(c * b, 1, 28, 28), p["w1"], p["b1"])), 2)
        h = F.max_pool2d(F.relu(conv(h, p["w2"], p["b2"])), 2)
        torch.autograd.grad(head(p, h.reshape(c, b, 1024)), list(p.values()))

    n = max(3, repeat // 10)
    t_loop = _time(per_client, n)
    return [
        {"what": "FedAvgCNN: 20 single-client functional steps", "ms": 1e3 * t_loop, "vs 20 single-client steps": 1.0},
        *(
            {"what": f"FedAvgCNN: 20 clients as {name}", "ms": 1e3 * t, "vs 20 single-client steps": t_loop / t}
            for name, t in (
                ("one grouped convolution", _time(grouped, n)),
                ("unfold + batched matmul", _time(unfold_bmm, n)),
            )
        ),
    ]


if __name__ == "__main__":
    main()
