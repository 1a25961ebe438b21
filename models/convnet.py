"""Small two-convolution network for ImageNet-sized images.

Source: M. Hobbhahn and J. Sevilla, "What's the backward-forward FLOP ratio
for neural networks?", Appendix A (the "conv" network).

Sizes: input (N, 3, 224, 224);
Conv2d(3 -> 32, 7x7, stride 2, pad 3) -> ReLU -> MaxPool(3, stride 2, pad 1)
   [112x112 -> 56x56]
Conv2d(32 -> 64, 7x7, stride 2, pad 3) -> ReLU -> MaxPool(3, stride 2, pad 1)
   [28x28 -> 14x14]
AdaptiveAvgPool2d(1) -> flatten -> Linear(64 -> 10). Convolutions without bias, as in the
seed's code. Parameters: 105,706.
"""

from __future__ import annotations

import torch
from torch import nn


class ConvNet(nn.Module):
    """Two strided 7x7 convolutions with max pooling, then a linear head."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, kernel_size=7, stride=2, padding=3, bias=False)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map (N, 3, 224, 224) images to (N, num_classes) logits."""
        x = self.pool1(self.relu1(self.conv1(x)))
        x = self.pool2(self.relu2(self.conv2(x)))
        x = self.avgpool(x).flatten(1)
        return self.fc(x)


def example_inputs() -> tuple[torch.Tensor, ...]:
    """One fp32 image of size 3x224x224."""
    return (torch.randn(1, 3, 224, 224),)
