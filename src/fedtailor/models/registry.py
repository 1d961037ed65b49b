"""A small model registry: ``build_model(name, input_shape=..., num_classes=...)``."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from fedtailor.models.lenet import MLP, LeNet
from fedtailor.models.pflnets import DNN, FedAvgCNN
from fedtailor.rng import derive_seed

Builder = Callable[[tuple[int, int, int], int], nn.Module]


def _lenet(shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    c, h, w = shape
    if h != w:
        raise ValueError(f"lenet expects square images, got {h}x{w}.")
    return LeNet(in_channels=c, image_size=h, num_classes=num_classes)


def _mlp(shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    c, h, w = shape
    return MLP(in_features=c * h * w, num_classes=num_classes)


def _dnn(shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    c, h, w = shape
    return DNN(in_features=c * h * w, num_classes=num_classes)


def _fedavgcnn(shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    c, h, w = shape
    if h != w:
        raise ValueError(f"fedavgcnn expects square images, got {h}x{w}.")
    return FedAvgCNN(in_channels=c, image_size=h, num_classes=num_classes)


MODELS: dict[str, Builder] = {"lenet": _lenet, "mlp": _mlp, "dnn": _dnn, "fedavgcnn": _fedavgcnn}


def build_model(
    name: str, *, input_shape: tuple[int, int, int], num_classes: int, seed: int | None = None
) -> nn.Module:
    """Build a registered model; with ``seed`` its default initialisation is drawn from that public seed."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}.")
    if seed is None:
        return MODELS[name](tuple(input_shape), num_classes)
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "model-init", name))
        return MODELS[name](tuple(input_shape), num_classes)


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
