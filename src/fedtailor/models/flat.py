"""Flat parameter vectors: one 1-D tensor <-> a name->tensor dict in ``named_parameters()`` order."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class FlatLayout:
    """Names, shapes and offsets of a module's parameters laid end to end."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]

    @classmethod
    def of(cls, model: nn.Module) -> FlatLayout:
        named = list(model.named_parameters())
        return cls(tuple(n for n, _ in named), tuple(p.shape for _, p in named))

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(int(torch.Size(s).numel()) for s in self.shapes)

    @property
    def size(self) -> int:
        return sum(self.numels)

    def flatten(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([tensors[n].reshape(-1) for n in self.names])

    def unflatten(self, vec: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views into ``vec`` (shape (d,)) keyed by parameter name; batched input (..., d) keeps leading dims."""
        if vec.shape[-1] != self.size:
            raise ValueError(f"flat vector has {vec.shape[-1]} entries, the model has {self.size} parameters.")
        lead = vec.shape[:-1]
        parts = torch.split(vec, self.numels, dim=-1)
        return {n: p.reshape(*lead, *s) for n, p, s in zip(self.names, parts, self.shapes)}


def get_flat(model: nn.Module) -> torch.Tensor:
    """A detached copy of the model's parameters as one vector."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def set_flat(model: nn.Module, vec: torch.Tensor) -> None:
    """Copy ``vec`` into the model's parameters in place."""
    layout = FlatLayout.of(model)
    with torch.no_grad():
        for p, v in zip(model.parameters(), layout.unflatten(vec).values()):
            p.copy_(v)
