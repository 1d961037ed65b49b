"""The DPO objective: *Direct Preference Optimization: Your Language Model is Secretly a Reward Model* (Rafailov,
Sharma, Mitchell, Ermon, Manning, Finn, 2023, arXiv:2305.18290), Eq. 7.

Notation: for a pair (x, y+, y-), ``log pi(y | x)`` is the sum of the log-probabilities of the response tokens
only (the prompt is masked out); ``pi_ref`` is the frozen initial model. With

    h = beta [(log pi(y+|x) - log pi_ref(y+|x)) - (log pi(y-|x) - log pi_ref(y-|x))],

the loss is ``-log sigmoid(h)`` averaged over pairs, and the implicit rewards are
``r(y) = beta (log pi(y|x) - log pi_ref(y|x))``; a pair counts as correct (reward accuracy) when
``r(y+) > r(y-)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def response_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``sum_t m_t log p(token_t | tokens_<t)`` per sequence: logits (B, T, V) of ``input_ids`` (B, T), mask (B, T)
    with 1 on response tokens. Token ``t`` is scored by the logits at position ``t - 1``."""
    if logits.shape[:2] != input_ids.shape or response_mask.shape != input_ids.shape:
        raise ValueError(
            f"shapes differ: logits {tuple(logits.shape)}, ids {tuple(input_ids.shape)}, "
            f"mask {tuple(response_mask.shape)}."
        )
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    token_logp = logp.gather(2, input_ids[:, 1:, None]).squeeze(2)
    return (token_logp * response_mask[:, 1:].to(token_logp.dtype)).sum(1)


@dataclass
class DPOOutput:
    loss: torch.Tensor  # scalar, mean over pairs
    chosen_rewards: torch.Tensor  # (B,)
    rejected_rewards: torch.Tensor  # (B,)

    @property
    def accuracy(self) -> float:
        return float((self.chosen_rewards > self.rejected_rewards).float().mean())


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
) -> DPOOutput:
    """The DPO loss and implicit rewards from sequence log-probabilities (each (B,))."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}.")
    chosen = beta * (policy_chosen - ref_chosen)
    rejected = beta * (policy_rejected - ref_rejected)
    loss = -F.logsigmoid(chosen - rejected).mean()
    return DPOOutput(loss=loss, chosen_rewards=chosen.detach(), rejected_rewards=rejected.detach())
