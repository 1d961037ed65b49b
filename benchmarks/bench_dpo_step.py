"""pFedDPO on SmolLM2-135M (batch 4 pairs, 64 tokens) against a naive version, in one run:

* DPO step: naive (fp32, the reference model's forward at every step on a second model copy, per-tensor
  AdamW) against fedtailor's (cached reference log-probabilities, fused AdamW), in fp32 and with bf16
  autocast; the optimizer step timed on its own;
* a pFedDPO round of 5 clients x 3 steps through the method (streaming aggregation) and a round with the
  kappa^2 diagnostics;
* peak memory (max RSS) of a round with N = 1 and N = 5 clients (and N = 5 with ``spill_sum``: the running
  sum on disk between folds), each in its own subprocess.

    python benchmarks/bench_dpo_step.py [--threads 2] [--repeat 3] [--skip-memory]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import peak_rss_mb, report

from fedtailor.lm.dpo import dpo_loss
from fedtailor.lm.model import add_lora, load_causal_lm
from fedtailor.lm.preference import HH_FILE, federated_pairs, load_hh_rlhf, shared_data_file, tokenize_pairs
from fedtailor.lm.training import dpo_on, pair_logprobs, reference_logprobs


def _clients(lm, n: int, pairs: int = 120):
    from fedtailor.fl.records import ClientData

    data = load_hh_rlhf(shared_data_file(*HH_FILE))
    split = federated_pairs(data, num_clients=5, per_client=pairs, heldout=0, scheme="length", seed=41)
    return {
        c: ClientData(cid=c, seen=True, train=tokenize_pairs(lm.tokenizer, [data[i] for i in split.train[c]]))
        for c in range(n)
    }


def time_steps(
    model, tokens, ref, *, steps: int, precision: str, naive_ref=None, fused: bool = True
) -> tuple[float, float]:
    """Median seconds per DPO step and per optimizer step."""
    opt = (
        torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
        if fused
        else torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, foreach=False)
    )
    total, optim = [], []
    for s in range(steps + 1):
        idx = torch.arange(4 * s, 4 * s + 4) % len(ref)
        t0 = time.perf_counter()
        if naive_ref is not None:  # the reference forward at every step, on a second copy of the model
            with torch.no_grad():
                rc, rr = pair_logprobs(naive_ref, tokens, idx)
            pc, pr = pair_logprobs(model, tokens, idx)
            loss = dpo_loss(pc, pr, rc, rr, beta=0.2).loss
        else:
            loss = dpo_on(model, tokens, ref, idx, beta=0.2, precision=precision).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if s:  # the first step warms up
            total.append(t2 - t0)
            optim.append(t2 - t1)
    return statistics.median(total), statistics.median(optim)


def round_time(n: int, *, diagnostics: bool, threads: int, precision: str, spill: bool = False) -> dict[str, float]:
    """One pFedDPO round (setup excluded) of n clients x 3 steps; run in-process."""
    from fedtailor.fl.loop import InProcess, _fit_round, start
    from fedtailor.methods.dpo.pfeddpo import PFedDPO

    torch.set_num_threads(threads)
    lm = load_causal_lm("smollm2")
    clients = _clients(lm, n, pairs=24)
    method = PFedDPO(
        model=lm.model,
        personal=True,
        beta=0.2,
        lr=1e-4,
        local_steps=3,
        batch_size=4,
        grad_clip=1.0,
        seed=41,
        rounds=2,
        diagnostics_every=1 if diagnostics else 0,
        precision=precision,
        spill_sum=spill,
    )
    state = start(method, clients)
    import numpy as np

    t0 = time.perf_counter()
    record = _fit_round(method, state, InProcess(method, clients, state.clients), 1, np.arange(n))
    return {
        "seconds": time.perf_counter() - t0,
        "maxrss_mb": peak_rss_mb(),  # this child's own peak, not its parent's carried over the exec
        **{k: v for k, v in record.items() if k.startswith("kappa")},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-memory", action="store_true", help="skip the round and memory measurements")
    ap.add_argument("--rounds-only", action="store_true", help="only the round and memory measurements")
    ap.add_argument("--precision", default="bf16", choices=("fp32", "bf16"), help="of the measured rounds")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # a memory-measurement subprocess: print one JSON line
        n, diag, spill = (int(v) for v in args.child.split(","))
        print(
            json.dumps(
                round_time(n, diagnostics=bool(diag), threads=args.threads, precision=args.precision, spill=bool(spill))
            )
        )
        return
    torch.set_num_threads(args.threads)
    rows = []
    if not args.rounds_only:
        rows = step_rows(args)
    _finish(args, rows, [])


def step_rows(args: argparse.Namespace) -> list[dict]:
    lm = load_causal_lm("smollm2")
    tokens = _clients(lm, 1, pairs=24)[0].train
    model = add_lora(copy.deepcopy(lm.model), rank=8, alpha=16)
    ref = reference_logprobs(model, tokens)
    rows = []
    naive_ref = copy.deepcopy(lm.model).eval()
    t_naive, o_naive = time_steps(
        add_lora(copy.deepcopy(lm.model), rank=8, alpha=16),
        tokens,
        ref,
        steps=args.repeat,
        precision="fp32",
        naive_ref=naive_ref,
        fused=False,
    )
    del naive_ref
    t32, o32 = time_steps(model, tokens, ref, steps=args.repeat, precision="fp32")
    t16, o16 = time_steps(model, tokens, ref, steps=args.repeat, precision="bf16")
    for path, t, o in (
        ("naive: fp32, reference forward each step (2nd copy), per-tensor AdamW", t_naive, o_naive),
        ("fedtailor: cached reference, fused AdamW, fp32", t32, o32),
        ("fedtailor: cached reference, fused AdamW, bf16 autocast", t16, o16),
    ):
        rows.append(
            {
                "DPO step (batch 4 pairs, 64 tokens)": path,
                "seconds per step": t,
                "optimizer step (s)": o,
                "speed-up vs naive": t_naive / t,
            }
        )
    return rows


def _finish(args: argparse.Namespace, rows: list[dict], notes: list[str]) -> None:
    if not args.skip_memory:
        res = {}
        for n, diag, spill in ((1, 0, 0), (5, 0, 0), (5, 1, 0), (5, 0, 1)):
            out = (
                subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--threads",
                        str(args.threads),
                        "--precision",
                        args.precision,
                        "--child",
                        f"{n},{diag},{spill}",
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            res[n, diag, spill] = json.loads(out)
        one, five, diag, spilled = res[1, 0, 0], res[5, 0, 0], res[5, 1, 0], res[5, 0, 1]
        notes += [
            f"- pFedDPO round, 5 clients x 3 steps ({args.precision}): {five['seconds']:.1f} s; with the kappa^2 "
            f"diagnostics: {diag['seconds']:.1f} s (kappa2 {diag.get('kappa2', float('nan')):.4g})",
            f"- peak memory (max RSS): N = 1 {one['maxrss_mb']:.0f} MB, N = 5 {five['maxrss_mb']:.0f} MB "
            f"(ratio {five['maxrss_mb'] / one['maxrss_mb']:.3f}); N = 5 with spill_sum "
            f"{spilled['maxrss_mb']:.0f} MB (ratio {spilled['maxrss_mb'] / one['maxrss_mb']:.3f}), "
            f"round {spilled['seconds']:.1f} s",
        ]
    report(
        f"pFedDPO on SmolLM2-135M: DPO step and round, {args.threads} threads",
        rows or [{"rows": "rounds only"}],
        notes="\n".join(notes),
    )


if __name__ == "__main__":
    main()
