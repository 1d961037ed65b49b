"""One FedAvg round of the FedLAG setup (20 MNIST clients, per-class Dirichlet, batch 16, lr 0.005, one epoch):
fedtailor's clients executed together with the hand-written backward (``fl/batched.py``, the default), the same
with the ``torch.func.vmap`` fallback, its per-client path, the per-client path on worker processes
(``fl/workers.py``: ``--workers`` processes, the ``--threads`` divided among them, started before the first,
untimed, round), and a per-client loop written the way PFLlib does it (a DataLoader and a torch.optim.SGD per
client, a deep copy of the global model per client), measured side by side in one run (rounds interleaved), on
the DNN and the FedAvgCNN at alpha 1.0 and 0.1. All paths use the same
batch orders, and the benchmark asserts that they give the same model: per tensor, the difference to the
PFLlib-style model is at most 1% of that model's round update in norm (a tolerance that holds at any thread
count: float rounding differs between kernels and thread counts and grows over a round's ~250 steps, but stays
orders of magnitude below the update). Also times FedLAG's conflict scoring (all pairwise cosines of every
layer from one Gram matrix each), and states each round's arithmetic floor: its multiply-adds (forward,
weight gradients, input gradients above the first layer) at the rate of one large matmul measured in the same
run.

    python benchmarks/bench_pfl_round.py [--threads 2] [--repeat 3] [--models dnn,fedavgcnn] [--alphas 1.0,0.1] \
        [--device cpu|cuda] [--no-vmap] [--workers 2]

On CUDA the fedtailor paths keep every client's records on the GPU; the PFLlib-style loop keeps them on the CPU
and moves each batch to the GPU, as PFLlib's clients do. Times are taken after ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from harness import report

from fedtailor.config import load_config
from fedtailor.experiment import build_method, build_setup
from fedtailor.fl.workers import WorkerPool
from fedtailor.methods.pfl.fedlag import conflict_counts
from fedtailor.models.parts import layer_units


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pfllib_round(
    method, setup, rnd: int, host: dict[int, tuple[torch.Tensor, torch.Tensor]]
) -> tuple[dict[str, torch.Tensor], float]:
    """PFLlib's shape: per client a deep copy of the global model, a DataLoader over the client's records in host
    memory (``host``) and an optimizer; each batch is moved to the model's device."""
    device = setup.device
    _sync(device)
    t0 = time.perf_counter()
    glob = copy.deepcopy(method.model)
    models, weights = [], []
    for cid in (int(c) for c in setup.schedule[rnd - 1]):
        model = copy.deepcopy(glob)
        opt = torch.optim.SGD(model.parameters(), lr=method.lr)
        x, y = host[cid]
        order = torch.randperm(len(x), generator=method.batches(rnd, cid), device=device).tolist()
        loader = DataLoader(TensorDataset(x, y), batch_size=method.batch_size, sampler=order, drop_last=False)
        model.train()
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb.to(device)), yb.to(device)).backward()
            opt.step()
        models.append({n: p.detach() for n, p in model.named_parameters()})
        weights.append(float(len(x)))
    w = torch.tensor(weights) / sum(weights)
    avg = {n: sum(wi * m[n] for wi, m in zip(w.tolist(), models)) for n in models[0]}
    _sync(device)
    return avg, time.perf_counter() - t0


def our_round(method, setup, rnd: int) -> tuple[dict[str, torch.Tensor], float]:
    server = method.init_server()
    cids = [int(c) for c in setup.schedule[rnd - 1]]
    _sync(setup.device)
    t0 = time.perf_counter()
    msgs = {c: method.configure_fit(server, rnd, c) for c in cids}
    out = method.client_fit_many(msgs, dict.fromkeys(cids), {c: setup.clients[c] for c in cids})
    replies = {c: r for c, (r, _) in out.items()}
    for c, r in replies.items():
        method.validate_reply(server, "fit", rnd, c, r)
    server, _ = method.aggregate_fit(server, rnd, replies)
    _sync(setup.device)
    return server.params, time.perf_counter() - t0


def scoring_time(method, setup, rnd: int) -> float:
    """FedLAG's conflict scoring of one round: every layer's Gram matrix over the 20 clients' round deltas."""
    server = method.init_server()
    cids = [int(c) for c in setup.schedule[rnd - 1]]
    out = method.client_fit_many(
        {c: method.configure_fit(server, rnd, c) for c in cids}, {}, {c: setup.clients[c] for c in cids}
    )
    _sync(setup.device)
    t0 = time.perf_counter()
    for layer in layer_units(method.model, "tensor"):
        rows = torch.stack(
            [torch.cat([(r.arrays[n] - server.params[n]).reshape(-1) for n in layer]) for r, _ in out.values()]
        )
        conflict_counts(rows, xi=0.0)
    _sync(setup.device)
    return time.perf_counter() - t0


def round_flops(model: torch.nn.Module, x: torch.Tensor, records: int) -> float:
    """Floating-point operations of one epoch over ``records`` records: 2 per multiply-add of the forward of every
    Linear and Conv2d, as many for its weight gradient, and as many again for its input gradient except at the
    first parametric layer."""
    macs: list[float] = []

    def hook(mod, args, out):
        if isinstance(mod, torch.nn.Linear):
            macs.append(mod.in_features * mod.out_features)
        else:
            macs.append(out[0].numel() * mod.weight[0].numel())

    handles = [
        m.register_forward_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Linear | torch.nn.Conv2d)
    ]
    with torch.no_grad():
        model(x[:1])
    for h in handles:
        h.remove()
    return 2.0 * records * (2 * macs[0] + 3 * sum(macs[1:]))


def matmul_rate(device: torch.device) -> float:
    """FLOP/s of one large matmul (2048 x 2048 @ 2048 x 2048), the best of 5."""
    a, b = torch.randn(2048, 2048, device=device), torch.randn(2048, 2048, device=device)
    a @ b
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * 2048**3 / best


TOLERANCE = 1e-2  # of the round update's norm, per tensor


def difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    """The largest ``(||got - want|| - floor) / ||want - start||`` over the tensors: the distance between two paths'
    models after a round as a share of the round's update, less a float floor of ``1e-6 sqrt(numel)``. Float32
    rounding differences grow over a round of ~250 SGD steps (0.2% on the CNN conv2 on the CPU, at any thread
    count); :data:`TOLERANCE` bounds them."""
    worst = 0.0
    for n, w in want.items():
        diff = float((got[n].double().cpu() - w.double().cpu()).norm()) - 1e-6 * w.numel() ** 0.5
        update = float((w.double().cpu() - start[n].double().cpu()).norm())
        worst = max(worst, diff / update if update > 0 else (0.0 if diff <= 0 else float("inf")))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--models", default="dnn,fedavgcnn")
    ap.add_argument("--alphas", default="1.0,0.1")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (the records and models live there)")
    ap.add_argument("--no-vmap", action="store_true", help="leave out the vmap fallback path")
    ap.add_argument("--workers", type=int, default=2, help="worker processes of the workers path (0: leave it out)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # float32 arithmetic on every path: cuDNN's convolutions would otherwise run in TF32 on a GPU
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    rows, notes, far = [], [], []
    rate = matmul_rate(torch.device(args.device))
    for model in args.models.split(","):
        for alpha in args.alphas.split(","):
            cfg = load_config(
                "configs/fedlag/mnist-dnn-alpha10.toml",
                [
                    f'method.model="{model}"',
                    f"data.alpha={alpha}",
                    f"federation.rounds={args.repeat + 1}",
                    f'device="{args.device}"',
                ],
            )
            setup = build_setup(cfg)
            host = {c: (cl.train[0].cpu(), cl.train[1].cpu()) for c, cl in setup.clients.items()}
            fast, vm, slow, pooled = (build_method(setup) for _ in range(4))
            fast.base.vectorize = vm.base.vectorize = True
            slow.base.vectorize = pooled.base.vectorize = False
            vm.base.chain = None  # the torch.func.vmap fallback
            assert fast.base.chain is not None, "the model should have the hand-written backward"
            paths = {"batched": fast.base, "vmap": vm.base, "per-client": slow.base, "workers": pooled.base}
            if args.no_vmap:
                del paths["vmap"]
            if args.workers and setup.device.type == "cpu":
                pooled.base.pool = WorkerPool(pooled.base, workers=args.workers)
            else:
                del paths["workers"]
            times: dict[str, list[float]] = {k: [] for k in [*paths, "pfllib"]}
            apart: dict[str, float] = dict.fromkeys(paths, 0.0)  # each path's largest difference from the loop
            start = fast.base.init_server().params
            for rnd in range(1, args.repeat + 2):
                c, tc = pfllib_round(slow.base, setup, rnd, host)
                for k, m in paths.items():
                    a, ta = our_round(m, setup, rnd)
                    # same batches and arithmetic: the same model to float rounding
                    apart[k] = max(apart[k], difference(a, c, start))
                    if rnd > 1:  # the first round warms up
                        times[k].append(ta)
                if rnd > 1:
                    times["pfllib"].append(tc)
            workers = f", workers path {args.workers} x {pooled.base.pool.threads} threads" if pooled.base.pool else ""
            pooled.close()
            med = {k: statistics.median(v) for k, v in times.items()}
            score = statistics.median(scoring_time(fast.base, setup, 1) for _ in range(args.repeat))
            sizes = sorted(len(cl.train[1]) for cl in setup.clients.values())
            records = sum(len(cl.train[1]) for cl in setup.clients.values())
            floor = round_flops(fast.base.model, setup.clients[0].train[0], records) / rate
            row = {"model": model, "alpha": alpha}
            row.update({f"{k} (s)": med[k] for k in paths})
            row["PFLlib-style (s)"] = med["pfllib"]
            row["batched vs PFLlib-style"] = med["pfllib"] / med["batched"]
            if "vmap" in med:
                row["vmap vs PFLlib-style"] = med["pfllib"] / med["vmap"]
            if "workers" in med:
                row["workers vs PFLlib-style"] = med["pfllib"] / med["workers"]
            row["floor (s)"] = floor
            row["batched / floor"] = med["batched"] / floor
            row["batched us/record"] = 1e6 * med["batched"] / records
            row["conflict scoring (% of batched round)"] = 100 * score / med["batched"]
            row.update({f"{k} apart (% of update)": 100 * d for k, d in apart.items()})
            rows.append(row)
            far += [f"{model} alpha {alpha} {k}: {100 * d:.2f}%" for k, d in apart.items() if d > TOLERANCE]
            notes.append(
                f"- {model}, alpha {alpha}: client training sizes {sizes[0]}..{sizes[-1]} "
                f"(median {sizes[len(sizes) // 2]}), conflict scoring {1e3 * score:.1f} ms{workers}"
            )
    where = f"{args.threads} threads" if setup.device.type == "cpu" else torch.cuda.get_device_name(setup.device)
    notes.append(f"- one large matmul (2048^3): {rate / 1e9:.1f} GFLOP/s, the rate the floors assume")
    report(f"FedAvg round of the FedLAG setup: 20 MNIST clients, batch 16, {where}", rows, notes="\n".join(notes))
    if far:  # after the table, so that a run's times and differences are kept either way
        sys.exit(f"paths apart from the PFLlib-style loop by more than {100 * TOLERANCE:g}% of the update: {far}")


if __name__ == "__main__":
    main()
