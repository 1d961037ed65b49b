"""Language models: LoRA through PEFT on the attention projections of a (tiny, randomly initialised) Llama, and
the real SmolLM2: the GGUF -> safetensors conversion keeps the logits, and masks on its real tokenizer."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from fedtailor.lm.model import add_lora, load_causal_lm, smollm2_gguf, tiny_llama  # noqa: E402


def test_lora_adapts_only_the_attention_projections_and_starts_as_the_base():
    base = tiny_llama(seed=1)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = base(ids).logits
    model = add_lora(base, rank=4, alpha=8)
    lora = [n for n, _ in model.named_parameters() if "lora_" in n]
    assert lora and all(any(f".{t}." in n for t in ("q_proj", "k_proj", "v_proj")) for n in lora)
    assert len(lora) == 2 * 3 * 2  # A and B, three projections, two layers
    assert all(p.requires_grad for p in model.parameters())  # base and adapter train jointly
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before)  # B = 0 at the start: the adapted model is the base
    with pytest.raises(ValueError, match="rank"):
        add_lora(tiny_llama(), rank=0)


@pytest.mark.slow
def test_smollm2_conversion_keeps_the_logits_and_reloads(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("FEDTAILOR_CACHE", str(tmp_path))
    gguf = smollm2_gguf()
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = load_causal_lm("smollm2")
    assert (tmp_path / "models" / "smollm2-135m-instruct" / "model.safetensors").exists()
    ids = loaded.tokenizer("\n\nHuman: What is federated learning?\n\nAssistant:", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, direct(ids).logits, rtol=0, atol=1e-5)
    again = load_causal_lm("smollm2")  # from the cache folder now
    assert again.source == loaded.source and sum(p.numel() for p in again.model.parameters()) == 134_515_008
