"""The LeNet-style network of the compact-adaptation paper, *Privacy-Aligned Personalized Federated Learning
with Compact Adaptation and Variable-Length Gaussian Communication*.

conv 5x5 (C -> 16) + ReLU + maxpool 2, conv 5x5 (16 -> 32) + ReLU + maxpool 2, flatten, linear -> 120, ReLU,
linear -> 84, ReLU, linear -> classes. d_theta = 85,822 on 1x28x28 and 121,182 on 3x32x32. Each pooling is
computed before its ReLU: max and ReLU commute exactly (outputs and gradients are the same bit for bit), and the
ReLU then runs on a quarter of the values.

Inputs arrive with pixels in [0, 1] (the context statistic needs raw pixels); the networks first map them to
[-1, 1] with the fixed, data-independent affine (x - 0.5) / 0.5, which is not a parameter (d_theta unchanged)
and uses no statistic of anyone's data.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn


class LeNet(nn.Module):
    head: ClassVar[str] = "fc3"  # the classifier personalized-FL methods split off

    def __init__(self, *, in_channels: int = 1, image_size: int = 28, num_classes: int = 10) -> None:
        super().__init__()
        side = ((image_size - 4) // 2 - 4) // 2
        if side < 1:
            raise ValueError(f"LeNet needs images of at least 16x16 pixels, got {image_size}x{image_size}.")
        self.conv1 = nn.Conv2d(in_channels, 16, 5)
        self.conv2 = nn.Conv2d(16, 32, 5)
        self.fc1 = nn.Linear(32 * side * side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(torch.max_pool2d(self.conv1((x - 0.5) / 0.5), 2))
        x = torch.relu(torch.max_pool2d(self.conv2(x), 2))
        x = torch.relu(self.fc1(x.flatten(1)))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


class MLP(nn.Module):
    """A small two-hidden-layer perceptron for tiny inputs (e.g. 8x8 digits)."""

    head: ClassVar[str] = "fc3"

    def __init__(self, *, in_features: int, num_classes: int = 10, hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(((x - 0.5) / 0.5).flatten(1)))
        return self.fc3(torch.relu(self.fc2(x)))
