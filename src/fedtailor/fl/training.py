"""Local training and evaluation of a classifier on a client's (x, y) tensors; shared by the image methods."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def local_sgd(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    prox_center: list[torch.Tensor] | None = None,
    prox_mu: float = 0.0,
) -> float:
    """``epochs`` passes of minibatch SGD over (x, y) in an order drawn from ``generator``; returns the mean
    training loss. With ``prox_center`` adds (mu/2)||w - w_center||^2 (FedProx's proximal term)."""
    if len(x) == 0:
        raise ValueError("local_sgd got no training records.")
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    model.train()
    total, count = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator, device=generator.device).to(x.device)
        for start in range(0, len(x), batch_size):
            idx = order[start : start + batch_size]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            if prox_center is not None and prox_mu > 0:
                loss = loss + 0.5 * prox_mu * sum(
                    (p - c).pow(2).sum() for p, c in zip(model.parameters(), prox_center)
                )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
            count += len(idx)
    return total / count


@torch.no_grad()
def accuracy_and_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, batch_size: int = 1024) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on (x, y)."""
    if len(x) == 0:
        raise ValueError("cannot evaluate on zero records.")
    model.eval()
    correct, loss = 0, 0.0
    for start in range(0, len(x), batch_size):
        logits = model(x[start : start + batch_size])
        target = y[start : start + batch_size]
        correct += int((logits.argmax(1) == target).sum())
        loss += float(F.cross_entropy(logits, target, reduction="sum"))
    return correct / len(x), loss / len(x)
