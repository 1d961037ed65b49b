"""Language models: LoRA through PEFT on the attention projections of a (tiny, randomly initialised) Llama, and
the real SmolLM2: the GGUF -> safetensors conversion keeps the logits, and masks on its real tokenizer."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from fedtailor.lm.model import add_lora, load_causal_lm, publish, smollm2_gguf, tiny_llama


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


def test_the_adapter_initialisation_comes_from_its_seed_alone():
    """PEFT draws LoRA's A from torch's global generator; add_lora draws it from its seed (a pFedDPO run
    reproduces from its config) and leaves the global generator where it was."""

    def adapters(seed: int) -> dict[str, torch.Tensor]:
        torch.rand(3)  # a different global state before each build
        return {
            n: p.detach().clone()
            for n, p in add_lora(tiny_llama(seed=1), rank=4, seed=seed).named_parameters()
            if "lora_A" in n
        }

    first, again, other = adapters(5), adapters(5), adapters(6)
    assert first and all(torch.equal(first[n], again[n]) for n in first)
    assert not any(torch.equal(first[n], other[n]) for n in first)
    state = torch.get_rng_state()
    add_lora(tiny_llama(seed=1), rank=4, seed=5)
    assert torch.equal(torch.get_rng_state(), state)


def test_of_two_conversions_at_once_the_second_keeps_the_first_complete_cache(tmp_path):
    out = tmp_path / "model"
    for name, text in (("a", "first"), ("b", "second")):  # two processes, each with its own complete folder
        tmp = tmp_path / f"model.partial-{name}"
        tmp.mkdir()
        (tmp / "config.json").write_text(text)
        assert publish(tmp, out) == out
    assert (out / "config.json").read_text() == "first" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    lone = tmp_path / "other.partial"
    lone.mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "stray").write_text("")  # a folder in the way that is not a cache: the error stands
    with pytest.raises(OSError):
        publish(lone, tmp_path / "other")


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


@pytest.mark.slow
def test_one_pfeddpo_round_on_smollm2_uploads_only_the_base_and_fits_its_pairs(tmp_path):
    """The real model, briefly: 2 clients x 4 pairs of HH-RLHF, 4 steps; the upload holds no adapter tensor and
    the DPO loss falls on the pairs trained on."""
    import numpy as np

    from fedtailor.fl.loop import start
    from fedtailor.fl.records import ClientData
    from fedtailor.lm.preference import (
        HH_FILE,
        federated_pairs,
        load_hh_rlhf,
        shared_data_file,
        tokenize_pairs,
    )
    from fedtailor.methods.dpo.pfeddpo import PFedDPO

    path = shared_data_file(*HH_FILE)
    if path is None:
        pytest.skip("needs ../shared/data/hh-rlhf-harmless-base")
    lm = load_causal_lm("smollm2")
    pairs = load_hh_rlhf(path)
    split = federated_pairs(pairs, num_clients=2, per_client=4, heldout=0, scheme="length", seed=1)
    clients = {
        c: ClientData(cid=c, seen=True, train=tokenize_pairs(lm.tokenizer, [pairs[i] for i in split.train[c]]))
        for c in range(2)
    }
    method = PFedDPO(
        model=lm.model,
        personal=True,
        beta=0.2,
        lr=1e-4,
        local_steps=4,
        batch_size=4,
        grad_clip=1.0,
        seed=1,
        rounds=1,
        precision="bf16",
    )
    state = start(method, clients)
    losses = []
    for cid in clients:
        reply, new = method.client_fit(method.configure_fit(state.server, 1, cid), state.clients[cid], clients[cid])
        method.validate_reply(state.server, "fit", 1, cid, reply)
        assert not [n for n in reply.arrays if "lora_" in n] and new.adapter
        losses.append(method.client_evaluate(_own_base(reply), new, clients[cid])["train_loss"])
    assert np.mean(losses) < np.log(2) - 0.05  # below the starting loss log 2 (policy = reference)


def _own_base(reply):
    """An evaluation message carrying the client's own trained base (what it would see were it alone)."""
    from fedtailor.fl.records import Message

    return Message(arrays=dict(reply.arrays.items()))
