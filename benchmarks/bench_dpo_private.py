"""Private pFedDPO on SmolLM2-135M with LoRA (rank 8), batch 4 pairs of the HH-RLHF harmless-base split, in one run:

* the plain pFedDPO step (one forward and backward over the batch, gradient-norm clip, AdamW) against the
  pair-level DP-SGD step of ``[method.record_dp]`` (:mod:`fedtailor.lm.dpsgd`: a forward and backward per pair,
  each pair's gradient clipped jointly over base and adapter, the client's Gaussian noise for every trained
  tensor, AdamW), and the noise draw on its own (secure: ChaCha20 and Opacus secure mode's sum of four);
* peak memory (max RSS) of a process that loads the model and takes three private steps.

    python benchmarks/bench_dpo_private.py [--threads 2] [--steps 3] [--precision fp32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import report

from fedtailor.lm.dpsgd import clipped_pair_sum, private_dpo_steps
from fedtailor.lm.model import add_lora, load_causal_lm
from fedtailor.lm.preference import HH_FILE, load_hh_rlhf, shared_data_file, tokenize_pairs
from fedtailor.lm.training import dpo_on, reference_logprobs
from fedtailor.privacy.noise import secure_gaussian_noise
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


def measure(steps: int, precision: str) -> dict[str, float]:
    model, params, tokens, ref = setup(precision)
    model.train()
    opt = torch.optim.AdamW(list(params.values()), lr=1e-4, weight_decay=0.0)
    plain, private, noise, clip_only = [], [], [], []
    key = fresh_key()
    for s in range(steps + 1):  # the first of each is a warm-up
        idx = torch.arange(4 * s, 4 * s + 4) % len(ref)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        dpo_on(model, tokens, ref, idx, beta=0.2, precision=precision).loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        t1 = time.perf_counter()
        clipped_pair_sum(model, params, tokens, ref, idx, beta=0.2, clip=1.0, precision=precision)
        t2 = time.perf_counter()
        for i, p in enumerate(params.values()):
            np.asarray(secure_gaussian_noise(key, "noise", s, i, sigma=1.0, size=p.numel()))
        t3 = time.perf_counter()
        private_dpo_steps(
            model, params, opt, tokens, ref, steps=1, batch_size=4, beta=0.2, clip=1.0, noise_multiplier=1.0,
            key=fresh_key(), precision=precision,
        )  # fmt: skip
        t4 = time.perf_counter()
        if s:
            plain.append(t1 - t0)
            clip_only.append(t2 - t1)
            noise.append(t3 - t2)
            private.append(t4 - t3)
    return {
        "plain step s": statistics.median(plain),
        "per-pair clipped sum s": statistics.median(clip_only),
        "noise s": statistics.median(noise),
        "private step s": statistics.median(private),
        "trained parameters": sum(p.numel() for p in params.values()),
    }


def peak_memory(steps: int, precision: str) -> float:
    code = (
        "import json, resource, sys; sys.path.insert(0, 'benchmarks'); import bench_dpo_private as b; "
        f"m, p, t, r = b.setup({precision!r}); m.train(); import torch; "
        "opt = torch.optim.AdamW(list(p.values()), lr=1e-4, weight_decay=0.0); "
        "from fedtailor.lm.dpsgd import private_dpo_steps; from fedtailor.rng import fresh_key; "
        f"private_dpo_steps(m, p, opt, t, r, steps={steps}, batch_size=4, beta=0.2, clip=1.0, noise_multiplier=1.0, "
        f"key=fresh_key(), precision={precision!r}); "
        "print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    m = measure(args.steps, args.precision)
    rows = [
        {"step": "plain pFedDPO (batch 4, AdamW)", "seconds": m["plain step s"], "vs plain": 1.0},
        {"step": "per-pair clipped sum (4 pairs)", "seconds": m["per-pair clipped sum s"]},
        {"step": "secure noise, every trained tensor", "seconds": m["noise s"]},
        {"step": "private pFedDPO (DP-SGD, AdamW)", "seconds": m["private step s"]},
    ]
    for r in rows:
        r["vs plain"] = r["seconds"] / m["plain step s"]
    rows.append({"step": "peak RSS of a private step (MB)", "seconds": peak_memory(1, args.precision)})
    report(
        f"Private pFedDPO step on SmolLM2-135M + LoRA ({m['trained parameters']:,} trained parameters, "
        f"{args.precision}, {args.threads} threads)",
        rows,
        notes="median of the steps after a warm-up; the last row is megabytes, not seconds",
    )
    print(json.dumps(m))


if __name__ == "__main__":
    main()
