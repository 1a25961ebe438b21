"""Convolutional network on MNIST.

Source: A. G. Baydin, B. A. Pearlmutter, D. Syme, F. Wood and P. Torr,
"Gradients without Backpropagation", arXiv:2202.08587 (2022), MNIST
convolutional network experiment.

Sizes (defaults): input (N, 1, 28, 28);
Conv2d(1 -> 64, 3x3, pad 1) -> ReLU -> Conv2d(64 -> 64, 3x3, pad 1) -> ReLU
-> MaxPool2d(2)  [28 -> 14]
Conv2d(64 -> 64, 3x3, pad 1) -> ReLU -> Conv2d(64 -> 64, 3x3, pad 1) -> ReLU
-> MaxPool2d(2)  [14 -> 7]
flatten (64*7*7 = 3136) -> Linear(3136 -> 1024) -> ReLU -> Linear(1024 -> 10).
Parameters: 3,333,962. Example batch size 64.
"""

from __future__ import annotations

import torch
from torch import nn


class CNN(nn.Module):
    """Four 3x3 convolutions (64 channels) with two 2x2 max pools, then a 2-layer head."""

    def __init__(self, in_channels: int = 1, image_size: int = 28, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, padding=1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(64, 64, kernel_size=3, padding=1)
        self.relu2 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        self.conv3 = nn.Conv2d(64, 64, kernel_size=3, padding=1)
        self.relu3 = nn.ReLU()
        self.conv4 = nn.Conv2d(64, 64, kernel_size=3, padding=1)
        self.relu4 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(64 * (image_size // 4) ** 2, 1024)
        self.relu5 = nn.ReLU()
        self.fc2 = nn.Linear(1024, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map (N, in_channels, image_size, image_size) images to (N, num_classes) logits."""
        x = self.relu1(self.conv1(x))
        x = self.pool1(self.relu2(self.conv2(x)))
        x = self.relu3(self.conv3(x))
        x = self.pool2(self.relu4(self.conv4(x)))
        x = self.relu5(self.fc1(x.flatten(1)))
        return self.fc2(x)


def example_inputs() -> tuple[torch.Tensor, ...]:
    """A batch of 64 fp32 MNIST-sized images."""
    return (torch.randn(64, 1, 28, 28),)
