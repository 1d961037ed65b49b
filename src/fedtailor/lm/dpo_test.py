"""The DPO loss, implicit rewards and response log-probabilities against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from fedtailor.lm.dpo import dpo_loss, response_logprobs


def test_dpo_loss_and_rewards_match_a_hand_computation():
    pc, pr = torch.tensor([-10.0, -4.0]), torch.tensor([-12.0, -3.0])
    rc, rr = torch.tensor([-11.0, -4.5]), torch.tensor([-11.5, -3.5])
    out = dpo_loss(pc, pr, rc, rr, beta=0.2)
    # pair 1: h = 0.2 [(-10 + 11) - (-12 + 11.5)] = 0.2 * 1.5 = 0.3; pair 2: 0.2 [(0.5) - (0.5)] = 0
    want = (-math.log(1 / (1 + math.exp(-0.3))) - math.log(0.5)) / 2
    assert float(out.loss) == pytest.approx(want, rel=1e-6)
    torch.testing.assert_close(out.chosen_rewards, torch.tensor([0.2, 0.1]))
    torch.testing.assert_close(out.rejected_rewards, torch.tensor([-0.1, 0.1]))
    assert out.accuracy == 0.5  # a tie is not a correct pair
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(pc, pr, rc, rr, beta=0.0)


def test_dpo_gradient_pushes_chosen_up_and_rejected_down():
    pc = torch.tensor([-5.0], requires_grad=True)
    pr = torch.tensor([-5.0], requires_grad=True)
    dpo_loss(pc, pr, torch.tensor([-5.0]), torch.tensor([-5.0]), beta=0.5).loss.backward()
    assert float(pc.grad) == pytest.approx(-0.25) and float(pr.grad) == pytest.approx(0.25)  # -beta sigma(-0)


def test_response_logprobs_sum_only_the_masked_response_tokens():
    vocab = 5
    ids = torch.tensor([[1, 2, 3, 4, 0]])  # prompt 1 2 | response 3 4 | pad 0
    mask = torch.tensor([[0, 0, 1, 1, 0]])
    logits = torch.randn(1, 5, vocab, generator=torch.Generator().manual_seed(0))
    logp = torch.log_softmax(logits, -1)
    want = logp[0, 1, 3] + logp[0, 2, 4]  # token 3 is predicted at position 1, token 4 at position 2
    torch.testing.assert_close(response_logprobs(logits, ids, mask), want.reshape(1))
    with pytest.raises(ValueError, match="shapes differ"):
        response_logprobs(logits[:, :4], ids, mask)


def test_the_loss_equals_trl_dpo_trainer_on_its_own_batch(tmp_path):
    """TRL's DPOTrainer tokenizes and collates two preference pairs (prompt / chosen / rejected, EOS added) and
    computes its loss with a policy and a separate reference model; our response log-probabilities over its
    ``completion_mask`` and our DPO loss give the same number."""
    pytest.importorskip("trl")  # installed by scripts/install.sh --test --lm
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl import DPOConfig, DPOTrainer

    from fedtailor.lm.model import tiny_llama

    words = [
        "<pad>",
        "<eos>",
        "<bos>",
        "human",
        ":",
        "assistant",
        "how",
        "do",
        "i",
        "bake",
        "bread",
        "cake",
        "you",
        "mix",
        "flour",
        "water",
        "and",
        "sugar",
        "never",
        "ask",
        "me",
        "no",
        "please",
        "help",
    ]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    rows = [
        {
            "prompt": "human : how do i bake bread assistant :",
            "chosen": " you mix flour and water",
            "rejected": " never ask me",
        },
        {"prompt": "human : help me bake cake assistant :", "chosen": " mix flour water and sugar", "rejected": " no"},
    ]
    policy, reference = tiny_llama(vocab_size=len(words), seed=1), tiny_llama(vocab_size=len(words), seed=2)
    args = DPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, beta=0.2, max_length=64, report_to=[], use_cpu=True
    )
    trainer = DPOTrainer(
        model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok
    )
    batch = next(iter(trainer.get_train_dataloader()))  # chosen rows first, then rejected
    ids, attention, mask = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    assert mask.sum() > 0 and (mask <= attention).all()
    with torch.no_grad():
        theirs = trainer.compute_loss(trainer.model, batch)
        pc, pr = response_logprobs(policy(input_ids=ids, attention_mask=attention).logits, ids, mask).chunk(2)
        rc, rr = response_logprobs(reference(input_ids=ids, attention_mask=attention).logits, ids, mask).chunk(2)
    ours = dpo_loss(pc, pr, rc, rr, beta=0.2).loss
    assert abs(float(ours) - float(theirs)) < 1e-5 and abs(float(ours) - math.log(2)) > 1e-3  # not trivially equal


def test_bf16_on_a_device_that_only_emulates_it_is_named_with_the_fix(monkeypatch):
    """bf16 autocast on a CPU without AVX512-BF16 or AMX is emulated (a DPO step measured 29x slower than fp32 on
    one): the run says so in one line with the fix; on a CPU with either, or in fp32, nothing is said."""
    from fedtailor.lm.training import bf16_native, precision_warning

    cpu = torch.device("cpu")
    for avx512_bf16, amx in [(True, False), (False, True), (False, False)]:  # the last: emulated
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        native = avx512_bf16 or amx
        assert bf16_native(cpu) is native
        warning = precision_warning("bf16", cpu)
        assert (warning is None) is native
        assert precision_warning("fp32", cpu) is None
    assert "without AVX512-BF16 or AMX" in warning and "--set method.precision=fp32" in warning
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert "cuda:0 without bfloat16 support" in precision_warning("bf16", torch.device("cuda:0"))
