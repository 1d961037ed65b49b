"""What a model declares about its parts: the classification head and the layers.

A model names its head by a class attribute ``head`` (the module name of its last classifier, e.g. ``"fc"``);
personalized-FL methods that keep a head personal (FedPer, FedRep, FedBABU, FedRoD) read it from here rather
than guessing from parameter names. A *layer* (the unit FedLAG scores and personalizes) is either one
parameter tensor (``"tensor"``: a weight and its bias are two layers, as in the FedLAG authors' code) or one
module's parameters together (``"module"``). Layers follow ``named_parameters()`` order; buffers (e.g. BatchNorm
statistics) are never layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch
from torch import nn

LayerUnit = Literal["tensor", "module"]


def head_module(model: nn.Module) -> str:
    """The module name of the model's declared head."""
    name = getattr(model, "head", None)
    if not isinstance(name, str):
        raise ValueError(
            f"{type(model).__name__} declares no head: set a class attribute head = '<module name of the last "
            "classifier>' (e.g. head = 'fc') to use it with methods that keep a personal head."
        )
    modules = dict(model.named_modules())
    if name not in modules or not list(modules[name].parameters()):
        raise ValueError(f"{type(model).__name__}.head = {name!r} is not a module with parameters of the model.")
    return name


def head_names(model: nn.Module) -> frozenset[str]:
    """Names (as in ``named_parameters()``) of the head's parameters."""
    prefix = head_module(model) + "."
    return frozenset(n for n, _ in model.named_parameters() if n.startswith(prefix))


def layer_units(model: nn.Module, unit: LayerUnit = "tensor") -> list[tuple[str, ...]]:
    """The model's layers as tuples of parameter names, in ``named_parameters()`` order."""
    names = [n for n, _ in model.named_parameters()]
    if unit == "tensor":
        return [(n,) for n in names]
    if unit != "module":
        raise ValueError(f"layer unit must be 'tensor' or 'module', got {unit!r}.")
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(n.rpartition(".")[0], []).append(n)
    return [tuple(v) for v in groups.values()]


def channels_last(t: torch.Tensor) -> torch.Tensor:
    """A 4-D tensor in channels-last memory order (the CPU's pooling and convolution kernels run several times
    faster on it); other tensors as they are."""
    return t.contiguous(memory_format=torch.channels_last) if t.ndim == 4 else t


@contextmanager
def channels_last_convolutions(model: nn.Module) -> Iterator[None]:
    """Within the block, every ``nn.Conv2d`` of ``model`` returns its output channels-last (so the pooling after
    it runs on the fast kernel); the values are unchanged."""
    hooks = [
        m.register_forward_hook(lambda mod, args, out: channels_last(out))
        for m in model.modules()
        if isinstance(m, nn.Conv2d)
    ]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
