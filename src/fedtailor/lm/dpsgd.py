"""Pair-level DP-SGD for the DPO methods: *Deep Learning with Differential Privacy* (Abadi, Chu, Goodfellow,
McMahan, Mironov, Talwar, Zhang 2016, arXiv:1607.00133), Algorithm 1 with Poisson sampling, in the notation of
:mod:`fedtailor.privacy.dpsgd` with a preference pair as the record:

    B_s = {j : U_j < q},  q = min(1, b / N)                                      (Poisson sampling of pairs)
    g~_s = ( sum_{j in B_s} clip_C(grad l_DPO(theta, phi; j)) + N(0, (zeta C)^2 I) ) / (q N)

and an AdamW step on ``g~_s`` (post-processing). The clip is **joint over every trained tensor**, the shared base
``theta`` and the private adapter ``phi`` together: the adapter never leaves the client, but it shapes every later
gradient of the base, so it is trained under the same noisy steps; adding or removing one pair then moves the
pre-noise sum by at most ``C`` (:func:`clipped_pair_sum`, tested), and everything the client keeps or sends is
post-processing of the noisy steps.

Per-pair gradients are formed one pair at a time (a microbatch of one: one forward and backward per sampled pair),
so memory is one model's gradients and one running sum whatever the batch, and any model works; a 135M-parameter
model at batch 4 needs about four copies of its parameters (weights, gradient, sum, AdamW's two moments: ``docs/
pfeddpo.md`` has the measurement). The noise of each tensor comes from the step's key (``secure_gaussian_noise``:
ChaCha20 and Opacus secure mode's sum of four draws), a fresh OS-entropy key per fit in secure mode.
"""

from __future__ import annotations

import math
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any

import torch

from fedtailor.fl.records import TrainingDiverged
from fedtailor.lm.training import dpo_on
from fedtailor.privacy.dpsgd import sampling_rate
from fedtailor.privacy.noise import open_unit, secure_gaussian_noise, secure_stream_words

Params = dict[str, torch.Tensor]
#: Noise draws per stream (label ``("noise", step, tensor, chunk)``): a 28M-entry embedding in 2^18-draw pieces.
NOISE_CHUNK = 1 << 18


def _norm64(g: torch.Tensor) -> torch.Tensor:
    """``||g||_2`` accumulated in float64."""
    return torch.linalg.vector_norm(g, dtype=torch.float64)


def clipped_pair_sum(
    model: Any,
    params: Params,
    tokens: dict,
    ref: torch.Tensor,
    idx: torch.Tensor,
    *,
    beta: float,
    clip: float,
    precision: str = "fp32",
) -> tuple[Params, list[float]]:
    """``sum_{j in idx} clip_C(grad l_DPO(j))`` over the tensors ``params`` (name -> the model's parameter), the clip
    joint over all of them; returns the sums and each pair's DPO loss. The parameters' ``.grad`` are left unset."""
    sums = {n: torch.zeros_like(p) for n, p in params.items()}
    losses = []
    for j in idx.reshape(-1, 1):
        for p in params.values():
            p.grad = None
        out = dpo_on(model, tokens, ref, j, beta=beta, precision=precision)
        out.loss.backward()
        grads = {n: p.grad for n, p in params.items() if p.grad is not None}
        # the joint norm in float64 (the reduction upcasts as it reads: no float64 copy of 135M gradients)
        norm = float(torch.linalg.vector_norm(torch.stack([_norm64(g) for g in grads.values()])))
        scale = min(1.0, clip / norm) if norm > 0 else 1.0
        for n, g in grads.items():
            sums[n].add_(g, alpha=scale)
        losses.append(float(out.loss.detach()))
    for p in params.values():
        p.grad = None
    return sums, losses


def noisy_gradients(
    sums: Params, params: Params, *, key: int, step: int, sigma: float, denom: float, pool: Executor | None
) -> None:
    """Set ``p.grad = (sums[name] + N(0, sigma^2 I)) / denom`` (in float64, then ``p``'s dtype) for every tensor,
    the noise of tensor ``i`` drawn chunk by chunk from the streams ``(key, "noise", step, i, j)``. The chunks are
    independent streams written to disjoint slices, so ``pool``'s threads fill them in any order with the same
    result as one after another (ChaCha20, the logarithms and the sums release the GIL); memory stays at a few
    chunks in flight."""
    chunks = []
    for i, (name, p) in enumerate(params.items()):
        clipped, grad = sums[name].reshape(-1), torch.empty_like(p)
        chunks += [(i, j, start, clipped, grad.view(-1)) for j, start in enumerate(range(0, p.numel(), NOISE_CHUNK))]
        p.grad = grad

    def fill(chunk: tuple[int, int, int, torch.Tensor, torch.Tensor]) -> None:
        i, j, start, clipped, flat = chunk
        size = min(NOISE_CHUNK, flat.numel() - start)
        z = torch.from_numpy(secure_gaussian_noise(key, "noise", step, i, j, sigma=sigma, size=size))
        flat[start : start + size] = (clipped[start : start + size].double() + z.to(flat.device)) / denom

    for _ in pool.map(fill, chunks) if pool is not None else map(fill, chunks):
        pass  # map is lazy: iterating runs the chunks (and raises what a thread raised)


def private_dpo_steps(
    model: Any,
    params: Params,
    opt: torch.optim.Optimizer,
    tokens: dict,
    ref: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    beta: float,
    clip: float,
    noise_multiplier: float,
    key: int,
    precision: str = "fp32",
    who: str = "a client",
    threads: int | None = None,
) -> float:
    """``steps`` DP-SGD steps (module docstring) with the optimizer ``opt`` over ``params``; sampling and noise
    from ``key`` (labels ``("sample", step)`` and ``("noise", step, tensor, chunk)``), the noise drawn on
    ``threads`` threads (default: torch's intra-op threads; the result does not depend on it). Returns the mean DPO
    loss of the sampled pairs (not private: for the caller's divergence check only, never sent)."""
    n = len(ref)
    q = sampling_rate(n, batch_size)
    losses: list[float] = []
    workers = torch.get_num_threads() if threads is None else threads
    with ThreadPoolExecutor(workers) if workers > 1 else nullcontext() as pool:
        for step in range(steps):
            uniforms = torch.from_numpy(open_unit(secure_stream_words(key, "sample", step, count=n)))
            chosen = (uniforms < q).nonzero().reshape(-1)
            sums, step_losses = clipped_pair_sum(
                model, params, tokens, ref, chosen, beta=beta, clip=clip, precision=precision
            )
            losses += step_losses
            noisy_gradients(sums, params, key=key, step=step, sigma=noise_multiplier * clip, denom=q * n, pool=pool)
            opt.step()
            opt.zero_grad(set_to_none=True)
    if not all(math.isfinite(v) for v in losses):
        raise TrainingDiverged(f"{who}'s DPO loss is {losses}")
    return sum(losses) / len(losses) if losses else float("nan")
