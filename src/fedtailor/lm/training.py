"""DPO on a batch of tokenized pairs (:func:`fedtailor.lm.preference.tokenize_pairs`): sequence log-probabilities
of both sides in one forward pass, cached reference log-probabilities, and reward accuracy.

The reference log-probabilities of a set of pairs are computed once per run; with ``FEDTAILOR_REFERENCE_CACHE`` set
to a folder they are also kept there, keyed by the reference model's weights, the pairs' tokens, the precision, the
batch size, the device type and the torch version, so that runs on the same pairs and pretrained model (the
methods, steps, ranks and participations of an ablation) compute them once between them."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fedtailor.lm.dpo import DPOOutput, dpo_loss, response_logprobs

Tokens = dict[str, torch.Tensor]
log = logging.getLogger(__name__)


def _feed(h: Any, label: str, t: torch.Tensor) -> None:
    """Add one tensor to a digest: ``label``, its shape and dtype, then its bytes."""
    t = t.detach().cpu().contiguous()
    h.update(f"{label}{tuple(t.shape)}:{t.dtype};".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy())


def pairs_digest(tokens: Tokens) -> str:
    """A digest of tokenized pairs (every array, in name order): which set of pairs cached reference
    log-probabilities belong to."""
    h = hashlib.sha256()
    for name in sorted(tokens):
        _feed(h, f"{name}:", tokens[name])
    return h.hexdigest()[:16]


def bf16_native(device: torch.device) -> bool:
    """Whether ``device`` computes in bfloat16 natively: a CUDA device that supports it, or a CPU with AVX512-BF16 or
    AMX tiles; elsewhere autocast emulates bfloat16 arithmetic, far slower than fp32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return True  # another accelerator: its autocast is its own business
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def precision_warning(precision: str, device: torch.device) -> str | None:
    """One line naming the problem and the fix where ``precision`` is ``"bf16"`` on a ``device`` without native
    bfloat16 (:func:`bf16_native`); None where the precision suits the device."""
    if precision != "bf16" or bf16_native(device):
        return None
    where = "a CPU without AVX512-BF16 or AMX" if device.type == "cpu" else f"{device} without bfloat16 support"
    return (
        f'method.precision = "bf16" on {where}: autocast emulates bfloat16 there, about 29x slower than fp32 per DPO '
        "step on such a CPU (benchmarks/bench_dpo_step.py); set --set method.precision=fp32 unless the run must "
        "match bf16 results."
    )


def precision_context(model: Any, precision: str) -> contextlib.AbstractContextManager:
    """``"bf16"``: autocast to bfloat16 on the model's device (CPU or CUDA); ``"fp32"``: nothing."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision != "bf16":
        raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}.")
    device = next(model.parameters()).device.type
    return torch.autocast(device_type=device, dtype=torch.bfloat16)


def pair_logprobs(
    model: Any, tokens: Tokens, idx: torch.Tensor, *, precision: str = "fp32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(y+|x), log pi(y-|x)) of the pairs ``idx``: one forward pass over the 2B sequences."""
    device = next(model.parameters()).device
    ids = torch.cat([tokens["chosen_ids"][idx], tokens["rejected_ids"][idx]]).to(device)
    att = torch.cat([tokens["chosen_attention"][idx], tokens["rejected_attention"][idx]]).to(device)
    resp = torch.cat([tokens["chosen_response"][idx], tokens["rejected_response"][idx]]).to(device)
    with precision_context(model, precision):
        logits = model(input_ids=ids, attention_mask=att).logits
    lp = response_logprobs(logits, ids, resp)
    return lp[: len(idx)], lp[len(idx) :]


def _chunks(n: int, size: int) -> Iterator[torch.Tensor]:
    for start in range(0, n, size):
        yield torch.arange(start, min(n, start + size))


REFERENCE_CACHE = "FEDTAILOR_REFERENCE_CACHE"


def model_digest(model: Any, *, skip: str = "lora_") -> str:
    """A digest of ``model`` as a reference model: its config (where it has one) and every parameter whose name
    lacks ``skip`` (the adapters, off in the reference), each with its shape and dtype, in the model's order; names
    are left out, so that the base of an adapted model and the same model without adapters agree."""
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    h.update((config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else "").encode())
    for name, t in model.named_parameters():
        if skip not in name:
            _feed(h, "", t)
    return h.hexdigest()


def reference_cache_folder() -> Path | None:
    """The folder ``$FEDTAILOR_REFERENCE_CACHE`` where reference log-probabilities are kept; None where it is unset."""
    folder = os.environ.get(REFERENCE_CACHE, "").strip()
    return Path(folder).expanduser() if folder else None


def reference_cache_file(
    folder: Path, model: str, tokens: Tokens, *, batch_size: int = 16, precision: str = "fp32", device: torch.device
) -> Path:
    """The file in ``folder`` for the reference log-probabilities of ``tokens`` under the model of digest ``model``
    (:func:`model_digest`), at this precision, batch size, device type and torch version."""
    key = f"{model}|{pairs_digest(tokens)}|{batch_size}|{precision}|{device.type}|{torch.__version__}"
    return folder / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.pt"


def _read_cached(file: Path, n: int) -> torch.Tensor | None:
    """The (n, 2) finite float32 tensor in ``file``; None where it is missing, unreadable or anything else."""
    try:
        t = torch.load(file, weights_only=True)
    except Exception:  # missing, truncated or not a tensor file: computed again and rewritten
        return None
    ok = isinstance(t, torch.Tensor) and t.shape == (n, 2) and t.dtype == torch.float32
    return t if ok and bool(torch.isfinite(t).all()) else None


@torch.no_grad()
def reference_logprobs(
    model: Any, tokens: Tokens, *, batch_size: int = 16, precision: str = "fp32", cache: Path | None = None
) -> torch.Tensor:
    """(n, 2) log-probabilities of every pair under ``model`` (the frozen reference), computed once; with ``cache``
    (:func:`reference_cache_file`) read from that file where it holds them, else computed and written to it."""
    n = len(tokens["chosen_ids"])
    if cache is not None and (kept := _read_cached(cache, n)) is not None:
        return kept
    out = torch.cat(
        [
            torch.stack(pair_logprobs(model, tokens, idx, precision=precision), 1).float().cpu()
            for idx in _chunks(n, batch_size)
        ]
    )
    if cache is not None:  # written whole under a private name, then renamed: a reader never sees half a file
        part = cache.with_name(f".{cache.name}.{uuid.uuid4().hex}")
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            torch.save(out, part)
            os.replace(part, cache)
        except OSError as e:  # the run goes on without the cache
            with contextlib.suppress(OSError):
                part.unlink(missing_ok=True)
            log.warning(
                "%s: cannot keep reference log-probabilities there (%s); check %s.", cache.parent, e, REFERENCE_CACHE
            )
    return out


def dpo_on(
    model: Any, tokens: Tokens, ref: torch.Tensor, idx: torch.Tensor, *, beta: float, precision: str = "fp32"
) -> DPOOutput:
    """The DPO loss of pairs ``idx`` under ``model`` against their cached reference log-probabilities."""
    pc, pr = pair_logprobs(model, tokens, idx, precision=precision)
    r = ref[idx].to(pc.device)
    return dpo_loss(pc.float(), pr.float(), r[:, 0], r[:, 1], beta=beta)


@torch.no_grad()
def evaluate_pairs(
    model: Any, tokens: Tokens, ref: torch.Tensor, *, beta: float, batch_size: int = 16, precision: str = "fp32"
) -> tuple[float, float]:
    """(reward accuracy, mean DPO loss) over all pairs."""
    n = len(tokens["chosen_ids"])
    correct, loss = 0.0, 0.0
    for idx in _chunks(n, batch_size):
        out = dpo_on(model, tokens, ref, idx, beta=beta, precision=precision)
        correct += float((out.chosen_rewards > out.rejected_rewards).sum())
        loss += float(out.loss) * len(idx)
    return correct / n, loss / n
