"""The two networks of the FedLAG setup, as PFLlib defines them (*PFLlib: A Beginner-Friendly and
Comprehensive Personalized Federated Learning Library*, Zhang et al. 2023, arXiv:2312.04992), which the
FedLAG paper's experiments use.

* ``DNN``: flatten, linear 784 -> 100, ReLU, linear 100 -> classes (79,510 parameters on MNIST).
* ``FedAvgCNN``: conv 5x5 (C -> 32) + ReLU + maxpool 2, conv 5x5 (32 -> 64) + ReLU + maxpool 2, flatten,
  linear 1024 -> 512 + ReLU, linear 512 -> classes (582,026 parameters on 1x28x28), the CNN of
  *Communication-Efficient Learning of Deep Networks from Decentralized Data* (McMahan et al., 2017,
  arXiv:1602.05629).

Each declares its classification ``head`` (the module personalized-FL methods split off; see
:mod:`fedtailor.models.parts`). Pixels in [0, 1] are mapped to [-1, 1] by the fixed affine (x - 0.5) / 0.5, as
PFLlib's normalisation with mean 0.5 and std 0.5.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn


class DNN(nn.Module):
    head: ClassVar[str] = "fc"

    def __init__(self, *, in_features: int = 784, hidden: int = 100, num_classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.fc1(((x - 0.5) / 0.5).flatten(1))))


class FedAvgCNN(nn.Module):
    head: ClassVar[str] = "fc"

    def __init__(self, *, in_channels: int = 1, image_size: int = 28, num_classes: int = 10) -> None:
        super().__init__()
        side = ((image_size - 4) // 2 - 4) // 2
        if side < 1:
            raise ValueError(f"FedAvgCNN needs images of at least 16x16 pixels, got {image_size}x{image_size}.")
        self.conv1 = nn.Conv2d(in_channels, 32, 5)
        self.conv2 = nn.Conv2d(32, 64, 5)
        self.fc1 = nn.Linear(64 * side * side, 512)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1((x - 0.5) / 0.5)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc(torch.relu(self.fc1(x.flatten(1))))
