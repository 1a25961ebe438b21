"""Convolutional network with one weight-shared 3x3 convolution applied many times.

Source: M. Hobbhahn and J. Sevilla, "What's the backward-forward FLOP ratio
for neural networks?", Appendix A (the "deeper conv" network).

Sizes, as in the seed's code (convolutions without bias): input (N, 3, 224, 224);
Conv2d(3 -> 32, 7x7, stride 2, pad 3) -> ReLU -> MaxPool(3, stride 2, no padding)
   [112x112 -> 55x55]
middle_layers (default 100) x [Conv2d(32 -> 32, 3x3, pad 1) -> ReLU], all
   applications sharing one conv module (one set of weights)   [55x55]
Conv2d(32 -> 64, 7x7, stride 2, pad 3) -> ReLU   [28x28]
AdaptiveAvgPool2d(1) -> flatten -> Linear(64 -> 10). Parameters: 114,922.
"""

from __future__ import annotations

import torch
from torch import nn


class DeeperConvNet(nn.Module):
    """Stem conv, a shared 3x3 conv repeated ``middle_layers`` times, then a head."""

    def __init__(self, middle_layers: int = 100, num_classes: int = 10) -> None:
        super().__init__()
        self.middle_layers = middle_layers
        self.conv1 = nn.Conv2d(3, 32, kernel_size=7, stride=2, padding=3, bias=False)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(kernel_size=3, stride=2)
        # A single module, called middle_layers times in forward (shared weights).
        self.middle = nn.Conv2d(32, 32, kernel_size=3, padding=1, bias=False)
        self.middle_relu = nn.ReLU()
        self.conv2 = nn.Conv2d(32, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.relu2 = nn.ReLU()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map (N, 3, 224, 224) images to (N, num_classes) logits."""
        x = self.pool1(self.relu1(self.conv1(x)))
        for _ in range(self.middle_layers):
            x = self.middle_relu(self.middle(x))
        x = self.relu2(self.conv2(x))
        x = self.avgpool(x).flatten(1)
        return self.fc(x)


def example_inputs() -> tuple[torch.Tensor, ...]:
    """One fp32 image of size 3x224x224."""
    return (torch.randn(1, 3, 224, 224),)
