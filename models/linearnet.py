"""Fully connected network on flattened ImageNet-sized images.

Source: M. Hobbhahn and J. Sevilla, "What's the backward-forward FLOP ratio
for neural networks?", Appendix A (the "linear" network).

Sizes: input (N, 3, 224, 224) flattened to 150528 features,
Linear(150528 -> 4096) -> ReLU -> Linear(4096 -> 128) -> ReLU
-> Linear(128 -> 10). Parameters: 617,092,490.
"""

from __future__ import annotations

import torch
from torch import nn


class LinearNet(nn.Module):
    """Three-layer MLP over a flattened 3x224x224 image."""

    def __init__(self, in_features: int = 224 * 224 * 3, num_classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, 4096)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(4096, 128)
        self.relu2 = nn.ReLU()
        self.fc3 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map (N, 3, 224, 224) images to (N, num_classes) logits."""
        x = x.flatten(1)
        x = self.relu1(self.fc1(x))
        x = self.relu2(self.fc2(x))
        return self.fc3(x)


def example_inputs() -> tuple[torch.Tensor, ...]:
    """One fp32 image of size 3x224x224."""
    return (torch.randn(1, 3, 224, 224),)
