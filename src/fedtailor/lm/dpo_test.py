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


def test_against_trl_where_installed():
    trl = pytest.importorskip("trl")  # noqa: F841 - an optional cross-check
    from trl.trainer.dpo_trainer import DPOTrainer

    pc, pr, rc, rr = (torch.tensor([v]) for v in (-3.0, -5.0, -4.0, -4.5))
    ours = dpo_loss(pc, pr, rc, rr, beta=0.2)
    theirs = DPOTrainer.dpo_loss(None, pc, pr, rc, rr)  # pragma: no cover - API varies by version
    torch.testing.assert_close(ours.loss, theirs[0].mean())
