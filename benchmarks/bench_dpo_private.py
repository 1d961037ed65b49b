"""Private pFedDPO on SmolLM2-135M with LoRA (rank 8), batch 4 pairs of the HH-RLHF harmless-base split, in one run:

* the plain pFedDPO step (one forward and backward over the batch, gradient-norm clip, AdamW) against the
  pair-level DP-SGD step of ``[method.record_dp]`` (:mod:`fedtailor.lm.dpsgd`: a forward and backward per pair,
  each pair's gradient clipped jointly over base and adapter, the client's Gaussian noise for every trained
  tensor, AdamW), and the noise draw on its own (secure: ChaCha20 and Opacus secure mode's sum of four) on one
  thread and on ``--threads`` threads (the same values: independent streams per chunk);
* the same clipped sum by Opacus's ``GradSampleModule`` (per-sequence gradients by hooks, summed per pair),
  checked equal to ours;
* peak memory (``VmHWM``) of a fresh process that loads the model and takes one private step (``--memory-only``:
  that alone).

    python benchmarks/bench_dpo_private.py [--threads 2] [--steps 3] [--precision fp32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import report

from fedtailor.lm.dpsgd import clipped_pair_sum, noisy_gradients, private_dpo_steps
from fedtailor.lm.model import add_lora, load_causal_lm
from fedtailor.lm.preference import HH_FILE, load_hh_rlhf, shared_data_file, tokenize_pairs
from fedtailor.lm.training import dpo_on, reference_logprobs
from fedtailor.rng import fresh_key


def setup(precision: str):
    lm = load_causal_lm("smollm2")
    model = add_lora(lm.model, rank=8, alpha=16, seed=0)
    data = load_hh_rlhf(shared_data_file(*HH_FILE))
    tokens = tokenize_pairs(lm.tokenizer, data[:16], max_length=128)
    with model.disable_adapter():
        ref = reference_logprobs(model, tokens, precision=precision)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    return model, params, tokens, ref


def opacus_clipped_sum(
    model, params, tokens, ref, idx: torch.Tensor, *, beta: float, clip: float, precision: str
) -> dict[str, torch.Tensor]:
    """The clipped sum of ``clipped_pair_sum`` by Opacus's ``GradSampleModule``: one forward and backward over the
    2B sequences with per-sequence gradients (its hooks; functorch for modules without a grad sampler, such as
    the RMS norms), each pair's gradient the sum of its two sequences', clipped jointly over every trained
    tensor."""
    from opacus import GradSampleModule

    gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum")
    try:
        for p in params.values():
            p.grad = p.grad_sample = None
        b = len(idx)
        (dpo_on(gsm, tokens, ref, idx, beta=beta, precision=precision).loss * b).backward()  # the loss as a sum
        pairs = {n: p.grad_sample[:b] + p.grad_sample[b:] for n, p in params.items() if p.grad_sample is not None}
        norms = torch.sqrt(sum(g.reshape(b, -1).double().pow(2).sum(1) for g in pairs.values()))
        scale = (clip / norms).clamp(max=1.0).float()
        return {n: torch.einsum("b,b...->...", scale, g) for n, g in pairs.items()}
    finally:
        gsm._close()
        for p in params.values():
            p.grad = None


def measure(steps: int, precision: str) -> dict[str, float]:
    model, params, tokens, ref = setup(precision)
    model.train()
    opt = torch.optim.AdamW(list(params.values()), lr=1e-4, weight_decay=0.0)
    plain, private, noise, noise_threads, clip_only, opacus = [], [], [], [], [], []
    apart = 0.0  # the largest relative distance between Opacus's clipped sum and ours, over tensors and steps
    key = fresh_key()
    zeros = {n: torch.zeros_like(p) for n, p in params.items()}
    pool = ThreadPoolExecutor(torch.get_num_threads())
    for s in range(steps + 1):  # the first of each is a warm-up
        idx = torch.arange(4 * s, 4 * s + 4) % len(ref)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        dpo_on(model, tokens, ref, idx, beta=0.2, precision=precision).loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        t1 = time.perf_counter()
        ours, _ = clipped_pair_sum(model, params, tokens, ref, idx, beta=0.2, clip=1.0, precision=precision)
        t2 = time.perf_counter()
        theirs = opacus_clipped_sum(model, params, tokens, ref, idx, beta=0.2, clip=1.0, precision=precision)
        t3 = time.perf_counter()
        # at the same parameters as ours: the two sums must agree
        assert set(theirs) == set(ours), "Opacus and fedtailor clip different tensors"
        apart = max(apart, *(float((theirs[n] - g).norm() / g.norm().clamp(min=1e-30)) for n, g in ours.items()))
        t4 = time.perf_counter()
        noisy_gradients(zeros, params, key=key, step=s, sigma=1.0, denom=1.0, pool=None)
        t4b = time.perf_counter()
        noisy_gradients(zeros, params, key=key, step=s, sigma=1.0, denom=1.0, pool=pool)
        t5 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        private_dpo_steps(
            model, params, opt, tokens, ref, steps=1, batch_size=4, beta=0.2, clip=1.0, noise_multiplier=1.0,
            key=fresh_key(), precision=precision,
        )  # fmt: skip
        t6 = time.perf_counter()
        if s:
            plain.append(t1 - t0)
            clip_only.append(t2 - t1)
            opacus.append(t3 - t2)
            noise.append(t4b - t4)
            noise_threads.append(t5 - t4b)
            private.append(t6 - t5)
    pool.shutdown()
    return {
        "plain step s": statistics.median(plain),
        "per-pair clipped sum s": statistics.median(clip_only),
        "noise s": statistics.median(noise),
        "noise threads s": statistics.median(noise_threads),
        "private step s": statistics.median(private),
        "opacus clipped sum s": statistics.median(opacus),
        "opacus apart": apart,
        "trained parameters": sum(p.numel() for p in params.values()),
    }


def peak_memory(steps: int, precision: str) -> float:
    """The peak resident memory (MB) of a fresh process that loads the model and takes ``steps`` private steps:
    its own (:func:`harness.peak_rss_mb`)."""
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); import bench_dpo_private as b; "
        f"m, p, t, r = b.setup({precision!r}); m.train(); import torch; "
        "opt = torch.optim.AdamW(list(p.values()), lr=1e-4, weight_decay=0.0); "
        "from fedtailor.lm.dpsgd import private_dpo_steps; from fedtailor.rng import fresh_key; "
        f"private_dpo_steps(m, p, opt, t, r, steps={steps}, batch_size=4, beta=0.2, clip=1.0, noise_multiplier=1.0, "
        f"key=fresh_key(), precision={precision!r}); "
        "from harness import peak_rss_mb; print(json.dumps(peak_rss_mb()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--memory-only", action="store_true", help="only the peak memory of a private step")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_only:
        mb = peak_memory(1, args.precision)
        report(
            f"Peak memory of a private pFedDPO step on SmolLM2-135M + LoRA ({args.precision})",
            [{"process": "load, reference log-probs of 16 pairs, one private step", "peak RSS (MB)": mb}],
            notes="VmHWM of a fresh process",
        )
        return
    m = measure(args.steps, args.precision)
    rows = [
        {"step": "plain pFedDPO (batch 4, AdamW)", "seconds": m["plain step s"], "vs plain": 1.0},
        {"step": "per-pair clipped sum (4 pairs)", "seconds": m["per-pair clipped sum s"]},
        {"step": "secure noise, every trained tensor, one thread", "seconds": m["noise s"]},
        {"step": f"secure noise, every trained tensor, {args.threads} threads", "seconds": m["noise threads s"]},
        {"step": "private pFedDPO (DP-SGD, AdamW)", "seconds": m["private step s"]},
        {"step": "Opacus GradSampleModule: the same clipped sum", "seconds": m["opacus clipped sum s"]},
    ]
    for r in rows:
        r["vs plain"] = r["seconds"] / m["plain step s"]
    rows.append({"step": "peak RSS of a private step (MB)", "seconds": peak_memory(1, args.precision)})
    report(
        f"Private pFedDPO step on SmolLM2-135M + LoRA ({m['trained parameters']:,} trained parameters, "
        f"{args.precision}, {args.threads} threads)",
        rows,
        notes="median of the steps after a warm-up; the last row is megabytes, not seconds; Opacus's clipped sum "
        f"is {m['opacus apart']:.2g} apart from ours (largest ||theirs - ours|| / ||ours|| over tensors and steps); "
        f"Opacus / fedtailor clipped sum {m['opacus clipped sum s'] / m['per-pair clipped sum s']:.2f}",
    )
    print(json.dumps(m))


if __name__ == "__main__":
    main()
