"""One local DP-SGD step of record-level DP (``[method.record_dp]``, :func:`fedtailor.privacy.dpsgd.dp_sgd`) against
a non-private SGD step and against Opacus (``GradSampleModule`` + ``DPOptimizer``, the same clip, noise
multiplier and expected batch) on the same model and batch, side by side in one run, for the FedLAG setup's DNN
and FedAvgCNN on MNIST-shaped records. Each step: a forward and backward of the batch, and for the private paths
per-record gradients (fedtailor: the batched clipped sums of ``layer_clipped_sum``, as record-level DP uses for
these models), the joint clip, Gaussian noise of every parameter and the update. fedtailor's noise is the
hardened ChaCha20 sampler record-level DP uses (four draws per output, as Opacus's ``secure_mode``); Opacus's is
one ``torch.normal`` draw (its ``secure_mode`` needs torchcsprng, not installed here); ``--noise none`` leaves
fedtailor's noise out to show the rest of the step. Each timed call runs ``--steps`` steps (one local run, so
``dp_sgd``'s setup is shared by its steps, as in training; ``--steps 1`` times a run of one step); times are
per step.

    python benchmarks/bench_dpsgd_step.py [--threads 1] [--batch 16] [--repeat 20] [--steps 10]
        [--noise secure|none] [--no-save]
    python benchmarks/bench_dpsgd_step.py --proximal   # FedProx / Ditto's proximal step: batched + penalty vs vmap

``--proximal`` times the step of a proximal objective (FedProx's local model, Ditto's personal one: cross-entropy
plus ``(mu / 2) ||w - a||^2``) both ways fedtailor can take it: the term inside each record's loss with per-record
gradients by ``torch.func.vmap`` (the path with momentum, and for every proximal run before 2026-12-05), against
the batched clipped sums of ``layer_clipped_sum`` with the term's gradient added to the noisy step (``penalty``).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from harness import report, time_call

from fedtailor.allocator import keep_freed_memory
from fedtailor.blas import single_thread_numpy_blas
from fedtailor.models.pflnets import DNN, FedAvgCNN
from fedtailor.privacy.dpsgd import dp_sgd
from fedtailor.privacy.noise import secure_gaussian_noise
from fedtailor.rng import derive_key

CLIP, NOISE, LR = 1.0, 1.1, 0.005


def plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def fedtailor_steps(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, noise: str, steps: int) -> dict:
    params = {n: p.detach() for n, p in model.named_parameters()}
    loss = lambda p, aux, xb, yb: F.cross_entropy(torch.func.functional_call(model, p, (xb,)), yb)
    key = derive_key(0, "bench")
    new, _, _ = dp_sgd(
        loss, params, x, y, trainable=set(params), epochs=steps, batch_size=len(x), lr=LR, clip=CLIP,
        noise_multiplier=NOISE, uniforms=lambda s, n: torch.zeros(n, dtype=torch.float64),
        noise=(lambda s, size: torch.zeros(size, dtype=torch.float64)) if noise == "none" else
        (lambda s, size: torch.from_numpy(secure_gaussian_noise(key, "noise", s, sigma=1.0, size=size))),
        model=model,
    )  # fmt: skip
    return new


def proximal_steps(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, *, batched: bool) -> dict:
    """``steps`` DP-SGD steps on cross-entropy + (mu / 2) ||w - a||^2, the term in the records' loss (vmap) or added
    to the noisy step (``batched``)."""
    from fedtailor.methods.pfl.local import prox_term, proximal_gradient

    params = {n: p.detach() for n, p in model.named_parameters()}
    anchor = {n: p + 0.01 for n, p in params.items()}
    mu = 0.1

    def loss(p, aux, xb, yb):
        value = F.cross_entropy(torch.func.functional_call(model, p, (xb,)), yb)
        return value if batched else value + prox_term(p, anchor, mu)

    key = derive_key(0, "bench")
    new, _, _ = dp_sgd(
        loss, params, x, y, trainable=set(params), epochs=steps, batch_size=len(x), lr=LR, clip=CLIP,
        noise_multiplier=NOISE, uniforms=lambda s, n: torch.zeros(n, dtype=torch.float64),
        noise=lambda s, size: torch.from_numpy(secure_gaussian_noise(key, "noise", s, sigma=1.0, size=size)),
        model=model if batched else None,
        penalty=(lambda p: proximal_gradient(p, anchor=anchor, mu=mu)) if batched else None,
    )  # fmt: skip
    return new


def measure_proximal(name: str, make: type[torch.nn.Module], args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    x, y = torch.rand(args.batch, 1, 28, 28), torch.randint(0, 10, (args.batch,))
    model, k = make(), args.steps
    t_vmap = time_call(lambda: proximal_steps(model, x, y, k, batched=False), repeat=args.repeat, warmup=3) / k
    t_ours = time_call(lambda: proximal_steps(model, x, y, k, batched=True), repeat=args.repeat, warmup=3) / k
    return {
        "model": name,
        "batch": args.batch,
        "term in each record's loss, vmap ms": 1e3 * t_vmap,
        "batched + penalty ms": 1e3 * t_ours,
        "batched / vmap": t_ours / t_vmap,
    }


def measure(name: str, make: type[torch.nn.Module], args: argparse.Namespace) -> dict:
    """One model's row: the three steps on the same batch, each timed over ``args.repeat`` calls."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    torch.manual_seed(0)
    x, y = torch.rand(args.batch, 1, 28, 28), torch.randint(0, 10, (args.batch,))
    plain, ours = make(), make()
    opt = torch.optim.SGD(plain.parameters(), lr=LR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = GradSampleModule(make())
        dp_opt = DPOptimizer(
            torch.optim.SGD(theirs.parameters(), lr=LR),
            noise_multiplier=NOISE,
            max_grad_norm=CLIP,
            expected_batch_size=args.batch,
        )
    k = args.steps  # steps per timed call (one local run: dp_sgd's setup shared by its steps), times per step
    t_plain = time_call(lambda: [plain_step(plain, opt, x, y) for _ in range(k)], repeat=args.repeat, warmup=3) / k
    t_ours = time_call(lambda: fedtailor_steps(ours, x, y, args.noise, k), repeat=args.repeat, warmup=3) / k
    t_opacus = time_call(lambda: [plain_step(theirs, dp_opt, x, y) for _ in range(k)], repeat=args.repeat, warmup=3) / k
    return {
        "model": name,
        "parameters": sum(p.numel() for p in plain.parameters()),
        "batch": args.batch,
        "SGD ms": 1e3 * t_plain,
        "fedtailor DP-SGD ms": 1e3 * t_ours,
        "Opacus ms": 1e3 * t_opacus,
        "fedtailor / SGD": t_ours / t_plain,
        "Opacus / fedtailor": t_opacus / t_ours,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--noise", choices=("secure", "none"), default="secure")
    ap.add_argument("--steps", type=int, default=10, help="steps per timed call (one local run); times are per step")
    ap.add_argument("--no-save", action="store_true", help="print only (a check run, not for RESULTS.md)")
    ap.add_argument("--proximal", action="store_true", help="only the proximal step, batched + penalty vs vmap")
    args = ap.parse_args()
    keep_freed_memory()  # as the command line does
    single_thread_numpy_blas()  # likewise
    torch.set_num_threads(args.threads)
    if args.proximal:
        report(
            "One local DP-SGD step of a proximal objective (FedProx, Ditto's personal model): two paths",
            [measure_proximal(name, make, args) for name, make in (("dnn", DNN), ("fedavgcnn", FedAvgCNN))],
            notes=f"secure noise on both; clip {CLIP}, noise multiplier {NOISE}, mu 0.1; {args.steps} steps per "
            "timed call (one local run), times per step",
            save=not args.no_save,
        )
        return
    rows = [measure(name, make, args) for name, make in (("dnn", DNN), ("fedavgcnn", FedAvgCNN))]
    report(
        "One local DP-SGD step (per-record clip + noise + update) against plain SGD and Opacus",
        rows,
        notes=f"noise: fedtailor {args.noise} sampler, Opacus torch.normal; clip {CLIP}, noise multiplier {NOISE}; "
        f"{args.steps} steps per timed call (one local run), times per step",
        save=not args.no_save,
    )


if __name__ == "__main__":
    main()
