"""One private round of compact adaptation (2 clients, m_g = 333, k = 16,384, MNIST LeNet), the project's path
against a naive one measured in the same run, with a profile of where the time goes.

Naive: per-record gradients by a Python loop (333 backward passes) and a dense projection P^T g. A dense P at
k = 16,384 is 5.6 GB, so the naive projection is timed with a dense P of k_small columns and scaled by
k / k_small (a dense matrix product costs linearly in k).

    python benchmarks/bench_compact_round.py [--threads 2] [--repeat 3] [--codec lrsuq]
    python benchmarks/bench_compact_round.py --full-run      # also time the full 500-round MNIST run
    python benchmarks/bench_compact_round.py --device cuda   # the records, model and P on a GPU (timings synced)
    python benchmarks/bench_compact_round.py --allocator     # glibc keeping freed memory or not (fresh processes)
    python benchmarks/bench_compact_round.py --blas 60       # numpy's BLAS on one thread or not (fresh processes)
    python benchmarks/bench_compact_round.py --full-space    # Full-DG / Global's release input: batched vs per-record

Like the command line, the benchmark first has glibc keep freed memory (fedtailor.allocator.keep_freed_memory) and
numpy's BLAS run on one thread (fedtailor.blas.single_thread_numpy_blas);
``--allocator`` measures what that is worth: the per-record coefficient gradients of 333 records (LeNet, default
P, one thread) in fresh processes with and without it, alternated, with the page faults per call.

The full run is the MNIST setting of *Privacy-Aligned Personalized Federated Learning with Compact
Adaptation and Variable-Length Gaussian Communication*.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from harness import report

from fedtailor.allocator import keep_freed_memory
from fedtailor.blas import single_thread_numpy_blas
from fedtailor.codecs import release_key
from fedtailor.codecs.format import pad
from fedtailor.config import load_config
from fedtailor.experiment import build_method, build_setup
from fedtailor.fl.loop import start
from fedtailor.fl.records import Message
from fedtailor.models.layerwise import LayerKroneckerSubspace
from fedtailor.privacy.mechanisms import clipped_mean, per_example_gradients

_DEVICE = torch.device("cpu")


def _now() -> float:
    """Wall clock after the device's queued work has finished (a GPU runs asynchronously)."""
    if _DEVICE.type == "cuda":
        torch.cuda.synchronize(_DEVICE)
    return time.perf_counter()


def profile_round(method, server, setup, rnd: int) -> dict[str, float]:
    """Wall time of each step of one round, summed over its clients (what client_fit and the server do)."""
    t = dict.fromkeys(("configure", "per_record_grads", "project", "clip_mean", "encode", "decode", "server_step"), 0.0)
    replies = {}
    for cid in (int(c) for c in setup.schedule[rnd - 1]):
        t0 = _now()
        msg = method.configure_fit(server, rnd, cid)
        t1 = _now()
        x, y = setup.clients[cid].train
        idx = method.batch_indices(rnd, cid, x)
        theta = method.theta(msg.arrays["a"])
        if isinstance(method.P, LayerKroneckerSubspace):  # coefficient gradients in one pass: no projection step
            g = method.record_gradients(x[idx], y[idx], theta)
            t2 = t3 = _now()
        else:
            g = per_example_gradients(
                method.model, F.cross_entropy, x[idx], y[idx], params=method.layout.unflatten(theta)
            )
            t2 = _now()
            g = method.P.project(g)
            t3 = _now()
        u = clipped_mean(g, clip=method.clip, denominator=method.m_g).double().cpu().numpy()
        t4 = _now()
        key = release_key(method.init_client(cid).codec_secret, cid, rnd)
        payload = method.codec.encode(u, key=key, sigma=server.sigma)
        if server.pad_bytes is not None:
            payload = pad(payload, size=server.pad_bytes)
        t5 = _now()
        reply = Message(config={"payload": payload})
        method.validate_reply(server, "fit", rnd, cid, reply)
        t6 = _now()
        replies[cid] = reply
        for k, v in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
            t[k] += v
    t0 = _now()
    method.aggregate_fit(server, rnd, replies)
    t["server_step"] = _now() - t0
    return t


def naive_round(method, server, setup, rnd: int, k_small: int) -> float:
    """Per-record loop + dense projection on k_small columns, scaled to k."""
    d, k = method.d, method.k
    P_small = torch.linalg.qr(torch.randn(d, k_small, generator=torch.Generator().manual_seed(0)))[0].to(_DEVICE)
    total = 0.0
    for cid in (int(c) for c in setup.schedule[rnd - 1]):
        x, y = setup.clients[cid].train
        theta = method.theta(method.coefficients(server, [cid])[0][0].detach())  # no new ledger entry
        params = {n: p.detach().clone().requires_grad_(True) for n, p in method.layout.unflatten(theta).items()}
        t0 = _now()
        rows = []
        for i in range(method.m_g):
            out = torch.func.functional_call(method.model, params, (x[i : i + 1],))
            grads = torch.autograd.grad(F.cross_entropy(out, y[i : i + 1]), list(params.values()))
            rows.append(torch.cat([g.reshape(-1) for g in grads]))
        G = torch.stack(rows)
        t1 = _now()
        G @ P_small
        t2 = _now()
        total += (t1 - t0) + (t2 - t1) * k / k_small
    return total


_ALLOCATOR_PROBE = """
import json, resource, sys, time
import torch, torch.nn.functional as F
from fedtailor.allocator import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
from fedtailor.models.lenet import LeNet
from fedtailor.models.subspace import make_subspace
torch.set_num_threads(1)
torch.manual_seed(0)
m = LeNet()
p = make_subspace(dim=85_822, rank=16_384, seed=41, transform="layer-kronecker", model=m, allocation="sqrt")
x, y = torch.rand(333, 1, 28, 28), torch.randint(0, 10, (333,))
for _ in range(3):
    p.per_record_coefficients(m, F.cross_entropy, x, y)
f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
for _ in range(10):
    p.per_record_coefficients(m, F.cross_entropy, x, y)
ms, faults = 100 * (time.perf_counter() - t0), (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 10
print(json.dumps({"kept": kept, "ms": ms, "faults": faults}))
"""


def allocator_rows(pairs: int) -> list[dict]:
    """Per-record coefficient gradients (333 records, one thread) in fresh processes, glibc keeping freed memory
    or not, ``pairs`` times each, alternated; medians."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    got: dict[str, list[dict]] = {"keep": [], "default": []}
    for _ in range(pairs):
        for mode in got:
            out = subprocess.run(
                [sys.executable, "-c", _ALLOCATOR_PROBE, mode], env=env, capture_output=True, text=True, check=True
            )
            got[mode].append(json.loads(out.stdout))
    base = statistics.median(r["ms"] for r in got["default"])
    return [
        {
            "allocator": "freed memory kept (keep_freed_memory)" if mode == "keep" else "glibc default",
            "ms per call": statistics.median(r["ms"] for r in runs),
            "page faults per call": statistics.median(r["faults"] for r in runs),
            "time vs default": statistics.median(r["ms"] for r in runs) / base,
        }
        for mode, runs in got.items()
    ]


def blas_rows(pairs: int, *, rounds: int, threads: int) -> list[dict]:
    """The first ``rounds`` rounds of the MNIST run (`fedtailor run`, ``threads`` torch threads) in fresh processes,
    numpy's BLAS on one thread (the command line's default) or on ``threads`` (``OPENBLAS_NUM_THREADS`` set: the
    user's setting wins, as before fedtailor.blas), ``pairs`` times each, alternated; medians of the wall time and
    of the rounds' own time (the sum of ``seconds`` in metrics.jsonl)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS")}
    env["OMP_NUM_THREADS"] = str(threads)
    modes = {"one": {}, "pool": {"OPENBLAS_NUM_THREADS": str(threads)}}
    got: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    for _ in range(pairs):
        for mode, extra in modes.items():
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [sys.executable, "-m", "fedtailor", "run", "configs/compact/mnist-eps16.toml", "--out", tmp]
                cmd += ["--set", 'method.variant="ours-lrsuq"', "--set", f"federation.rounds={rounds}"]
                cmd += ["--set", "federation.eval_every=1000000", "--no-progress", "--no-plots"]
                t0 = time.perf_counter()
                subprocess.run(cmd, env={**env, **extra}, capture_output=True, text=True, check=True)
                wall = time.perf_counter() - t0
                with open(Path(tmp) / "metrics.jsonl") as fh:
                    fit = sum(json.loads(line).get("seconds", 0.0) for line in fh if line.strip())
            got[mode].append((wall, fit))
    base = statistics.median(f for _, f in got["pool"])
    names = {"one": "numpy's BLAS on one thread (default)", "pool": f"OPENBLAS_NUM_THREADS={threads} (before)"}
    return [
        {
            "numpy BLAS": names[mode],
            "wall s": statistics.median(w for w, _ in runs),
            "rounds s": statistics.median(f for _, f in runs),
            "rounds time vs before": statistics.median(f for _, f in runs) / base,
        }
        for mode, runs in got.items()
    ]


def full_space_rows(repeat: int) -> list[dict]:
    """The release input u of a Full-DG client (m_g = 333, d = 85,822) both ways in one process: per-record
    gradients by vmap then the clipped mean (the path with diagnostics on, and before) against the clipped sum of
    one batched pass (ghost clipping, the default); medians over ``repeat`` rounds after one warm-up."""
    got: dict[str, list[float]] = {"per-record": [], "batched": []}
    methods = {}
    for mode, extra in (("per-record", ["method.diagnostics=true"]), ("batched", [])):
        cfg = load_config("configs/compact/mnist-eps16.toml", ['method.variant="full-dg"', *extra])
        setup = build_setup(cfg)
        methods[mode] = (build_method(setup), setup)
    a = torch.zeros(methods["batched"][0].d)
    cid = int(methods["batched"][1].schedule[0, 0])
    for rnd in range(1, repeat + 2):
        for mode, (method, setup) in methods.items():
            t0 = _now()
            method.release_input(a, rnd, setup.clients[cid])
            if rnd > 1:
                got[mode].append(_now() - t0)
    base = statistics.median(got["per-record"])
    names = {
        "per-record": "per-record gradients (vmap) + clipped mean (diagnostics on; before)",
        "batched": "clipped sum from one batched pass (ghost clipping; default)",
    }
    return [
        {
            "Full-DG release input": names[mode],
            "ms per client": 1e3 * statistics.median(times),
            "time vs per-record": statistics.median(times) / base,
        }
        for mode, times in got.items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--codec", default="lrsuq")
    ap.add_argument("--k-small", type=int, default=1024)
    ap.add_argument(
        "--transforms", default="layer-kronecker,kronecker,blocked-dct", help="subspaces timed side by side"
    )
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument(
        "--full-run", action="store_true", help="also time the 500-round MNIST run with the first transform"
    )
    ap.add_argument("--allocator", action="store_true", help="only the allocator comparison (fresh processes)")
    ap.add_argument("--blas", type=int, metavar="ROUNDS", help="only the numpy-BLAS comparison over ROUNDS rounds")
    ap.add_argument("--full-space", action="store_true", help="only Full-DG's release input, batched vs per-record")
    args = ap.parse_args()
    if args.full_space:
        keep_freed_memory()
        single_thread_numpy_blas()
        torch.set_num_threads(args.threads)
        report(
            "Compact adaptation, Full-DG / Global: one client's release input (m_g = 333, LeNet), "
            f"{args.threads} threads",
            full_space_rows(args.repeat),
            notes=f"medians over {args.repeat} rounds after one warm-up, the two paths alternated in one process.",
        )
        return
    if args.blas:
        report(
            f"Compact adaptation, {args.blas} rounds of the MNIST run, {args.threads} threads: numpy's BLAS pool",
            blas_rows(args.repeat, rounds=args.blas, threads=args.threads),
            notes=f"{args.repeat} fresh processes per row, alternated; medians; no evaluation but the final one.",
        )
        return
    if args.allocator:
        report(
            "Per-record coefficient gradients (333 records, LeNet, default P, 1 thread): glibc keeping freed memory",
            allocator_rows(args.repeat),
            notes=f"{args.repeat} fresh processes per row, alternated; 10 calls each after 3 warm-up calls; medians.",
        )
        return
    keep_freed_memory()  # as the command line does
    single_thread_numpy_blas()  # likewise
    torch.set_num_threads(args.threads)
    global _DEVICE
    _DEVICE = torch.device(args.device)
    variant = "ours-lrsuq" if args.codec == "lrsuq" else "ours-dg"
    base = [f'method.codec="{args.codec}"', f'method.variant="{variant}"', f'device="{args.device}"']
    rows, notes, naive = [], [], None
    transforms = args.transforms.split(",")
    for transform in transforms:
        cfg = load_config("configs/compact/mnist-eps16.toml", [*base, f'method.subspace_transform="{transform}"'])
        setup = build_setup(cfg)
        method = build_method(setup)
        server = start(method, setup.clients).server  # init + the one-shot context releases
        profiles = [profile_round(method, server, setup, rnd) for rnd in range(1, args.repeat + 2)][1:]  # 1 warm-up
        prof = {k: statistics.median(p[k] for p in profiles) for k in profiles[0]}
        ours = sum(prof.values())
        if naive is None:
            naive = naive_round(method, server, setup, 1, args.k_small)
        rows.append({"path": f"fedtailor, P = {transform}", "seconds per round": ours, "ratio vs naive": naive / ours})
        notes.append(
            f"Profile with P = {transform} (seconds, both clients):\n\n"
            + "\n".join(f"- {k}: {v:.4f} ({100 * v / ours:.0f}%)" for k, v in prof.items())
        )
    rows.append(
        {
            "path": f"naive (per-record loop + dense P, scaled from k={args.k_small})",
            "seconds per round": naive,
            "ratio vs naive": 1.0,
        }
    )
    for r in rows:
        r[f"ratio vs {transforms[-1]}"] = rows[len(transforms) - 1]["seconds per round"] / r["seconds per round"]
    text = "\n\n".join(notes)
    if args.full_run:
        cfg = load_config("configs/compact/mnist-eps16.toml", [*base, f'method.subspace_transform="{transforms[0]}"'])
        with tempfile.TemporaryDirectory() as tmp:
            from fedtailor.rundir import read_results
            from fedtailor.runner import run_experiment

            t0 = time.perf_counter()
            out = run_experiment(cfg, Path(tmp) / "run", progress=False)
            wall = time.perf_counter() - t0
            res = read_results(out)
        text += (
            f'\n\nFull run `fedtailor run configs/compact/mnist-eps16.toml --set method.variant="{variant}" '
            f'--set method.subspace_transform="{transforms[0]}"`: {wall / 60:.1f} min for {res["rounds"]} rounds '
            f"(Seen {100 * res['summary']['seen/accuracy']:.1f}%, "
            f"Future {100 * res['summary']['future/accuracy']:.1f}%,"
            f" eps {res['method_summary']['epsilon_max']:.2f}, T_max {res['method_summary']['T_max']})"
        )
    title = f"Compact adaptation: one private round, codec {args.codec}, {args.threads} threads, {args.device}"
    report(title, rows, notes=text)


if __name__ == "__main__":
    main()
